"""The four forms of gated (decayed) causal linear attention, from any starting state.

Legend: B batch, T query time, S key time (the same positions: causal self-attention), H
heads, F feature-map features, M value features, X decay features (1: one decay per head and
step; F: one per key feature), C chunk length, N chunks, G segments of chunks (the chunked
form's `lax.scan` on CPU), I and O blocks of a chunk (a query's and a key's, in the exact form
of per-feature decays).

Every form takes what `gated_linear.py` prepared:

  phi_q_BTHF (scale applied), phi_k_BTHF and v_BTHM (zero where a key is padding),
  g_BTHX     log decays (<= 0; 0 at padding), shape [B, T, H, 1|F], or None (no decay),
  reset_BT   True where a segment begins (the state is dropped before that step), or None,
  s0_BHFM, z0_BHF: the initial state (z0 None: no normaliser),

and computes, with a_t = exp(g_t) and the state dropped at a reset,

  s_t = a_t * s_{t-1} + phi(k_t) v_t^T,   z_t = a_t * z_{t-1} + phi(k_t),
  out_t = phi(q_t) . s_t  (/ (phi(q_t) . z_t + eps) with a normaliser),

returning (out_BTHM, (s_T, z_T)). The decay between two steps is the exp of a sum of their
log decays, never exp(+cumulative sum) nor a difference of two running sums, so no factor
overflows and no cancellation loses precision however strong the decay; within a chunk the
chunked form may instead rescale q and k relative to the chunk's midpoint, only where that
stays within exp(+-FACTOR_RANGE) (below). A reset is applied with `where`, never by
multiplying by 0, so a non-finite value in an earlier segment cannot reach a later one.

- "quadratic": the dense [T, T] (or [T, T, F]) decay matrix; the reference.
- "associative_scan": `lax.associative_scan` of (decay, reset, state) per step.
- "chunked": within a chunk of C steps the masked, decayed [C, C] product; between chunks a
  recurrence over the N chunk states (a cumulative sum without decays or resets, an
  associative scan with them). On CPU the chunks go in segments of `segment_length()` steps
  through a `lax.scan` carrying (s, z); the backward pass recomputes each segment from the state
  entering it (`chunk_segments.py`). `chunked_from_raw` also prepares the inputs (feature maps,
  masks) a segment at a time, so no prepared copy of the sequence is kept.
- "scan": the RNN, `lax.scan` of the update; T sequential steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import _nonfinite, chunk_segments, precision
from linear_transformers.ops.linear_state import normalise

DEFAULT_CHUNK_SIZE = 64


def segment_length(platform: str | None = None) -> int | None:
    """Steps per `lax.scan` iteration of the chunked form: None = one segment (all parallel).

    On CPU the chunked form runs over segments of ~512 steps in sequence, carrying (s, z), so
    each segment's blocks stay in cache (faster at long T: BENCHMARKS.md). GPUs and TPUs get
    every chunk at once.
    """
    platform = platform or jax.default_backend()
    return 512 if platform == "cpu" else None


def _exclusive_cumsum(x, axis):
    """Sum over chunks m < n along `axis`, by shifting rather than cumsum(x) - x, which would
    let chunk n's own (partly future) entries in up to rounding and break exact causality."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (1, 0)
    shifted = jnp.pad(jax.lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis), widths)
    return jnp.cumsum(shifted, axis=axis)


def _masked_sums(weights_TT, g, axis):
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


def _prefix_sum(g, axis):
    """sum_{i <= t} g_i along `axis` (inclusive)."""
    n = g.shape[axis]
    return _masked_sums(jnp.tril(jnp.ones((n, n))), g, axis)


def _suffix_sum(g, axis):
    """sum_{i > t} g_i along `axis` (exclusive): a sum of same-sign terms, never total - prefix."""
    n = g.shape[axis]
    index = jnp.arange(n)
    return _masked_sums(index[None, :] > index[:, None], g, axis)


def _pair_log_decay(g_xTX, time_axis):
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


def _runs(reset_xT):
    """Run index of each position (0 until the first reset of the block, then 1, ...)."""
    return jnp.cumsum(reset_xT.astype(jnp.int32), axis=-1)


