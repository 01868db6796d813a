"""The "pallas" form's backward: the one-pass kernel's passes (`pallas_kernels.backward_kernel`),
a program each a sequence or, with several walks, a stretch, from the states and cotangents
joined for it; or the parallel backward (`pallas.Tuning.parallel_backward`): the states
entering every chunk and the cotangents of those leaving it first, then every chunk's
gradients at once. Then, in XLA, the decays' cotangent from the kernels' query and key sides
(`pallas_kernels.py`), with the one-pass backward's carried states times their cotangents.

Legend: B batch, T time, H heads, D key/query features, M value features, C chunk length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linear_transformers.ops.gated_linear import pallas_kernels, pallas_launch, pallas_walks, totals


def backward(config, residuals, cotangents):
    """`pallas._attend`'s VJP: the cotangents of its arguments from `residuals`
    (`pallas._attend_fwd`'s) and those of its outputs."""
    q, k, v, g, valid, runs, before, s0, z0, out, den, walked = residuals
    d_out, d_s, d_z, _ = cotangents  # the last: of the int32 flags, none
    value_block = config.value_block(v.shape[-1])
    parts = v.shape[-1] // value_block
    d_den = None
    if z0 is not None:
        # den's cotangent, a sum over every value feature: -sum_m d out * num / (den + eps)**2
        # (FlashAttention's backward reads its stored output the same way).
        d_den = -jnp.sum(d_out.astype(den.dtype) * out.astype(den.dtype), axis=-1) / (den + config.eps)

    def summed(x, dtype):
        """An output of x's shape; with several value blocks, each block's part, summed after."""
        if parts == 1:
            return jax.ShapeDtypeStruct(x.shape, dtype), "time"
        return jax.ShapeDtypeStruct((parts, *x.shape), config.acc), "part"

    gradients = [summed(q, q.dtype), summed(k, k.dtype), (v, "values")]
    if g is not None:  # the decays' cotangent's query and key sides
        gradients += 2 * [summed(g, config.acc)]
    d_s, d_z = d_s.astype(s0.dtype), None if z0 is None else d_z.astype(z0.dtype)
    bwd = _Backward(
        config=config,
        value_block=value_block,
        walks=pallas_walks.Walks(config, v.shape[1] // config.C, g, runs),
        arrays=(q, k, v, g, valid, runs, before),
        output_cotangents=(d_out, den, d_den),
        ends=(s0, z0, d_s, d_z),
        gradients=gradients,
    )
    if config.tuning.parallel_backward:
        dq, dk, dv, *dG, ds0, dz0, carried = _parallel_backward(bwd)
    else:
        dq, dk, dv, *dG, ds0, dz0, carried = _one_pass_backward(bwd, walked)
    if parts > 1:
        dq, dk, *dG = (jnp.sum(x, axis=0) for x in (dq, dk, *dG))
        dq, dk = dq.astype(q.dtype), dk.astype(k.dtype)
    dg = None
    if g is not None:
        dg = _log_decay_cotangent(dG[0] - dG[1], config.C, carried, runs, before)
        if config.prepare is not None:  # through the preparation the kernels applied
            _, pullback = jax.vjp(
                lambda g: config.prepare.log_decays(g, None if valid is None else valid != 0), g
            )
            (dg,) = pullback(dg)
    no_cotangent = tuple(
        None if x is None else np.zeros(x.shape, jax.dtypes.float0) for x in (valid, runs, before)
    )
    return dq, dk, dv, dg, *no_cotangent, ds0, dz0


@dataclasses.dataclass(frozen=True)
class _Backward:
    """What one backward's kernels share: the static `config`, the `value_block`, the `walks`
    (`pallas_walks.Walks`), the padded inputs `arrays` (q, k, v, g, valid, runs, before),
    `output_cotangents` (d_out, den, d_den; den and d_den None without a
    normaliser), `ends` (the initial states and the final states' cotangents: s0, z0, d_s,
    d_z; z0 and d_z None without a normaliser) and the outputs `gradients` (dq, dk, dv [and
    the decays' parts])."""

    config: Any
    value_block: int
    walks: pallas_walks.Walks
    arrays: tuple
    output_cotangents: tuple
    ends: tuple
    gradients: list

    @property
    def normalize(self) -> bool:
        return self.ends[1] is not None

    def bind(self, kernel, **options):
        """`kernel` bound to this call's static options and `options`."""
        q, _, _, g, valid, runs, _ = self.arrays
        return pallas_launch.bind(kernel, self.config, q, g, valid, runs, **options)

    def launch(self, kernel, operands, outputs, *, programs: int):
        """`kernel` (bound) over `programs` programs a sequence and value block."""
        return pallas_launch.call(kernel, self.config, self.value_block, operands, outputs, passes=programs)

    def chunk_states(self):
        """The outputs of a state per chunk: [B, H, num_chunks * D, M] in `Config.snapshots`
        and, with a normaliser, its row [B, H, num_chunks * D] in acc."""
        B, H, D, M = self.ends[0].shape
        rows = [(jax.ShapeDtypeStruct((B, H, self.walks.num_chunks * D, M), self.config.snapshots), "state")]
        if self.normalize:
            rows += [(jax.ShapeDtypeStruct((B, H, self.walks.num_chunks * D), self.config.acc), "row")]
        return rows

    def inputs(self):
        """The inputs' operands (`pallas_launch.operands`), with no states."""
        return pallas_launch.operands(*self.arrays, None, None)

    def walk_operands(self, s0, z0, d_s, d_z):
        """What the loops over the chunks read (`backward_kernel`'s operands), from these states
        and cotangents."""
        d_out, den, d_den = self.output_cotangents
        operands = self.inputs() + [(s0, "state")] + ([(z0, "row")] if self.normalize else [])
        operands += [(d_out, "values"), (d_s, "state")]
        return operands + ([(den, "time"), (d_den, "time"), (d_z, "row")] if self.normalize else [])

    def chunk_operands(self):
        """What a program of one chunk reads (`chunk_gradients_kernel`'s first operands)."""
        d_out, den, d_den = self.output_cotangents
        operands = self.inputs() + [(d_out, "values")]
        return operands + ([(den, "time"), (d_den, "time")] if self.normalize else [])


def _one_pass_backward(bwd, walked):
    """(dq, dk, dv, [the decays' cotangent's query and key sides], d_s0, d_z0 or None, the
    carried states' part of the decays' cotangent (`_carried_product`) or None) from
    `backward_kernel`: its passes a program each per sequence, or per walk of it (from the
    ends `_walk_ends` joins). `walked`: the one-pass forward's joined walks
    (`pallas_forward.forward`'s) or None."""
    config, walks, ends = bwd.config, bwd.walks, bwd.ends
    joined = None
    if walks.joined:
        ends, joined = _walk_ends(bwd, walked)
    passes = config.tuning.backward_passes
    kernel = bwd.bind(pallas_kernels.backward_kernel, passes=passes, walk_chunks=walks.chunks)
    # d_s0 and d_z0: each walk's, at its rows
    states = [(ends[0], "state")] + ([(ends[1], "row")] if bwd.normalize else [])
    outputs = bwd.gradients[:3] + states + bwd.gradients[3:]
    has_decay = bwd.arrays[3] is not None
    if has_decay:  # the states each chunk carries over, the cotangents of those leaving it
        outputs += 2 * bwd.chunk_states()
    operands = bwd.walk_operands(*ends)
    dq, dk, dv, ds0, *rest = bwd.launch(kernel, operands, outputs, programs=passes * walks.count)
    dz0 = rest.pop(0) if bwd.normalize else None
    if joined is not None:  # the first walk's are the join's
        ds0, dz0 = joined
    carried = _carried_product(bwd, rest[2:]) if has_decay else None
    return (dq, dk, dv, *rest[:2], ds0, dz0, carried)


def _carried_product(bwd, states):
    """[B, num_chunks, H(, D)]: each chunk's `pallas_kernels.carried_product` (summed over
    the features with a decay per step), from `backward_kernel`'s states each chunk carries
    over and the cotangents of those leaving it (`_Backward.chunk_states` each)."""
    if bwd.normalize:
        carried, z_carried, leaving, z_leaving = states
    else:
        carried, leaving = states
    acc = bwd.config.acc
    product = jnp.sum(carried.astype(acc) * leaving.astype(acc), axis=-1)  # [B, H, num_chunks * D]
    if bwd.normalize:
        product = product + z_carried * z_leaving
    B, H, D, _ = bwd.ends[0].shape
    product = jnp.moveaxis(product.reshape(B, H, -1, D), 1, 2)
    return product if bwd.config.per_feature else jnp.sum(product, axis=-1)


def _walk_ends(bwd, walked):
    """((s, z, d_s, d_z): the states entering each walk of the one-pass backward and the
    cotangents of those leaving it, [B, H, walks * D, ...] (z and d_z None without a
    normaliser), (d_s0, d_z0)), from `backward_states_kernel`'s walks from zero, each writing
    only its ends (and total factor), joined; the states entering each walk and the totals
    are the one-pass forward's where it kept them (`walked`, else None: a parallel forward's
    walks wrote every chunk's)."""
    s0, z0, d_s, d_z = bwd.ends
    acc = bwd.config.acc
    _, _, d_finals, finals, factors = _backward_walks(bwd, write_chunks=False, walk_states=walked is None)
    if walked is None:
        first, _ = bwd.walks.join((s0, z0), finals, factors, acc)
    else:
        first, factors = walked
    last, joined = bwd.walks.join((d_s, d_z), d_finals, factors, acc, reverse=True)
    return (*first, *last), joined


def _backward_walks(bwd, *, write_chunks: bool, walk_states: bool = True):
    """`backward_states_kernel`'s results: (the states entering each chunk, the cotangents of
    those leaving it: [S, [z]] each with `write_chunks`, else []; (d_s0, d_z0): each walk's;
    with several walks (s, z), each walk's final states, and [the factors: to each chunk with
    `write_chunks`, out of each walk, back to each chunk with `write_chunks`], else None and
    []; without `walk_states`, only the cotangents' walks: ([], [], (d_s0, d_z0), None,
    []))."""
    walks = bwd.walks
    s0, z0, d_s, d_z = bwd.ends
    rows = bwd.chunk_states() if write_chunks else []
    finals = walks.finals(s0, z0)
    outputs = rows + rows + finals
    if walks.joined and walk_states:
        outputs += finals + walks.factors(s0, chunks=write_chunks)
        outputs += walks.factors(s0, backward=True) if write_chunks else []
    walk = dict(walk_chunks=walks.chunks, write_chunks=write_chunks, walk_states=walk_states)
    kernel = bwd.bind(pallas_kernels.backward_states_kernel, **walk)
    operands = bwd.walk_operands(*walks.starts(s0, z0), *walks.starts(d_s, d_z))
    walked = bwd.launch(kernel, operands, outputs, programs=(1 + walk_states) * walks.count)
    n, f = len(rows), len(finals)
    pair = lambda x: (x[0], x[1] if bwd.normalize else None)  # noqa: E731
    d_first = pair(walked[2 * n : 2 * n + f])
    if not (walks.joined and walk_states):
        return walked[:n], walked[n : 2 * n], d_first, None, []
    final = pair(walked[2 * n + f : 2 * n + 2 * f])
    return walked[:n], walked[n : 2 * n], d_first, final, walked[2 * n + 2 * f :]


def _parallel_backward(bwd):
    """(dq, dk, dv, [the decays' cotangent's query and key sides, the key side with the
    carried states' part], d_s0, d_z0 or None, None) from `Tuning.parallel_backward`'s two
    kernels: the states entering each chunk and the cotangents of those leaving it, then each
    chunk's gradients."""
    config, walks = bwd.config, bwd.walks
    s0, z0, d_s, d_z = bwd.ends
    entering, leaving, (ds0, dz0), final, factors = _backward_walks(bwd, write_chunks=True)
    layouts = ["state", "row"][: len(entering)]
    operands = bwd.chunk_operands() + list(zip(entering, layouts)) + list(zip(leaving, layouts))
    if walks.joined:  # factors: to each chunk, out of each walk, back to each chunk
        first, _ = walks.join((s0, z0), final, factors[:2], config.snapshots)
        last, (ds0, dz0) = walks.join((d_s, d_z), (ds0, dz0), factors[1:2], config.snapshots, reverse=True)
        operands += walks.join_operands(first, factors[:1]) + walks.join_operands(last, factors[2:])
    passes = config.tuning.backward_passes
    kernel = bwd.bind(pallas_kernels.chunk_gradients_kernel, walk_chunks=walks.chunks, passes=passes)
    grads = bwd.launch(kernel, operands, bwd.gradients, programs=walks.num_chunks * passes)
    return (*grads, ds0, dz0, None)


def _log_decay_cotangent(local, C: int, carried, runs, before):
    """d g [B, T, H(, D)] from `local` of the same shape, the kernels' sums within each chunk of
    C steps (the module docstring) and `carried` [B, T / C, H(, D)], each chunk's part through
    the state carried through it, which every step of the chunk takes (None: in `local`); 0
    at a segment's first step, whose decay nothing reads."""
    B, T = local.shape[:2]
    if carried is not None:
        by_chunk = local.reshape(B, T // C, C, *local.shape[2:]) + carried[:, :, None]
        local = by_chunk.reshape(local.shape)
    if runs is None:
        return local
    return jnp.where(totals.expand(runs != before, local.ndim), 0, local)
