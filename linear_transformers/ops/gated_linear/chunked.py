"""The "chunked" form, the default: within a chunk of C steps the masked, decayed [C, C]
product; between chunks a recurrence over the N chunk states (a cumulative sum without decays or
resets, an associative scan with them). O(T*C + (T/C)*F*M) memory, matmul-shaped work.

Legend: B batch, T time, H heads, F feature-map features, M value features, X decay features (1
or F), C chunk length, N chunks per segment, G segments, L = N * C steps per segment.

The chunks go in G segments of `segment_length()` steps through `chunk_segments.run_segments`, a
`lax.scan` carrying (s, z), whose backward pass recomputes each segment from the state entering
it. Each segment's inputs are prepared (`prepare`: feature maps, masks) and laid out inside the
loop, so neither pass keeps a prepared copy of the sequence: forward+backward holds the raw
inputs and one state per segment. On CPU the segments are ~512 steps, which keeps each in cache
(faster at long T: BENCHMARKS.md); elsewhere one segment holds every chunk.

Within a chunk the decays may rescale q and k relative to the chunk's midpoint, only where that
stays within exp(+-FACTOR_RANGE) (`chunk_scores.py`).

The form interface is in `forms.py`; the caller binds `chunk_size`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import precision
from linear_transformers.ops.gated_linear import chunk_scores, chunk_segments, totals

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


def _chunks(carry, x, *, eps, acc, factored=None):
    """((s, z), one segment's N chunks) -> ((s, z), out_BHNCM): every chunk at once, after the
    state `carry`."""
    s0, z0 = carry
    q, k, v, g, reset = x  # [B, H, N, C, F|M]; g [B|1, H, N, C, X]; reset [B, 1, N, C]
    C = q.shape[3]
    mask = jnp.tril(jnp.ones((C, C), bool))
    reads_state = tail = dropped = None
    if reset is not None:
        runs = totals.runs(reset)
        mask = mask & (runs[..., :, None] == runs[..., None, :])
        reads_state = runs == 0
        tail = runs == runs[..., -1:]
        dropped = runs[..., -1] > 0  # [B, 1, N]

    # Within a chunk: the masked (decayed) quadratic form on C x C (t, s: query and key in it).
    if g is None:
        sim = precision.einsum_in(acc, "bhntf,bhnsf->bhnts", q, k)
        q_in, k_out, a = q.astype(acc), k.astype(acc), None
    else:  # The decays in the form chosen for the segment (`chunk_scores.py`).
        d = chunk_scores.chunk_decays((q,), k, g, acc, factored=factored)
        (sim,), (q_in,) = d.scores, d.queries_from_start
        k_out, a = d.k_to_end, d.chunk_decay[..., 0, :]
    v_out = v
    sim = jnp.where(mask, sim, 0)
    num = jnp.einsum("bhnts,bhnsm->bhntm", sim, v.astype(acc))
    den = None if z0 is None else jnp.sum(sim, axis=-1)

    # Between chunks: the state each chunk starts from, then what its queries read of it.
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
        s_end, z_end = totals.apply_totals(
            (s0[:, :, None], None if z0 is None else z0[:, :, None]),
            totals.scan_totals(a, dropped, ds, dz, axis=2),
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
    return carry, totals.finish(num, den, eps, v.dtype)


def _layout(x_BLHX, N: int, C: int):
    """[B, L, H, X] -> [B, H, N, C, X]: heads next to batch, so every einsum of a segment is a
    batched matmul over (b, h, n) without a transpose of its own."""
    B, _, H, X = x_BLHX.shape
    return jnp.swapaxes(x_BLHX, 1, 2).reshape(B, H, N, C, X)


def _segment(consts, carry, inputs, flags, *, prepare, N, C, eps, acc):
    """One segment from its raw [B, L, H, X] inputs: prepared (`prepare`), laid out, and run by
    `_chunks`; its output back in [B, L, H, M]."""
    q, k, v, g = inputs
    valid_BL, reset_BL = flags
    if prepare is not None:
        q, k, v, g = prepare(q, k, v, g, valid_BL, *consts)
    x = tuple(None if a is None else _layout(a, N, C) for a in (q, k, v, g))
    reset_B1NC = None if reset_BL is None else reset_BL.reshape(reset_BL.shape[0], 1, N, C)
    chunks = functools.partial(_chunks, eps=eps, acc=acc)
    if x[3] is None:
        carry, out_BHNCM = chunks(carry, (*x, reset_B1NC))
    else:  # The form of the decayed scores chosen once for the segment.
        carry, out_BHNCM = chunk_scores.in_either_form(chunks, x[3], carry, (*x, reset_B1NC))
    B, H, _, _, M = out_BHNCM.shape
    return carry, jnp.swapaxes(out_BHNCM.reshape(B, H, N * C, M), 1, 2)


def _segments(T: int, chunk_size: int):
    """(G, N, C): G segments of N chunks of C steps covering T (G = 1: everything in parallel)."""
    segment = segment_length()
    C = min(chunk_size, T)
    num_chunks = -(-T // C)
    G = 1 if segment is None else max(1, -(-num_chunks * C // segment))
    return G, -(-num_chunks // G), C


def form(q, k, v, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, eps, acc, chunk_size):
    B, T, H, _ = q.shape
    M = v.shape[-1]
    if prepare is None:
        valid_BT = None  # Prepared inputs: the keys that do not count are zero already.
    G, N, C = _segments(T, chunk_size)
    pad = G * N * C - T
    if pad:
        # Padding goes after every real step and is no key (valid False; prepared inputs: phi(k)
        # 0), its decay 0 (a factor of 1), and it begins no segment: it reaches neither a real
        # output nor the final state.
        if prepare is not None:
            valid_BT = (
                jnp.arange(T + pad)[None] < T if valid_BT is None else chunk_segments.pad_time(valid_BT, pad)
            )
        q, k, v, g, reset_BT = (chunk_segments.pad_time(x, pad) for x in (q, k, v, g, reset_BT))
    consts = ()
    if prepare is not None:
        # Closure-converted, so that the arrays `prepare` closes over (a feature map's
        # projection) are differentiated as the loop's constants.
        segment_args = tuple(None if x is None else x[:, : N * C] for x in (q, k, v, g, valid_BT))
        prepare, consts = jax.closure_convert(prepare, *segment_args)
    segment_fn = functools.partial(_segment, prepare=prepare, N=N, C=C, eps=eps, acc=acc)
    out_spec = ((B, G * N * C, H, M), v.dtype)
    out_BTHM, final = chunk_segments.run_segments(
        segment_fn, tuple(consts), (q, k, v, g), (valid_BT, reset_BT), (s0_BHFM, z0_BHF), G, N * C, out_spec
    )
    return out_BTHM[:, :T], final