def block_totals(phi_k_BTHF, v_BTHM, g_BTHX, reset_BT, acc, *, normalize):
    """What a block of T steps does to a state: s_T = where(dropped, 0, a * s_0) + ds.

    Returns (a_BHX or None, dropped_B or None, ds_BHFM, dz_BHF or None): the product of the
    block's decays, whether a segment begins in it, and the state it builds from zero (the
    keys of its last segment only, decayed to its end).
    """
    k = phi_k_BTHF.astype(acc)
    v = v_BTHM
    a = dropped = None
    if g_BTHX is not None:
        k = k * jnp.exp(_suffix_sum(g_BTHX, axis=1))
        a = jnp.exp(jnp.sum(g_BTHX, axis=1))
    if reset_BT is not None:
        runs_BT = _runs(reset_BT)
        tail_BT11 = (runs_BT == runs_BT[:, -1:])[:, :, None, None]
        k = jnp.where(tail_BT11, k, 0)
        v = jnp.where(tail_BT11, v, 0)
        dropped = runs_BT[:, -1] > 0
    ds = precision.einsum_in(acc, "bthf,bthm->bhfm", k, v)
    dz = jnp.sum(k, axis=1) if normalize else None
    return a, dropped, ds, dz


def _expand(x, ndim):
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
        carried_s = jnp.where(_expand(dropped, carried_s.ndim), 0, carried_s)
        carried_z = None if z0 is None else jnp.where(_expand(dropped, carried_z.ndim), 0, carried_z)
    return carried_s + ds, None if z0 is None else carried_z + dz


def _finish(num, den, eps, dtype):
    return num.astype(dtype) if den is None else normalise(num, den, eps, dtype)


def _quadratic(phi_q, phi_k, v, g, reset, s0, z0, *, eps, acc, chunk_size):
    del chunk_size
    T = phi_q.shape[1]
    q, k = phi_q.astype(acc), phi_k.astype(acc)
    mask_xTS = jnp.tril(jnp.ones((T, T), bool))[None]
    reads_state_xT = None
    if reset is not None:
        runs = _runs(reset)
        mask_xTS = mask_xTS & (runs[:, :, None] == runs[:, None, :])
        reads_state_xT = runs == 0
    sim_BHTS = jnp.einsum("bthf,bshf->bhts", q, k)
    q_in = q
    if g is not None:
        log_BHTSX = _pair_log_decay(g, time_axis=1)
        decay_BHTSX = jnp.exp(jnp.where(mask_xTS[:, None, :, :, None], log_BHTSX, -jnp.inf))
        if g.shape[-1] == 1:
            sim_BHTS = sim_BHTS * decay_BHTSX[..., 0]
        else:
            sim_BHTS = jnp.einsum("bthf,bshf,bhtsf->bhts", q, k, decay_BHTSX)
        q_in = q * jnp.exp(_prefix_sum(g, axis=1))
    sim_BHTS = jnp.where(mask_xTS[:, None], sim_BHTS, 0)
    num = jnp.einsum("bhts,bshm->bthm", sim_BHTS, v.astype(acc))
    state_num = jnp.einsum("bthf,bhfm->bthm", q_in, s0)
    den = state_den = None
    if z0 is not None:
        den = jnp.einsum("bhts->bth", sim_BHTS)
        state_den = jnp.einsum("bthf,bhf->bth", q_in, z0)
    if reads_state_xT is not None:
        state_num = jnp.where(reads_state_xT[:, :, None, None], state_num, 0)
        state_den = None if z0 is None else jnp.where(reads_state_xT[:, :, None], state_den, 0)
    num = num + state_num
    den = None if z0 is None else den + state_den
    totals = block_totals(phi_k, v, g, reset, acc, normalize=z0 is not None)
    return _finish(num, den, eps, v.dtype), apply_totals((s0, z0), totals)


