"""The "pallas" form's forward: the one-pass kernel (`pallas_kernels.forward_kernel`), a
program a sequence or, with several walks, a program a stretch from the state joined for it;
or the parallel forward (`pallas.Tuning.parallel_forward`): the states entering every
chunk first, then every chunk's output at once.

Legend: B batch, T time, H heads, D key/query features, M value features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops.gated_linear import pallas_kernels, pallas_launch, pallas_walks


def forward(config, q, k, v, g, valid, runs, before, s0, z0):
    """`pallas._attend`'s outputs, with the normaliser's den [B, T, H] (float32) before clean
    (None without a normaliser), and after it the one-pass forward's joined walks (`_walk_starts`:
    the states entering each walk and the walks' total factors, which the backward's walks
    start from) or None."""
    if config.tuning.parallel_forward:
        return _parallel_forward(config, q, k, v, g, valid, runs, before, s0, z0)
    B, T, H, M = v.shape
    value_block = config.value_block(M)
    walks = pallas_walks.Walks(config, T // config.C, g, runs)
    starts, walked = (s0, z0), None
    if walks.joined:
        inputs = (q, k, v, g, valid, runs, before)
        starts, final, walk_totals = _walk_starts(config, value_block, walks, inputs, s0, z0)
        walked = starts, walk_totals
    out = jax.ShapeDtypeStruct((B, T, H, M), v.dtype)
    clean = jax.ShapeDtypeStruct((B, H, M // value_block * walks.count), jnp.int32)
    kernel = pallas_launch.bind(
        pallas_kernels.forward_kernel, config, q, g, valid, runs, walk_chunks=walks.chunks
    )
    operands = pallas_launch.operands(q, k, v, g, valid, runs, before, *starts)
    outputs = [(out, "values"), (starts[0], "state")]  # each walk's final states, at its rows
    if z0 is not None:
        outputs += [(starts[1], "row"), (jax.ShapeDtypeStruct((B, T, H), config.acc), "time")]
    outputs += [(clean, "walk flags" if walks.joined else "flags")]
    out, s, *results = pallas_launch.call(kernel, config, value_block, operands, outputs, passes=walks.count)
    z, den = results[:2] if z0 is not None else (None, None)
    if walks.joined:  # the last walk's final states are the join's
        s, z = final
    return out, s, z, den, jnp.min(results[-1].reshape(B, H, -1, walks.count), axis=-1), walked


def _walk_starts(config, value_block: int, walks, inputs, s0, z0):
    """((s, z): the states entering each walk of the one-pass forward, [B, H, walks * D, M]
    and [B, H, walks * D] (z None without a normaliser), the final states, [the walks' total
    factors]), from `chunk_states_kernel`'s walks from zero, each writing only its final
    states and total factor, joined. `inputs`: (q, k, v, g, valid, runs, before)."""
    _, finals, walk_totals, _ = _walk_states(config, value_block, walks, inputs, s0, z0, write_chunks=False)
    return *walks.join((s0, z0), finals, walk_totals, config.acc), walk_totals


def _walk_states(config, value_block: int, walks, inputs, s0, z0, *, write_chunks: bool):
    """`chunk_states_kernel`'s results: ([the states entering each chunk, [z's]] with
    `write_chunks`, else []; (s, z): the final states, each walk's; [the walks' factors];
    clean [B, H, value blocks] with `write_chunks`, else None: the one-pass forward's programs
    write their own). `inputs`: (q, k, v, g, valid, runs, before)."""
    q, _, _, g, valid, runs, _ = inputs
    B, H, D, M = s0.shape
    normalize = z0 is not None
    outputs = []
    if write_chunks:  # chunk c's at rows c * D
        outputs += [(jax.ShapeDtypeStruct((B, H, walks.num_chunks * D, M), config.snapshots), "state")]
        if normalize:
            outputs += [(jax.ShapeDtypeStruct((B, H, walks.num_chunks * D), config.acc), "row")]
    n = len(outputs)
    outputs += walks.finals(s0, z0) + walks.factors(s0, chunks=write_chunks)
    if write_chunks:
        flags = jax.ShapeDtypeStruct((B, H, M // value_block * walks.count), jnp.int32)
        outputs += [(flags, "walk flags" if walks.joined else "flags")]
    walk = dict(walk_chunks=walks.chunks, write_chunks=write_chunks)
    kernel = pallas_launch.bind(pallas_kernels.chunk_states_kernel, config, q, g, valid, runs, **walk)
    operands = pallas_launch.operands(*inputs, *walks.starts(s0, z0))
    results = pallas_launch.call(kernel, config, value_block, operands, outputs, passes=walks.count)
    finals = results[n], results[n + 1] if normalize else None
    if not write_chunks:
        return [], finals, results[n + 1 + normalize :], None
    clean = jnp.min(results[-1].reshape(B, H, -1, walks.count), axis=-1)
    return results[:n], finals, results[n + 1 + normalize : -1], clean


def _parallel_forward(config, q, k, v, g, valid, runs, before, s0, z0):
    """`forward`'s outputs from `Tuning.parallel_forward`'s two kernels."""
    B, T, H, M = v.shape
    num_chunks = T // config.C
    value_block = config.value_block(M)
    normalize = z0 is not None
    walks = pallas_walks.Walks(config, num_chunks, g, runs)
    inputs = (q, k, v, g, valid, runs, before)
    chunk_states, (s, z), factors, clean = _walk_states(
        config, value_block, walks, inputs, s0, z0, write_chunks=True
    )
    states, z_states = chunk_states[0], chunk_states[1] if normalize else None
    joins = []
    if walks.joined:
        entering, (s, z) = walks.join((s0, z0), (s, z), factors, config.snapshots)
        joins = walks.join_operands(entering, factors[:1])

    outputs = [(jax.ShapeDtypeStruct((B, T, H, M), v.dtype), "values")]
    if normalize:
        outputs += [(jax.ShapeDtypeStruct((B, T, H), config.acc), "time")]
    kernel = pallas_launch.bind(
        pallas_kernels.chunk_outputs_kernel, config, q, g, valid, runs, walk_chunks=walks.chunks
    )
    operands = pallas_launch.operands(q, k, v, g, valid, runs, before, None, None) + [(states, "state")]
    operands += [(z_states, "row")] if normalize else []
    out, *den = pallas_launch.call(kernel, config, value_block, operands + joins, outputs, passes=num_chunks)
    return out, s, z, den[0] if normalize else None, clean, None
