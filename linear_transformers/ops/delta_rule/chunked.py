"""The delta rule in chunks of C steps: the WY (UT) representation inside each chunk, one
`lax.scan` over the chunks carrying the state.

Legend: B batch, T time, H heads, G = B * H (heads merged into the batch), D key features, M
value features, X decay features (1 or D), N chunks, C steps per chunk (i, j: two steps of one
chunk).

Inside a chunk entered with state S, Gamma_i = g_1 + ... + g_i (the log decays up to step i) and
u_j = beta_j (v_j - k_j^T S~_j), the correction step j writes (S~_j: the state step j reads,
decayed). Unrolling the recurrence of `reference.py`:

  S_i = exp(Gamma_i) S + sum_{j<=i} (exp(Gamma_i - Gamma_j) k_j) u_j^T
  u_i + beta_i sum_{j<i} k_i . (exp(Gamma_i - Gamma_j) k_j) u_j = beta_i (v_i - (exp(Gamma_i) k_i)^T S)

so (I + A) u = beta (V - (exp(Gamma) K) S) with A strictly lower triangular. One unit-triangular
inverse per chunk (`triangular.py`), independent of S, gives U = (I + A)^-1 beta V and
W = (I + A)^-1 beta exp(Gamma) K for every chunk at once; the scan then needs only products:

  u = U - W S,   o_i = (exp(Gamma_i) q_i)^T S + sum_{j<=i} q_i . (exp(Gamma_i - Gamma_j) k_j) u_j,
  S' = exp(Gamma_C) S + sum_j (exp(Gamma_C - Gamma_j) k_j) u_j^T.

Every exponent is one sum of log decays <= 0 over consecutive steps (`totals.py`), never the
difference of two running sums, so nothing overflows and a reset's floor (-1e4) loses nothing.
Per-feature decays (X = D) are the gated family's (`chunk_scores.py`): where every chunk's
decays stay within exp(+-FACTOR_RANGE) of its midpoint, every factor comes from exp(+-u), u
the log decay from the midpoint (`midpoint_factors`: exact to a relative eps * FACTOR_RANGE, no
[C, C, D] tensor); elsewhere every pair is decayed on its own (`blocked_scores`). One
`lax.cond` chooses for a whole call (`fits_factored`; the op's). A segment that begins
inside a chunk (`reset`) is a mask, not a decay: steps interact only within one run of the
chunk (the steps between two resets), only the first run reads S, and only the last run writes
the next chunk's state (S itself only when no segment began).

Only the states run one chunk at a time: the scan gives each chunk the state it enters with and
its corrections u, and the outputs are then one batched product over every chunk. Batch and
heads are one axis G: XLA:CPU (jaxlib 0.10.2) runs a fused multiply-reduce, as the backward
pass of a broadcast is, some 20x slower when its operand has a dimension of size 1, and B = 1
is the common case.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from linear_transformers.ops import precision
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.delta_rule import triangular
from linear_transformers.ops.gated_linear import chunk_scores, chunk_segments, totals

DEFAULT_CHUNK_SIZE = 64  # Off the CPU; `default_chunk_size` chooses per platform.


def default_chunk_size(platform: str | None = None) -> int:
    """Steps per chunk when the caller gives none: 32 on CPU, 64 elsewhere.

    On CPU, in segments of 256 steps, chunks of 32 took forward+backward 15-25% less time than
    chunks of 64 (N = 4096 and 16384, every decay shape, interleaved in one process; BENCHMARKS.md
    section 8): the [C, C] scores, inverses and WY products grow with C, the scan over chunks is
    cheap. On GPUs chunks of 64 keep the tensor cores busy, as FLA's kernels do.
    """
    platform = platform or jax.default_backend()
    return 32 if platform == "cpu" else DEFAULT_CHUNK_SIZE


def segment_length(platform: str | None = None) -> int | None:
    """Steps per segment of the op's outer loop (`op.py`): None = the whole sequence at once.

    On CPU the op runs the chunked form over segments of 256 steps in sequence, carrying the
    state (`gated_linear/chunk_segments.py`), so that each segment's scores, inverses, U and W
    stay in cache: at N = 4096 forward+backward took ~250 ms at once, ~190 ms in segments of 256
    (chunks of 64), ~150 ms with chunks of 32; segments of 128 and 512 were no faster
    (BENCHMARKS.md section 8). GPUs and TPUs get every chunk at once.
    """
    platform = platform or jax.default_backend()
    return 256 if platform == "cpu" else None


def _chunks(x_BTHX, N: int, C: int):
    """[B, N*C, H, X] -> [N, G, C, X]."""
    B, _, H = x_BTHX.shape[:3]
    x_BNCHX = x_BTHX.reshape(B, N, C, H, -1)
    return jnp.moveaxis(x_BNCHX, (1, 3), (0, 2)).reshape(N, B * H, C, x_BNCHX.shape[-1])


def _scores(a_xCD, k_xCD, pair_decay_xCC, acc):
    """[..., i, j] = a_i . (exp(Gamma_i - Gamma_j) k_j) for every pair (i, j) of a chunk, j > i
    included (the caller masks them): per head from `pair_decay_xCC` (None: no decay)."""
    products = precision.einsum_in(acc, "...id,...jd->...ij", a_xCD, k_xCD)
    return products if pair_decay_xCC is None else pair_decay_xCC * products


def _decays(q, k, g, mask, acc):
    """-> (kk, qk: [N, G, C, C] scores of every pair (`_scores`); q and k decayed from the chunk's
    start; k decayed to its end; the chunk's decay [N, G, X, 1] or None), with no decay or one
    per head, each exponent one sum of same-sign log decays."""
    if g is None:
        return _scores(k, k, None, acc), _scores(q, k, None, acc), k, q, k, None
    # [N, G, C, C] pair decays exp(Gamma_i - Gamma_j), shared by kk and qk.
    pair_decay = jnp.exp(jnp.where(mask, totals.pair_log_decay(g, time_axis=2)[..., 0], -jnp.inf))
    kk, qk = _scores(k, k, pair_decay, acc), _scores(q, k, pair_decay, acc)
    from_start = jnp.exp(totals.prefix_sum(g, axis=2))
    k_to_end = jnp.exp(totals.suffix_sum(g, axis=2)) * k
    return kk, qk, from_start * k, from_start * q, k_to_end, jnp.exp(jnp.sum(g, axis=2))[..., None]


def _feature_decays(q, k, g, acc, factored: bool):
    """`_decays` for per-feature decays: the gated family's (`chunk_scores.chunk_decays`), k and
    q scored against k at once."""
    d = chunk_scores.chunk_decays((k, q), k, g, acc, factored=factored)
    (kk, qk), (k_decayed, q_decayed) = d.scores, d.queries_from_start
    return kk, qk, k_decayed, q_decayed, d.k_to_end, jnp.swapaxes(d.chunk_decay, -1, -2)


def fits_factored(g_BTHX, chunk_size: int, segment: int | None):
    """Whether every chunk the form sees (chunks of C steps from the start of each segment of
    `segment` steps, None: one of T) fits the factored scores: |u| <= FACTOR_RANGE
    (`chunk_scores.chunks_fit`: two sums per chunk, no [.., C, X] rescaling). A NaN anywhere
    chooses the exact form."""
    B, T, H, X = g_BTHX.shape
    L = T if segment is None else segment
    S = -(-T // L)
    C = min(chunk_size, L)
    N = -(-L // C)
    g = chunk_segments.pad_time(g_BTHX, S * L - T).reshape(B, S, L, H, X)
    if N * C != L:
        g = jnp.pad(g, [(0, 0), (0, 0), (0, N * C - L), (0, 0), (0, 0)])
    return chunk_scores.chunks_fit(g.reshape(B, S, N, C, H, X), axis=3)


CHUNK_STATES = "delta_rule_chunk_states"


def keeping_chunk_states(f):
    """`f` (which runs `form`) differentiated keeping only its inputs and the state each chunk
    enters with ([N, G, D, M]: T / C states); the backward pass recomputes the rest, chunks in
    parallel: the scores, inverses, U and W are C times larger than q, k and v together."""
    return jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(CHUNK_STATES))


def form(q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT, s0_BHDM, *, chunk_size: int, factored=None):
    """-> (out [B, T, H, M], S_T). `factored`: whether per-feature decays take the midpoint's
    factors (True: the caller checked `fits_factored`) or every pair on its own (False); None
    chooses for this call (`chunk_scores.in_either_form`)."""
    B, T, H, D = q_BTHD.shape
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T
    if g_BTHX is not None and g_BTHX.shape[-1] > 1 and factored is None:
        g_NGCD = _chunks(chunk_segments.pad_time(g_BTHX, pad), N, C)
        inputs = (q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT, s0_BHDM)
        return chunk_scores.in_either_form(functools.partial(form, chunk_size=chunk_size), g_NGCD, *inputs)
    if pad:  # Padded steps write nothing (beta 0) and keep the state (g 0); their outputs are cut.
        q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT = (
            chunk_segments.pad_time(x, pad) for x in (q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT)
        )
    q, k, v = (_chunks(x, N, C) for x in (q_BTHD, k_BTHD, v_BTHM))  # [N, G, C, D|M]
    beta = _chunks(beta_BTH[..., None], N, C)  # [N, G, C, 1]
    g = None if g_BTHX is None else _chunks(g_BTHX, N, C)  # [N, G, C, X]
    mask = jnp.tril(jnp.ones((C, C), bool))  # [C, C]: the pairs (i, j <= i) of one run.
    runs = None  # [N, G, C]: the run of each step (0 before the chunk's first reset).
    if reset_BT is not None:
        reset_BTH1 = jnp.broadcast_to(reset_BT[:, :, None, None], (B, N * C, H, 1))
        runs = totals.runs(_chunks(reset_BTH1, N, C)[..., 0])
        mask = mask & (runs[..., :, None] == runs[..., None, :])

    acc = q.dtype
    if g is not None and g.shape[-1] > 1:
        kk, qk, k_decayed, q_decayed, k_to_end, chunk_decay = _feature_decays(q, k, g, acc, factored)
    else:
        kk, qk, k_decayed, q_decayed, k_to_end, chunk_decay = _decays(q, k, g, mask, acc)
    A = beta * jnp.where(mask & ~jnp.eye(C, dtype=bool), kk, 0)
    P = jnp.where(mask, qk, 0)
    keeps = None  # [N, G, 1, 1]: whether the chunk carries the state it entered with.
    if runs is not None:
        reads_state = (runs == 0)[..., None]
        k_decayed, q_decayed = (jnp.where(reads_state, x, 0) for x in (k_decayed, q_decayed))
        k_to_end = jnp.where((runs == runs[..., -1:])[..., None], k_to_end, 0)
        keeps = (runs[..., -1] == 0)[..., None, None]
    rhs = beta * jnp.concatenate([v, k_decayed], axis=-1)
    UW = jnp.einsum("...ij,...jd->...id", triangular.unit_lower_inverse(A), rhs)
    U, W = UW[..., : v.shape[-1]], UW[..., v.shape[-1] :]

    def body(s_GDM, x):  # Only what the next chunk's state needs runs one chunk at a time.
        U, W, k_to_end, chunk_decay, keeps = x
        u_GCM = U - jnp.einsum("gcd,gdm->gcm", W, s_GDM)
        entering_GDM = s_GDM
        if chunk_decay is not None:
            s_GDM = chunk_decay * s_GDM
        if keeps is not None:
            s_GDM = jnp.where(keeps, s_GDM, 0)
        return s_GDM + jnp.einsum("gcd,gcm->gdm", k_to_end, u_GCM), (entering_GDM, u_GCM)

    xs = (U, W, k_to_end, chunk_decay, keeps)
    s0_GDM = s0_BHDM.reshape(B * H, *s0_BHDM.shape[2:])
    s_GDM, (entering_NGDM, u_NGCM) = jax.lax.scan(body, sp.vary_like(s0_GDM, xs), xs)
    entering_NGDM = checkpoint_name(entering_NGDM, CHUNK_STATES)
    out_NGCM = jnp.einsum("ngcd,ngdm->ngcm", q_decayed, entering_NGDM) + jnp.einsum(
        "ngij,ngjm->ngim", P, u_NGCM
    )
    out_BTHM = jnp.moveaxis(out_NGCM.reshape(N, B, H, C, -1), (0, 2), (1, 3)).reshape(B, N * C, H, -1)
    return out_BTHM[:, :T], s_GDM.reshape(s0_BHDM.shape)