def _scan(phi_q, phi_k, v, g, reset, s0, z0, *, eps, acc, chunk_size):
    del chunk_size

    def step(carry, xs):
        s, z = carry
        q_t, k_t, v_t, g_t, reset_t = xs
        q_t, k_t, v_t = q_t.astype(acc), k_t.astype(acc), v_t.astype(acc)
        if g_t is not None:
            a_t = jnp.exp(g_t)
            s = a_t[..., None] * s
            z = None if z is None else a_t * z
        if reset_t is not None:
            s = jnp.where(reset_t[:, None, None, None], 0, s)
            z = None if z is None else jnp.where(reset_t[:, None, None], 0, z)
        s = s + jnp.einsum("bhf,bhm->bhfm", k_t, v_t)
        num = jnp.einsum("bhf,bhfm->bhm", q_t, s)
        den = None
        if z is not None:
            z = z + k_t
            den = jnp.einsum("bhf,bhf->bh", q_t, z)
        return (s, z), _finish(num, den, eps, v.dtype)

    time_major = tuple(None if x is None else jnp.swapaxes(x, 0, 1) for x in (phi_q, phi_k, v, g, reset))
    carry, out_TBHM = jax.lax.scan(step, (s0, z0), time_major)
    return jnp.swapaxes(out_TBHM, 0, 1), carry


def _combine(first, second):
    """Two consecutive stretches of the recurrence as one: (decay, dropped, ds, dz)."""
    a1, r1, s1, z1 = first
    a2, r2, s2, z2 = second
    state = apply_totals((s1, z1), (a2, r2, s2, z2))
    a = None if a1 is None else a1 * a2
    r = None if r1 is None else r1 | r2
    return a, r, *state


def _scan_totals(a, dropped, ds, dz, axis):
    """Inclusive `associative_scan` of per-step (or per-chunk) totals along `axis`."""
    if a is None and dropped is None:
        return None, None, jnp.cumsum(ds, axis=axis), None if dz is None else jnp.cumsum(dz, axis=axis)
    return jax.lax.associative_scan(_combine, (a, dropped, ds, dz), axis=axis)


def _associative_scan(phi_q, phi_k, v, g, reset, s0, z0, *, eps, acc, chunk_size):
    del chunk_size
    k = phi_k.astype(acc)
    # Each step's totals: its decay, whether a segment begins at it, its own key and value;
    # scanned, the state after every step from a zero start.
    ds = precision.einsum_in(acc, "bthf,bthm->bthfm", k, v)
    dz = k if z0 is not None else None
    totals = _scan_totals(None if g is None else jnp.exp(g), reset, ds, dz, axis=1)
    s_BTHFM, z_BTHF = apply_totals((s0[:, None], None if z0 is None else z0[:, None]), totals)
    q = phi_q.astype(acc)
    num = jnp.einsum("bthf,bthfm->bthm", q, s_BTHFM)
    den = None if z0 is None else jnp.einsum("bthf,bthf->bth", q, z_BTHF)
    final = (s_BTHFM[:, -1], None if z0 is None else z_BTHF[:, -1])
    return _finish(num, den, eps, v.dtype), final


# Decays within a chunk: scores sum_f q_tf k_sf exp(L_tsf), L_tsf the log decay from s to t (one
# per head, X = 1, or per feature, X = F). Where every chunk's decays stay within
# exp(+-FACTOR_RANGE) of its midpoint m (typical gates), they are one matmul of q * exp(u) and
# k * exp(-u), u_t the log decay between m and t: exact to a relative eps * FACTOR_RANGE.
# Otherwise (strong decays) every pair's decay is summed on its own (per feature: within blocks
# of 8 steps, and between blocks from factors that are all <= 1): exact and finite whatever the
# decays, and slower. `lax.cond` picks one per segment of chunks; the backward pass recomputes
# the one taken from its inputs.
FACTOR_RANGE = 30.0
EXACT_BLOCK = 8


def _from_midpoint(g, axis):
    """u_t = sum_{m < i <= t} g_i after the midpoint m, -sum_{t < i <= m} g_i before it: each a
    sum of same-sign terms starting at m (no cancellation)."""
    n = g.shape[axis]
    t, i, m = jnp.arange(n)[:, None], jnp.arange(n)[None, :], n // 2
    signed_TT = jnp.where((m < i) & (i <= t), 1.0, 0.0) - jnp.where((t < i) & (i <= m), 1.0, 0.0)
    return _masked_sums(signed_TT, g, axis)


def _factored_scores(q, k, u, acc):
    return precision.einsum_in(acc, "bhntf,bhnsf->bhnts", q * jnp.exp(u), k * jnp.exp(-u))


