"""The chunked form's decayed scores within a chunk: q_t . diag(decay from s to t) k_s for every
pair (t, s) of a chunk.

Legend: B batch, H heads, N chunks, C chunk length, F feature-map features, X decay features (1:
one decay per head and step; F: one per key feature), I and O blocks of a chunk (a query's and a
key's, in the exact form of per-feature decays).

Scores sum_f q_tf k_sf exp(L_tsf), L_tsf the log decay from s to t. Where every chunk's decays
stay within exp(+-FACTOR_RANGE) of its midpoint m (typical gates), they are one matmul of
q * exp(u) and k * exp(-u), u_t the log decay between m and t (`midpoint_factors`, whose factors
give the forms' other decays too): exact to a relative eps * FACTOR_RANGE. Otherwise (strong
decays) every pair's decay is summed on its own (`blocked_scores`; per feature: within blocks
of EXACT_BLOCK steps, and between blocks from factors that are all <= 1): exact and finite
whatever the decays, and slower. The forms choose with one `lax.cond` around a whole segment of
chunks or more (`in_either_form`, or the caller's own).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_transformers.ops import precision
from linear_transformers.ops.gated_linear import totals

FACTOR_RANGE = 30.0
EXACT_BLOCK = 8


def from_midpoint(g, axis):
    """u_t = sum_{m < i <= t} g_i after the midpoint m, -sum_{t < i <= m} g_i before it: each a
    sum of same-sign terms starting at m (no cancellation)."""
    n = g.shape[axis]
    t, i, m = jnp.arange(n)[:, None], jnp.arange(n)[None, :], n // 2
    signed_TT = jnp.where((m < i) & (i <= t), 1.0, 0.0) - jnp.where((t < i) & (i <= m), 1.0, 0.0)
    return totals.masked_sums(signed_TT, g, axis)


class MidpointFactors(NamedTuple):
    """The decays of a chunk that fits the factored form, from its midpoint m (steps on axis -2):
    up = exp(u) and down = exp(-u) [..., C, X], start_to_midpoint = exp(Gamma_m) and
    midpoint_to_end = exp(Gamma_C - Gamma_m) [..., 1, X], Gamma_t the chunk's log decay up to
    step t (inclusive). Every decay of the chunked forms is a product of two of them:
    exp(Gamma_t) = start_to_midpoint * up_t, exp(Gamma_C - Gamma_t) = midpoint_to_end * down_t,
    exp(Gamma_t - Gamma_s) = up_t * down_s, exp(Gamma_C) = start_to_midpoint * midpoint_to_end;
    exact to a relative eps * FACTOR_RANGE, as the factored scores are (two exponentials per
    step and feature, where summing each decay on its own takes four)."""

    up: jax.Array
    down: jax.Array
    start_to_midpoint: jax.Array
    midpoint_to_end: jax.Array


def midpoint_factors(g_xCX) -> MidpointFactors:
    """`MidpointFactors` of log decays g [..., C, X]. Gamma_m = g_1 - u_1 (step 1's decay and
    those up to m: a sum of same-sign terms)."""
    u = from_midpoint(g_xCX, axis=g_xCX.ndim - 2)
    start_to_midpoint = jnp.exp(g_xCX[..., :1, :] - u[..., :1, :])
    return MidpointFactors(jnp.exp(u), jnp.exp(-u), start_to_midpoint, jnp.exp(u[..., -1:, :]))


def fits_factored(u):
    """Whether every chunk's log decays stay within FACTOR_RANGE of its midpoint (the definition;
    `chunks_fit` finds the same from g in two sums per chunk)."""
    return jnp.max(jnp.abs(u)) <= FACTOR_RANGE


def chunks_fit(g, axis: int = -2):
    """`fits_factored(from_midpoint(g, axis))` for log decays g <= 0, chunk steps on `axis`: u
    falls from a chunk's first step to its last, so its extremes are the sum of the first half
    after step 0 and that of the second half. A NaN anywhere: False (the exact form)."""
    C = g.shape[axis]
    m = C // 2
    halves = (jax.lax.slice_in_dim(g, 1, m + 1, axis=axis), jax.lax.slice_in_dim(g, m + 1, C, axis=axis))
    widest = jnp.maximum(*(-jnp.sum(h, axis=axis) for h in halves))
    return jnp.max(widest) <= FACTOR_RANGE


def blocked_scores(q, k, g, acc):
    """[..., C, C] scores q_t . diag(decay from s to t) k_s of every pair of a chunk (s > t
    included: the caller masks them) with every pair's decay on its own; any leading shape,
    chunk steps on axis -2; q may have leading axes more than k and g (broadcast over them).
    One decay per head: exp(L_ts) times q_t . k_s. Per feature:
    blocks of EXACT_BLOCK steps, within a block the decays of every pair, between blocks q *
    exp(decay since its block began) * exp(decays of the blocks in between) * k * exp(decay to
    its block's end): sums of same-sign terms, every factor <= 1."""
    if g.shape[-1] == 1:
        C = q.shape[-2]
        mask = jnp.tril(jnp.ones((C, C), bool))
        decay = jnp.exp(jnp.where(mask, totals.pair_log_decay(g, time_axis=g.ndim - 2)[..., 0], -jnp.inf))
        return precision.einsum_in(acc, "...tf,...sf->...ts", q, k) * decay
    *lead, C, F = q.shape
    c = EXACT_BLOCK if C % EXACT_BLOCK == 0 else C
    n = C // c
    # q may carry leading axes k and g broadcast over (several queries scored against one k).
    k, g = jnp.broadcast_to(k, q.shape), jnp.broadcast_to(g, (*lead, C, g.shape[-1]))
    q, k = q.astype(acc), k.astype(acc)
    qb, kb, gb = (x.reshape(*lead, n, c, F) for x in (q, k, g))
    inner = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(inner[..., None], totals.pair_log_decay(gb, time_axis=gb.ndim - 2), -jnp.inf))
    within = jnp.einsum("...itf,...isf,...itsf->...its", qb, kb, decay)
    block = jnp.arange(n)
    between_ijl = (block[None, None, :] > block[None, :, None]) & (
        block[None, None, :] < block[:, None, None]
    )
    gap = jnp.exp(
        jnp.sum(jnp.where(between_ijl[..., None], jnp.sum(gb, axis=-2)[..., None, None, :, :], 0), axis=-2)
    )
    q_out = qb * jnp.exp(totals.prefix_sum(gb, axis=-2))
    k_in = kb * jnp.exp(totals.suffix_sum(gb, axis=-2))
    across = jnp.einsum("...itf,...iof,...osf->...iots", q_out, gap, k_in)
    earlier = block[:, None] > block[None, :]
    scores = jnp.where(earlier[:, :, None, None], across, 0) + jnp.where(
        jnp.eye(n, dtype=bool)[:, :, None, None], within[..., None, :, :], 0
    )
    return jnp.swapaxes(scores, -3, -2).reshape(*lead, C, C)


