"""The delta rule in chunks of C steps: the WY (UT) representation inside each chunk, one
`lax.scan` over the chunks carrying the state.

Legend: B batch, T time, H heads, D key features, M value features, X decay features (1 or D),
N chunks, C steps per chunk (i, j: two steps of one chunk).

Inside a chunk entered with state S, G_i = g_1 + ... + g_i (the log decays up to step i) and
u_j = beta_j (v_j - k_j^T S~_j), the correction step j writes (S~_j: the state step j reads,
decayed). Unrolling the recurrence of `reference.py`:

  S_i = exp(G_i) S + sum_{j<=i} (exp(G_i - G_j) k_j) u_j^T
  u_i + beta_i sum_{j<i} k_i . (exp(G_i - G_j) k_j) u_j = beta_i (v_i - (exp(G_i) k_i)^T S)

so (I + A) u = beta (V - (exp(G) K) S) with A strictly lower triangular. One unit-triangular
solve per chunk, independent of S, gives U = (I + A)^-1 beta V and W = (I + A)^-1 beta exp(G) K
for every chunk at once; the scan then needs only products:

  u = U - W S,   o_i = (exp(G_i) q_i)^T S + sum_{j<=i} q_i . (exp(G_i - G_j) k_j) u_j,
  S' = exp(G_C) S + sum_j (exp(G_C - G_j) k_j) u_j^T.

Every exponent is a sum of log decays <= 0 over steps in order, so nothing overflows. A segment
that begins inside a chunk (`reset`) is a mask, not a decay: steps interact only within one run
of the chunk (the steps between two resets), only the first run reads S, and only the last run
writes the next chunk's state (S itself only when no segment began), so no sum of log decays
spans a reset. Per-feature decays (X = D) form the [C, C, D] pairwise decays of each chunk:
exact, not yet the fast form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import sequence_parallel as sp

DEFAULT_CHUNK_SIZE = 64


def _chunks(x_BTHX, N: int, C: int):
    """[B, N*C, H, X] -> [N, B, H, C, X]."""
    B, _, H = x_BTHX.shape[:3]
    return jnp.moveaxis(x_BTHX.reshape(B, N, C, H, *x_BTHX.shape[3:]), (1, 3), (0, 2))


def _pair_decays(G_xCX, runs_xC, C: int):
    """(mask [.., C, C], decays): the pairs (i, j <= i) of one run of a chunk, and exp(G_i - G_j)
    for them ([..., C, C], or [..., C, C, D] per key feature; None without decays)."""
    mask = jnp.tril(jnp.ones((C, C), bool))
    if runs_xC is not None:
        mask = mask & (runs_xC[..., :, None] == runs_xC[..., None, :])
    if G_xCX is None:
        return mask, None
    if G_xCX.shape[-1] == 1:
        return mask, jnp.exp(jnp.where(mask, G_xCX[..., :, None, 0] - G_xCX[..., None, :, 0], 0))
    exponent = G_xCX[..., :, None, :] - G_xCX[..., None, :, :]
    return mask, jnp.exp(jnp.where(mask[..., None], exponent, 0))


def _pair_products(a_xCD, k_xCD, mask, decays, *, strict: bool):
    """[..., i, j] = a_i . (exp(G_i - G_j) k_j) for the pairs of `mask` (j < i if `strict`), else 0."""
    if strict:
        mask = mask & ~jnp.eye(mask.shape[-1], dtype=bool)
    if decays is None:
        products = jnp.einsum("...id,...jd->...ij", a_xCD, k_xCD)
    elif decays.ndim == a_xCD.ndim:  # [..., C, C]: one decay per pair
        products = decays * jnp.einsum("...id,...jd->...ij", a_xCD, k_xCD)
    else:
        products = jnp.einsum("...id,...ijd,...jd->...ij", a_xCD, decays, k_xCD)
    return jnp.where(mask, products, 0)


def form(
    q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT, s0_BHDM, *, chunk_size: int = DEFAULT_CHUNK_SIZE
):
    """-> (out [B, T, H, M], S_T)."""
    B, T, H, D = q_BTHD.shape
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T
    if pad:  # Padded steps write nothing (beta 0) and keep the state (g 0); their outputs are cut.
        q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT = (
            None if x is None else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            for x in (q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT)
        )
    q, k, v = (_chunks(x, N, C) for x in (q_BTHD, k_BTHD, v_BTHM))  # [N, B, H, C, D|M]
    beta = _chunks(beta_BTH[..., None], N, C)  # [N, B, H, C, 1]
    G = None if g_BTHX is None else jnp.cumsum(_chunks(g_BTHX, N, C), axis=-2)  # [N, B, H, C, X]
    runs = None  # [N, B, 1, C]: the run of each step (0 before the chunk's first reset).
    if reset_BT is not None:
        runs = jnp.cumsum(_chunks(reset_BT[:, :, None, None], N, C)[..., 0].astype(jnp.int32), axis=-1)

    eye = jnp.eye(C, dtype=q.dtype)
    mask, decays = _pair_decays(G, runs, C)  # Shared by A and P.
    A = beta * _pair_products(k, k, mask, decays, strict=True)
    k_decayed = k if G is None else jnp.exp(G) * k
    q_decayed = q if G is None else jnp.exp(G) * q
    k_to_end = k if G is None else jnp.exp(G[..., -1:, :] - G) * k
    keeps = None  # [N, B, 1, 1, 1]: whether the chunk carries the state it entered with.
    if runs is not None:
        reads_state = (runs == 0)[..., None]
        k_decayed, q_decayed = (jnp.where(reads_state, x, 0) for x in (k_decayed, q_decayed))
        k_to_end = jnp.where((runs == runs[..., -1:])[..., None], k_to_end, 0)
        keeps = (runs[..., -1] == 0)[..., None, None]
    rhs = beta * jnp.concatenate([v, k_decayed], axis=-1)
    UW = jax.lax.linalg.triangular_solve(eye + A, rhs, left_side=True, lower=True, unit_diagonal=True)
    U, W = UW[..., : v.shape[-1]], UW[..., v.shape[-1] :]
    P = _pair_products(q, k, mask, decays, strict=False)  # [N, B, H, C, C]
    chunk_decay = None if G is None else jnp.exp(G[..., -1, :])[..., None]  # [N, B, H, X, 1]

    def body(s_BHDM, x):
        U, W, P, q_decayed, k_to_end, chunk_decay, keeps = x
        u_BHCM = U - jnp.einsum("bhcd,bhdm->bhcm", W, s_BHDM)
        out_BHCM = jnp.einsum("bhcd,bhdm->bhcm", q_decayed, s_BHDM) + jnp.einsum("bhij,bhjm->bhim", P, u_BHCM)
        if chunk_decay is not None:
            s_BHDM = chunk_decay * s_BHDM
        if keeps is not None:
            s_BHDM = jnp.where(keeps, s_BHDM, 0)
        s_BHDM = s_BHDM + jnp.einsum("bhcd,bhcm->bhdm", k_to_end, u_BHCM)
        return s_BHDM, out_BHCM

    xs = (U, W, P, q_decayed, k_to_end, chunk_decay, keeps)
    s_BHDM, out_NBHCM = jax.lax.scan(body, sp.vary_like(s0_BHDM, xs), xs)
    out_BTHM = jnp.moveaxis(out_NBHCM, (0, 2), (1, 3)).reshape(B, N * C, H, -1)
    return out_BTHM[:, :T], s_BHDM
