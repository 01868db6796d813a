"""The chunked form's decayed scores within a chunk: q_t . diag(decay from s to t) k_s for every
pair (t, s) of a chunk.

Legend: B batch, H heads, N chunks, C chunk length, F feature-map features, X decay features (1:
one decay per head and step; F: one per key feature), I and O blocks of a chunk (a query's and a
key's, in the exact form of per-feature decays).

Scores sum_f q_tf k_sf exp(L_tsf), L_tsf the log decay from s to t. Where every chunk's decays
stay within exp(+-FACTOR_RANGE) of its midpoint m (typical gates), they are one matmul of
q * exp(u) and k * exp(-u), u_t the log decay between m and t: exact to a relative
eps * FACTOR_RANGE. Otherwise (strong decays) every pair's decay is summed on its own (per
feature: within blocks of EXACT_BLOCK steps, and between blocks from factors that are all <= 1):
exact and finite whatever the decays, and slower. `lax.cond` picks one per segment of chunks;
the backward pass recomputes the one taken from its inputs.
"""

from __future__ import annotations

import functools

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


def fits_factored(u):
    """Whether every chunk's log decays stay within FACTOR_RANGE of its midpoint."""
    return jnp.max(jnp.abs(u)) <= FACTOR_RANGE


def _factored_scores(q, k, u, acc):
    return precision.einsum_in(acc, "...tf,...sf->...ts", q * jnp.exp(u), k * jnp.exp(-u))


def _blocked_scores(q, k, g, acc):
    """Every pair's decay on its own. One decay per head: exp(L_ts) times q_t . k_s. Per feature:
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _scores(q, k, g, u, acc):
    return jax.lax.cond(
        fits_factored(u),
        lambda q, k, g, u: _factored_scores(q, k, u, acc),
        lambda q, k, g, u: _blocked_scores(q, k, g, acc),
        q,
        k,
        g,
        u,
    )


def _scores_forward(q, k, g, u, acc):
    return _scores(q, k, g, u, acc), (q, k, g, u)


def _scores_backward(acc, inputs, cotangent):
    # The form the forward pass took, differentiated again from its inputs: the residuals are
    # the inputs alone, whichever form runs.
    def factored(q, k, g, u):
        dq, dk, du = jax.vjp(lambda q, k, u: _factored_scores(q, k, u, acc), q, k, u)[1](cotangent)
        return dq, dk, jnp.zeros_like(g), du

    def blocked(q, k, g, u):
        dq, dk, dg = jax.vjp(lambda q, k, g: _blocked_scores(q, k, g, acc), q, k, g)[1](cotangent)
        return dq, dk, dg, jnp.zeros_like(u)

    return jax.lax.cond(fits_factored(inputs[3]), factored, blocked, *inputs)


_scores.defvjp(_scores_forward, _scores_backward)


def decayed_scores(q_xCF, k_xCF, g_xCX, acc):
    """[..., C, C] scores q_t . diag(decay from s to t) k_s of every pair of a chunk, s > t
    included (the caller masks them); any leading shape, chunk steps on axis -2. q may have
    leading axes more than k and g, which are broadcast over them: several queries scored
    against one k share its rescaling and the choice of form."""
    return _scores(q_xCF, k_xCF, g_xCX, from_midpoint(g_xCX, axis=g_xCX.ndim - 2), acc)