def _blocked_scores(q, k, g, acc):
    """Every pair's decay on its own. One decay per head: exp(L_ts) times q_t . k_s. Per feature:
    blocks of EXACT_BLOCK steps, within a block the decays of every pair, between blocks q *
    exp(decay since its block began) * exp(decays of the blocks in between) * k * exp(decay to
    its block's end): sums of same-sign terms, every factor <= 1."""
    if g.shape[-1] == 1:
        C = q.shape[3]
        mask = jnp.tril(jnp.ones((C, C), bool))
        decay = jnp.exp(jnp.where(mask, _pair_log_decay(g, time_axis=3)[..., 0], -jnp.inf))
        return precision.einsum_in(acc, "bhntf,bhnsf->bhnts", q, k) * decay
    B, H, N, C, F = q.shape
    c = EXACT_BLOCK if C % EXACT_BLOCK == 0 else C
    n = C // c
    q, k = q.astype(acc), k.astype(acc)
    qb, kb, gb = (x.reshape(B, H, N, n, c, F) for x in (q, k, g))
    inner = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.exp(jnp.where(inner[..., None], _pair_log_decay(gb, time_axis=4), -jnp.inf))
    within = jnp.einsum("bhnitf,bhnisf,bhnitsf->bhnits", qb, kb, decay)
    block = jnp.arange(n)
    between_ijl = (block[None, None, :] > block[None, :, None]) & (
        block[None, None, :] < block[:, None, None]
    )
    gap = jnp.exp(
        jnp.sum(jnp.where(between_ijl[..., None], jnp.sum(gb, axis=4)[..., None, None, :, :], 0), axis=-2)
    )
    q_out = qb * jnp.exp(_prefix_sum(gb, axis=4))
    k_in = kb * jnp.exp(_suffix_sum(gb, axis=4))
    across = jnp.einsum("bhnitf,bhniof,bhnosf->bhniots", q_out, gap, k_in)
    earlier = block[:, None] > block[None, :]
    scores = jnp.where(earlier[:, :, None, None], across, 0) + jnp.where(
        jnp.eye(n, dtype=bool)[:, :, None, None], within[:, :, :, :, None], 0
    )
    return jnp.swapaxes(scores, 4, 5).reshape(B, H, N, C, C)


