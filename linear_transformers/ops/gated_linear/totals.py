"""What a stretch of steps does to the state, and the sums of log decays the forms are built from.

Legend: B batch, T time, H heads, F feature-map features, M value features, X decay features
(1 or F); `x` in a suffix: any leading shape.

A stretch of steps maps a state (s, z) to

  s_T = where(dropped, 0, a * s_0) + ds,   z_T = where(dropped, 0, a * z_0) + dz,

and (a, dropped, ds, dz) are its *totals*: the product of its decays, whether a segment begins
in it, and the state it builds from zero. `block_totals` computes them for a block,
`apply_totals` applies them, `scan_totals` scans per-step or per-chunk totals.

The decay between two steps is the exp of one sum of their log decays (`prefix_sum`,
`suffix_sum`, `pair_log_decay`): a sum of same-sign terms, never exp(+cumulative sum) nor the
difference of two running sums, so no factor overflows and no cancellation loses precision
however strong the decay. A reset is applied with `where`, never by multiplying by 0, so a
non-finite value in an earlier segment cannot reach a later one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import precision
from linear_transformers.ops.linear_state import normalise


def masked_sums(weights_TT, g, axis):
    """out_t = sum_i weights[t, i] * g_i along `axis` (weights 0 or +-1, one sign per row): a
    cumulative sum as a matmul, which XLA runs far faster on CPU than `cumsum` (a reduce-window)
    and which adds the same same-sign terms; in float32 whatever the matmul precision."""
    out = jnp.tensordot(
        jnp.moveaxis(g, axis, -1),
        weights_TT.astype(g.dtype),
        axes=((-1,), (1,)),
        precision=precision.EXACT,
    )
    return jnp.moveaxis(out, -1, axis)


def prefix_sum(g, axis):
    """sum_{i <= t} g_i along `axis` (inclusive)."""
    n = g.shape[axis]
    return masked_sums(jnp.tril(jnp.ones((n, n))), g, axis)


def suffix_sum(g, axis):
    """sum_{i > t} g_i along `axis` (exclusive): a sum of same-sign terms, never total - prefix."""
    n = g.shape[axis]
    index = jnp.arange(n)
    return masked_sums(index[None, :] > index[:, None], g, axis)


def pair_log_decay(g_xTX, time_axis):
    """L[t, s] = sum_{s < i <= t} g_i for every pair (t, s) of positions along `time_axis`:
    [..., T, X] -> [..., T(t), T(s), X], each entry one sum of same-sign terms (entries with
    s > t are 0 and masked by the caller). Short axes (chunks) as one matmul with a [T, T, T]
    0/1 matrix; long ones (the dense reference) as a cumulative sum down t, in O(T^2) memory."""
    g = jnp.moveaxis(g_xTX, time_axis, -2)
    T = g.shape[-2]
    index = jnp.arange(T)
    if T > 128:
        later_TS = index[:, None] > index[None, :]
        return jnp.cumsum(jnp.where(later_TS[:, :, None], g[..., :, None, :], 0), axis=-3)
    between_TTT = (index[None, None, :] > index[None, :, None]) & (
        index[None, None, :] <= index[:, None, None]
    )
    sums = jnp.tensordot(g, between_TTT.astype(g.dtype), axes=((-2,), (2,)), precision=precision.EXACT)
    return jnp.moveaxis(sums, -3, -1)


def runs(reset_xT):
    """Run index of each position (0 until the first reset of the block, then 1, ...)."""
    return jnp.cumsum(reset_xT.astype(jnp.int32), axis=-1)


def block_totals(phi_k_BTHF, v_BTHM, g_BTHX, reset_BT, acc, *, normalize):
    """The totals of a block of T prepared steps: (a_BHX or None, dropped_B or None, ds_BHFM,
    dz_BHF or None); ds and dz hold the keys of its last segment only, decayed to its end."""
    k = phi_k_BTHF.astype(acc)
    v = v_BTHM
    a = dropped = None
    if g_BTHX is not None:
        k = k * jnp.exp(suffix_sum(g_BTHX, axis=1))
        a = jnp.exp(jnp.sum(g_BTHX, axis=1))
    if reset_BT is not None:
        runs_BT = runs(reset_BT)
        tail_BT11 = (runs_BT == runs_BT[:, -1:])[:, :, None, None]
        k = jnp.where(tail_BT11, k, 0)
        v = jnp.where(tail_BT11, v, 0)
        dropped = runs_BT[:, -1] > 0
    ds = precision.einsum_in(acc, "bthf,bthm->bhfm", k, v)
    dz = jnp.sum(k, axis=1) if normalize else None
    return a, dropped, ds, dz


def expand(x, ndim):
    """`x` with trailing size-1 axes up to `ndim` (a per-example flag against a state)."""
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def apply_totals(state, totals):
    """The state after a stretch whose totals (`block_totals`, or an inclusive scan of them)
    are `totals`; every array may carry leading axes beyond the batch (steps, chunks)."""
    s0, z0 = state
    a, dropped, ds, dz = totals
    carried_s = s0 if a is None else a[..., :, None] * s0
    carried_z = None if z0 is None else (z0 if a is None else a * z0)
    if dropped is not None:
        carried_s = jnp.where(expand(dropped, carried_s.ndim), 0, carried_s)
        carried_z = None if z0 is None else jnp.where(expand(dropped, carried_z.ndim), 0, carried_z)
    return carried_s + ds, None if z0 is None else carried_z + dz


def _combine(first, second):
    """Two consecutive stretches of the recurrence as one: (decay, dropped, ds, dz)."""
    a1, r1, s1, z1 = first
    a2, r2, s2, z2 = second
    state = apply_totals((s1, z1), (a2, r2, s2, z2))
    a = None if a1 is None else a1 * a2
    r = None if r1 is None else r1 | r2
    return a, r, *state


def scan_totals(a, dropped, ds, dz, axis):
    """Inclusive scan of per-step (or per-chunk) totals along `axis`: a cumulative sum without
    decays or resets, else `lax.associative_scan` of `_combine`."""
    if a is None and dropped is None:
        return None, None, jnp.cumsum(ds, axis=axis), None if dz is None else jnp.cumsum(dz, axis=axis)
    return jax.lax.associative_scan(_combine, (a, dropped, ds, dz), axis=axis)


def finish(num, den, eps, dtype):
    """The output: num / (den + eps) with a normaliser (den not None), else num; in `dtype`."""
    return num.astype(dtype) if den is None else normalise(num, den, eps, dtype)
