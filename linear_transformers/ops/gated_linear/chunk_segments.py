"""The chunked form's outer loop: a sequence in segments, with a backward pass that recomputes
each segment rather than storing it.

Legend: B batch, T time, L steps per segment, G segments (T = G * L).

`run_segments(segment_fn, consts, inputs, flags, carry, ...)` runs

  segment_fn(consts, carry, inputs_seg, flags_seg) -> (carry, out_seg)

over the G segments of time-major-second arrays ([B, T, ...]; `flags` are boolean [B, T, ...]
and get no gradient), carrying a state from one segment to the next:

- forward: one `lax.scan` over segment indices; each iteration slices its segment out of the
  inputs and writes its output into one [B, T, ...] buffer. Whatever the segment function does
  per step (feature maps, masking, relayout) happens one segment at a time, in cache, and
  nothing the size of the sequence is stored beside the inputs.
- backward (`jax.custom_vjp`): the residuals are the inputs themselves and the G states that
  enter the segments; a reversed `lax.scan` recomputes each segment and takes the VJP of that
  segment alone, carrying the state's cotangent from the segment after it, writing the inputs'
  cotangents in place and summing the constants'. The backward holds one segment's
  intermediates at a time.

The gradients are exactly the chain rule over the loop: each segment's own VJP, composed.
`consts` are arrays every segment reads (e.g. a feature map's projection, found by
`jax.closure_convert`), differentiated too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from linear_transformers.ops import sequence_parallel as sp


def _sum_over_added_axes(cotangent, primal):
    """The cotangent of a value that `sp.vary` marked varying: summed over the axes it gained
    (the transpose of marking an invariant value varying is a sum over devices)."""

    def reduce(d, x):
        extra = jax.typeof(d).manual_axis_type.varying - jax.typeof(x).manual_axis_type.varying
        return jax.lax.psum(d, tuple(sorted(extra))) if extra else d

    return jax.tree.map(reduce, cotangent, primal)


def pad_time(x, pad: int):
    """x [B, T, ...] followed by `pad` >= 0 steps of zeros (None stays None; pad 0: x itself): a
    sequence padded to a whole number of segments or chunks."""
    if x is None or pad == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _slice(x, i, L: int):
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * L, L, axis=1)


def _segment(arrays, i, L: int):
    return tuple(_slice(x, i, L) for x in arrays)


def _write(buffer, i, segment, L: int):
    return jax.lax.dynamic_update_slice_in_dim(buffer, segment.astype(buffer.dtype), i * L, axis=1)


def _forward_loop(segment_fn, consts, inputs, flags, carry, G: int, L: int, out_spec):
    def body(state, i):
        carry, out = state
        new_carry, out_segment = segment_fn(consts, carry, _segment(inputs, i, L), _segment(flags, i, L))
        return (new_carry, _write(out, i, out_segment, L)), carry

    axes = sp.varying_axes(consts, inputs, flags, carry)
    (carry, out), carries_in = jax.lax.scan(body, sp.vary((carry, jnp.zeros(*out_spec)), axes), jnp.arange(G))
    return out, carry, carries_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6, 7))
def run_segments(segment_fn, consts, inputs, flags, carry, G: int, L: int, out_spec):
    """`segment_fn` over G segments of L steps of `inputs` and `flags` (tuples of [B, G*L, ...]
    arrays or None), from the state `carry`. `out_spec` = (shape, dtype) of the [B, G*L, ...]
    output. Returns (out, final carry)."""
    out, carry, _ = _forward_loop(segment_fn, consts, inputs, flags, carry, G, L, out_spec)
    return out, carry


def _run_segments_fwd(segment_fn, consts, inputs, flags, carry, G, L, out_spec):
    out, final, carries_in = _forward_loop(segment_fn, consts, inputs, flags, carry, G, L, out_spec)
    return (out, final), (consts, inputs, flags, carry, carries_in)


def _zeros_like(x):
    return None if x is None else jnp.zeros(x.shape, x.dtype)


def _no_cotangent(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _run_segments_bwd(segment_fn, G, L, out_spec, residuals, cotangents):
    consts, inputs, flags, carry, carries_in = residuals
    d_out, d_final = cotangents

    def body(state, i):
        d_carry, d_consts, d_inputs = state
        flags_segment = _segment(flags, i, L)
        carry_in = jax.tree.map(lambda x: x[i], carries_in)
        _, vjp = jax.vjp(
            lambda c, s, x: segment_fn(c, s, x, flags_segment), consts, carry_in, _segment(inputs, i, L)
        )
        d_consts_i, d_carry_in, d_inputs_i = vjp((d_carry, _slice(d_out, i, L).astype(out_spec[1])))
        d_consts = jax.tree.map(jnp.add, d_consts, d_consts_i)
        d_inputs = tuple(
            None if buffer is None else _write(buffer, i, d, L) for buffer, d in zip(d_inputs, d_inputs_i)
        )
        return (d_carry_in, d_consts, d_inputs), None

    start = (d_final, jax.tree.map(jnp.zeros_like, consts), tuple(_zeros_like(x) for x in inputs))
    start = sp.vary(start, sp.varying_axes(residuals, cotangents))
    (d_carry, d_consts, d_inputs), _ = jax.lax.scan(body, start, jnp.arange(G), reverse=True)
    d_consts, d_inputs = _sum_over_added_axes((d_consts, d_inputs), (consts, inputs))
    d_carry = _sum_over_added_axes(d_carry, carry)
    return d_consts, d_inputs, tuple(_no_cotangent(x) for x in flags), d_carry


run_segments.defvjp(_run_segments_fwd, _run_segments_bwd)
