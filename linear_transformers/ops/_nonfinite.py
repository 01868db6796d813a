"""Non-finite values reach only the queries that can see them.

A product with masked weights computes 0 * v for every key a query cannot see, and 0 * inf and
0 * NaN are NaN: one bad value at a later position, or in padding, would spoil every earlier
output. The forms that multiply by masked weights (causal linear "reference" and "chunked",
softmax) therefore run on `finite_part(v)` and then write NaN exactly where a query sees a
non-finite value (`seen_nonfinite_BTHM`). A seen inf gives NaN rather than +-inf: either way
the output is not finite, and the training loop refuses the step.

Finding the first bad step per query costs about as much as the chunked form's own forward
(BENCHMARKS.md), so `mark_unless_all_finite` does it only when some value is not finite (one
reduction decides).

Legend: B batch, T query time, S key time, H heads, M value features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mark_unless_all_finite(v, result, mark):
    """`result` as it is when every entry of v is finite, else `mark(result)`; `lax.cond` runs
    the marking only when needed (under `vmap`, always: still correct). Only the marking sits
    in the cond: a whole attention form inside it would keep both branches' residuals for the
    backward pass (far more memory)."""
    return jax.lax.cond(jnp.all(jnp.isfinite(v)), lambda r: r, mark, result)


def finite_part(v):
    """v with its non-finite entries replaced by 0 (`where`, so no NaN survives)."""
    return jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))


def seen_nonfinite_BTHM(
    v_BSHM, *, num_queries: int, causal: bool, key_lengths=None, mask_BHTS=None, reset_BT=None
):
    """bool [B, T, H, M]: query t sees a non-finite v[s, m] through the masks.

    key_lengths: int [B], keys s >= key_lengths[b] are unseen; mask_BHTS: boolean, broadcastable
    to [B, H, T, S], True = seen (costs one [T, S] x [S, M] product); causal: s <= t (T == S);
    reset_BT (causal only): True where a segment begins, so a query sees only its own segment's
    keys.
    """
    B, S, H, M = v_BSHM.shape
    bad_BSHM = ~jnp.isfinite(v_BSHM)
    if key_lengths is not None:
        bad_BSHM &= (jnp.arange(S)[None, :] < key_lengths[:, None])[:, :, None, None]
    if mask_BHTS is not None:
        seen_BHTS = jnp.broadcast_to(mask_BHTS, (B, H, num_queries, S))
        if causal:
            seen_BHTS &= jnp.tril(jnp.ones((num_queries, S), bool))
        return jnp.einsum("bhts,bshm->bthm", seen_BHTS.astype(jnp.float32), bad_BSHM.astype(jnp.float32)) > 0
    if causal and reset_BT is not None:
        # From the last bad key on, up to the next segment's start: seen when the latest bad key
        # at or before t lies in t's segment.
        index = jnp.arange(S)
        last_bad_BSHM = jax.lax.cummax(jnp.where(bad_BSHM, index[None, :, None, None], -1), axis=1)
        starts_BS = jnp.where(reset_BT | (index == 0)[None], index[None], 0)
        segment_start_BS = jax.lax.cummax(starts_BS, axis=1)
        return last_bad_BSHM >= segment_start_BS[:, :, None, None]
    if causal:
        return from_first(bad_BSHM, axis=1)
    return jnp.broadcast_to(jnp.any(bad_BSHM, axis=1, keepdims=True), (B, num_queries, H, M))


def from_first(bad, axis: int):
    """True from the first True of `bad` along `axis` on (a comparison with the first index,
    not a cumulative sum, which costs far more on CPU)."""
    n = bad.shape[axis]
    if n == 0:
        return bad
    first = jnp.where(jnp.any(bad, axis=axis, keepdims=True), jnp.argmax(bad, axis=axis, keepdims=True), n)
    shape = [1] * bad.ndim
    shape[axis] = n
    return jnp.arange(n).reshape(shape) >= first


def mark_seen(out_BTHM, seen_BTHM):
    """NaN where a query saw a non-finite value, `out` elsewhere."""
    return jnp.where(seen_BTHM, jnp.asarray(jnp.nan, out_BTHM.dtype), out_BTHM)