def _fits_factored(u):
    """Whether every chunk's log decays stay within FACTOR_RANGE of its midpoint."""
    return jnp.max(jnp.abs(u)) <= FACTOR_RANGE


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _scores(q, k, g, u, acc):
    return jax.lax.cond(
        _fits_factored(u),
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

    return jax.lax.cond(_fits_factored(inputs[3]), factored, blocked, *inputs)


_scores.defvjp(_scores_forward, _scores_backward)


def _decayed_scores(q, k, g, mask, acc):
    """[B, H, N, C, C] scores q_t . diag(decay from s to t) k_s."""
    del mask  # The caller masks; both forms compute every pair.
    return _scores(q, k, g, _from_midpoint(g, axis=3), acc)


def _chunked_segment(carry, xs, *, eps, acc):
    """One segment of the chunked form: its N chunks at once, after the state `carry`."""
    s0, z0 = carry
    q, k, v, g, reset = xs  # [B, H, N, C, F|M]; g [B|1, H, N, C, X]; reset [B, 1, N, C]
    C = q.shape[3]
    mask = jnp.tril(jnp.ones((C, C), bool))
    reads_state = tail = dropped = None
    if reset is not None:
        runs = _runs(reset)
        mask = mask & (runs[..., :, None] == runs[..., None, :])
        reads_state = runs == 0
        tail = runs == runs[..., -1:]
        dropped = runs[..., -1] > 0  # [B, 1, N]

    # Within a chunk: the masked (decayed) quadratic form on C x C (t, s: query and key in it).
    if g is None:
        sim = precision.einsum_in(acc, "bhntf,bhnsf->bhnts", q, k)
    else:
        sim = _decayed_scores(q, k, g, mask, acc)
    sim = jnp.where(mask, sim, 0)
    num = jnp.einsum("bhnts,bhnsm->bhntm", sim, v.astype(acc))
    den = None if z0 is None else jnp.sum(sim, axis=-1)

    # Between chunks: the state each chunk starts from, then what its queries read of it.
    q_in, k_out, v_out = q.astype(acc), k.astype(acc), v
    a = None
    if g is not None:
        q_in = q_in * jnp.exp(_prefix_sum(g, axis=3))
        k_out = k_out * jnp.exp(_suffix_sum(g, axis=3))
        a = jnp.exp(jnp.sum(g, axis=3))
    if tail is not None:
        k_out = jnp.where(tail[..., None], k_out, 0)
        v_out = jnp.where(tail[..., None], v_out, 0)
    ds = precision.einsum_in(acc, "bhncf,bhncm->bhnfm", k_out, v_out)
    dz = None if z0 is None else jnp.sum(k_out, axis=3)
    if a is None and dropped is None:
        s_in = _exclusive_cumsum(ds, axis=2) + s0[:, :, None]
        z_in = None if z0 is None else _exclusive_cumsum(dz, axis=2) + z0[:, :, None]
        carry = (s0 + jnp.sum(ds, axis=2), None if z0 is None else z0 + jnp.sum(dz, axis=2))
    else:
        s_end, z_end = apply_totals(
            (s0[:, :, None], None if z0 is None else z0[:, :, None]), _scan_totals(a, dropped, ds, dz, axis=2)
        )
        s_in = jnp.concatenate([s0[:, :, None], s_end[:, :, :-1]], axis=2)
        z_in = None if z0 is None else jnp.concatenate([z0[:, :, None], z_end[:, :, :-1]], axis=2)
        carry = (s_end[:, :, -1], None if z0 is None else z_end[:, :, -1])
    state_num = jnp.einsum("bhncf,bhnfm->bhncm", q_in, s_in)
    state_den = None if z0 is None else jnp.einsum("bhncf,bhnf->bhnc", q_in, z_in)
    if reads_state is not None:
        state_num = jnp.where(reads_state[..., None], state_num, 0)
        state_den = None if z0 is None else jnp.where(reads_state, state_den, 0)
    num = num + state_num
    den = None if z0 is None else den + state_den
    return carry, _finish(num, den, eps, v.dtype)


def _layout(x_BLHX, N: int, C: int):
    """[B, L, H, X] -> [B, H, N, C, X]: heads next to batch, so every einsum of a segment is a
    batched matmul over (b, h, n) without a transpose of its own."""
    B, _, H, X = x_BLHX.shape
    return jnp.swapaxes(x_BLHX, 1, 2).reshape(B, H, N, C, X)


def _segment_of_chunks(consts, carry, inputs, flags, *, prepare, N, C, eps, acc):
    """One segment from its raw [B, L, H, X] inputs: prepared (`prepare`), laid out, and run by
    `_chunked_segment`; its output back in [B, L, H, M]."""
    q, k, v, g = inputs
    valid, reset = flags
    if prepare is not None:
        q, k, v, g = prepare(q, k, v, g, valid, *consts)
    xs = tuple(None if x is None else _layout(x, N, C) for x in (q, k, v, g))
    reset = None if reset is None else reset.reshape(reset.shape[0], 1, N, C)
    carry, out_BHNCM = _chunked_segment(carry, (*xs, reset), eps=eps, acc=acc)
    B, H, _, _, M = out_BHNCM.shape
    return carry, jnp.swapaxes(out_BHNCM.reshape(B, H, N * C, M), 1, 2)


def _segments(T: int, chunk_size: int):
    """(G, N, C): G segments of N chunks of C steps covering T (G = 1: everything in parallel)."""
    segment = segment_length()
    C = min(chunk_size, T)
    num_chunks = -(-T // C)
    G = 1 if segment is None else max(1, -(-num_chunks * C // segment))
    return G, -(-num_chunks // G), C


def _pad_time(x, pad: int):
    return None if x is None or not pad else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _chunks_in_segments(prepare, q, k, v, g, valid, reset, s0, z0, *, eps, acc, chunk_size):
    """The chunked form over segments of chunks (`chunk_segments.run_segments`: the backward
    recomputes each segment). `prepare(*consts, q, k, v, g, valid)` maps a segment's raw inputs
    to what `_chunked_segment` takes (None: they are prepared already); closure-converted so
    that arrays it closes over (a feature map's projection) are differentiated."""
    B, T, H, _ = q.shape
    M = v.shape[-1]
    G, N, C = _segments(T, chunk_size)
    pad = G * N * C - T
    if pad:
        # Padding goes after every real step and is no key (valid False; prepared inputs: phi(k)
        # 0), its decay 0 (a factor of 1), and it begins no segment: it reaches neither a real
        # output nor the final state.
        if prepare is not None:
            valid = jnp.arange(T + pad)[None] < T if valid is None else _pad_time(valid, pad)
        q, k, v, g, reset = (x if x is None else _pad_time(x, pad) for x in (q, k, v, g, reset))
    consts = ()
    if prepare is not None:
        segment_args = tuple(None if x is None else x[:, : N * C] for x in (q, k, v, g, valid))
        prepare, consts = jax.closure_convert(prepare, *segment_args)
    segment_fn = functools.partial(_segment_of_chunks, prepare=prepare, N=N, C=C, eps=eps, acc=acc)
    out_spec = ((B, G * N * C, H, M), v.dtype)
    out_BTHM, carry = chunk_segments.run_segments(
        segment_fn, tuple(consts), (q, k, v, g), (valid, reset), (s0, z0), G, N * C, out_spec
    )
    return out_BTHM[:, :T], carry


def _chunked(phi_q, phi_k, v, g, reset, s0, z0, *, eps, acc, chunk_size):
    return _chunks_in_segments(
        None, phi_q, phi_k, v, g, None, reset, s0, z0, eps=eps, acc=acc, chunk_size=chunk_size
    )


def chunked_from_raw(prepare, q, k, v, g, valid, reset, s0, z0, *, eps, acc, chunk_size):
    """The "chunked" form (with its guard for non-finite values) from raw inputs: `prepare(q, k,
    v, g, valid)` -> (phi_q, phi_k, v, g) as `gated_linear` prepares them, applied a segment at a
    time, so neither the forward nor the backward keeps a prepared copy of the sequence.
    `valid` [B, T] (or None: every key) marks the keys that count."""

    def prepare_finite(q, k, v, g, valid):
        phi_q, phi_k, v, g = prepare(q, k, v, g, valid)
        return phi_q, phi_k, _nonfinite.finite_part(v), g

    result = _chunks_in_segments(
        prepare_finite, q, k, v, g, valid, reset, s0, z0, eps=eps, acc=acc, chunk_size=chunk_size
    )
    return _nonfinite.mark_unless_all_finite(v, result, functools.partial(_mark_seen, v, reset, valid=valid))


def _mark_seen(v, reset, result, *, valid=None):
    """NaN in the outputs (and the columns of the final s) that see a non-finite value of v (of
    the keys that count: `valid`). Runs only inside the marking branch, so the masked copy of v
    is made only when some value is not finite."""
    if valid is not None:
        v = jnp.where(valid[:, :, None, None], v, jnp.zeros((), v.dtype))
    out_BTHM, (s_BHFM, z_BHF) = result
    seen_BTHM = _nonfinite.seen_nonfinite_BTHM(v, num_queries=v.shape[1], causal=True, reset_BT=reset)
    s_BHFM = _nonfinite.mark_seen(s_BHFM, seen_BTHM[:, -1][:, :, None, :])
    return _nonfinite.mark_seen(out_BTHM, seen_BTHM), (s_BHFM, z_BHF)


def _finite_products(form):
    """`form` run on the finite part of v, NaN wherever a step sees a non-finite value (and in
    the columns of the final s it reaches): its masked products would otherwise turn a bad
    value at step s into NaN at every step (ops/_nonfinite.py)."""

    def guarded(phi_q, phi_k, v, g, reset, s0, z0, **kw):
        result = form(phi_q, phi_k, _nonfinite.finite_part(v), g, reset, s0, z0, **kw)
        return _nonfinite.mark_unless_all_finite(v, result, functools.partial(_mark_seen, v, reset))

    return guarded


# The recurrent forms ("associative_scan", "scan") only ever add what a step can see. The
# guard wraps the whole chunked form, not just its within-chunk product: a state built from a
# non-finite value would still send NaN into earlier steps' gradients (0 * NaN in the backward
# pass of later steps' normalisation).
FORMS = {
    "quadratic": _finite_products(_quadratic),
    "associative_scan": _associative_scan,
    "chunked": _finite_products(_chunked),
    "scan": _scan,
}
IMPLS = tuple(FORMS)