class ChunkDecays(NamedTuple):
    """A chunk's decays applied (steps on axis -2), per query array: the decayed scores
    q_t . diag(decay from s to t) k_s [..., C, C] (s > t included: the caller masks them) and the
    queries decayed from the chunk's start; k decayed to its end, and the whole chunk's decay
    [..., 1, X]."""

    scores: tuple[jax.Array, ...]
    queries_from_start: tuple[jax.Array, ...]
    k_to_end: jax.Array
    chunk_decay: jax.Array


def chunk_decays(queries_xCF, k_xCF, g_xCX, acc, *, factored: bool) -> ChunkDecays:
    """`ChunkDecays` of each array in `queries_xCF` (a tuple: several queries against one k share
    its decays) in the form `factored` names: every factor from `midpoint_factors` (the caller
    checked `chunks_fit`), or every decay summed on its own (`blocked_scores`, and sums of
    same-sign terms)."""
    queries, k = tuple(q.astype(acc) for q in queries_xCF), k_xCF.astype(acc)
    if factored:
        # One product per query array: stacking them first made KDA's forward+backward ~12%
        # slower on CPU (N = 4096).
        f = midpoint_factors(g_xCX)
        k_down = k * f.down
        ups = tuple(q * f.up for q in queries)
        scores = tuple(precision.einsum_in(acc, "...tf,...sf->...ts", q_up, k_down) for q_up in ups)
        from_start = tuple(f.start_to_midpoint * q_up for q_up in ups)
        chunk_decay = f.start_to_midpoint * f.midpoint_to_end
        return ChunkDecays(scores, from_start, f.midpoint_to_end * k_down, chunk_decay)
    scores = blocked_scores(jnp.stack(queries), k, g_xCX, acc)
    decay_from_start = jnp.exp(totals.prefix_sum(g_xCX, axis=g_xCX.ndim - 2))
    return ChunkDecays(
        tuple(scores),
        tuple(q * decay_from_start for q in queries),
        k * jnp.exp(totals.suffix_sum(g_xCX, axis=g_xCX.ndim - 2)),
        jnp.exp(jnp.sum(g_xCX, axis=-2, keepdims=True)),
    )


def in_either_form(fn, g_xCX, *operands):
    """fn(*operands, factored=...): factored=True where every chunk of `g_xCX` (per-feature log
    decays, chunk steps on axis -2) fits the factored form, else False; one `lax.cond`.

    The choice goes around a whole chunk computation (a segment's, or every chunk at once), not
    around the scores alone: a cond's operands and results are materialised, and there it kept
    XLA from fusing the rescaling and the masking into their neighbours. Its backward pass is
    one cond too, over the two branches' own backward passes recomputed from `operands`: the
    cond's own derivative carries both branches' residuals out of the forward pass (zeros for
    the branch not taken). In the chunked delta rule's segments (CPU, per-feature decays,
    N = 4096, forward+backward, one process) that took 1.2x as long as this."""
    return _in_either_form(fn, chunks_fit(g_xCX), *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _in_either_form(fn, fits, *operands):
    return jax.lax.cond(
        fits, functools.partial(fn, factored=True), functools.partial(fn, factored=False), *operands
    )


def _in_either_form_forward(fn, fits, *operands):
    return _in_either_form(fn, fits, *operands), (fits, operands)


def _in_either_form_backward(fn, residuals, cotangent):
    fits, operands = residuals

    def backward(factored):
        return lambda *operands: jax.vjp(functools.partial(fn, factored=factored), *operands)[1](cotangent)

    return (None, *jax.lax.cond(fits, backward(True), backward(False), *operands))


_in_either_form.defvjp(_in_either_form_forward, _in_either_form_backward)
