"""Causal linear attention in four forms that compute the same thing.

Legend: B batch, T time, H heads, D key/query features, F feature-map features, M value
features, N chunks, C chunk length.

  out_t = phi(q_t) . S_t / (phi(q_t) . z_t + eps),  S_t = sum_{s<=t} phi(k_s) v_s^T,
                                                     z_t = sum_{s<=t} phi(k_s)

- "quadratic": the masked [T, T] product; O(T^2) time and memory. The reference.
- "associative_scan": `jax.lax.associative_scan` of the prefix states; O(T log T) work but one
  [F, M] state per position in memory.
- "chunked": within a chunk of C steps the masked [C, C] product, between chunks the prefix sum of
  per-chunk states; O(T*C + (T/C)*F*M) memory, matmul-shaped work. The default. On CPU the
  chunks go in segments of `segment_length()` steps through a `lax.scan` carrying (S, z), which
  keeps each segment in cache. (A hand-written VJP made of the same chunked products was slower
  and larger on CPU than autodiff: BENCHMARKS.md.)
- "scan": the RNN, `lax.scan` over `linear_attention_step`; O(F*M) state, T sequential steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import _checks
from linear_transformers.ops.feature_maps import make_feature_map
from linear_transformers.ops.linear import init_linear_state, linear_attention_step

IMPLS = ("quadratic", "associative_scan", "chunked", "scan")
DEFAULT_CHUNK_SIZE = 64


def default_chunk_size(platform: str | None = None, dtype="float32") -> int:
    """The chunk length C that `impl="chunked"` uses when none is given, per backend and dtype.

    Chosen by `experiments.benchmark_attention` sweeps (BENCHMARKS.md): the within-chunk [C, C]
    product costs T*C work, the between-chunk states (T/C)*F*M memory traffic. 64 won on CPU
    (C = 32..256, float32); no GPU measurement yet, so every backend and dtype gets 64.
    """
    del platform, dtype
    return DEFAULT_CHUNK_SIZE


def _normalise(num_xM, den_x, eps, dtype):
    return (num_xM / (den_x + eps)[..., None]).astype(dtype)


def _quadratic(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc):
    T = phi_q_BTHF.shape[1]
    sim_BHTS = jnp.einsum("bthf,bshf->bhts", phi_q_BTHF.astype(acc), phi_k_BTHF.astype(acc))
    sim_BHTS = jnp.where(jnp.tril(jnp.ones((T, T), bool)), sim_BHTS, 0)
    num_BTHM = jnp.einsum("bhts,bshm->bthm", sim_BHTS, v_BTHM.astype(acc))
    den_BTH = jnp.einsum("bhts->bth", sim_BHTS)
    return _normalise(num_BTHM, den_BTH, eps, v_BTHM.dtype)


def _associative_scan(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc):
    kv_BTHFM = jnp.einsum("bthf,bthm->bthfm", phi_k_BTHF, v_BTHM, preferred_element_type=acc)
    s_BTHFM, z_BTHF = jax.lax.associative_scan(
        lambda a, b: jax.tree.map(jnp.add, a, b), (kv_BTHFM, phi_k_BTHF.astype(acc)), axis=1)
    phi_q = phi_q_BTHF.astype(acc)
    num_BTHM = jnp.einsum("bthf,bthfm->bthm", phi_q, s_BTHFM)
    den_BTH = jnp.einsum("bthf,bthf->bth", phi_q, z_BTHF)
    return _normalise(num_BTHM, den_BTH, eps, v_BTHM.dtype)


def _exclusive_cumsum(x, axis):
    """Sum over chunks m < n along `axis`, by shifting rather than cumsum(x) - x, which would
    let chunk n's own (partly future) entries in up to rounding and break exact causality."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (1, 0)
    shifted = jnp.pad(jax.lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis), widths)
    return jnp.cumsum(shifted, axis=axis)


def segment_length(platform: str | None = None) -> int | None:
    """Steps per `lax.scan` iteration of the chunked form: None = one segment (all parallel).

    On CPU the chunked form runs over segments of ~512 steps in sequence, carrying (S, z), so
    each segment's blocks stay in cache: 1.4-1.6x faster at T=4k-16k (BENCHMARKS.md). GPUs and
    TPUs get every chunk at once.
    """
    platform = platform or jax.default_backend()
    return 512 if platform == "cpu" else None


def _chunked_segment(carry, xs, eps, acc):
    """One segment of the chunked form: its N chunks at once, after the state `carry`."""
    s0_BHFM, z0_BHF = carry
    q_BHNCF, k_BHNCF, v_BHNCM = xs
    C = q_BHNCF.shape[3]
    # Between chunks: state of everything before chunk n (exclusive prefix sum of chunk states).
    kv_BHNFM = jnp.einsum("bhncf,bhncm->bhnfm", k_BHNCF, v_BHNCM, preferred_element_type=acc)
    ksum_BHNF = jnp.sum(k_BHNCF.astype(acc), axis=3)
    s_BHNFM = _exclusive_cumsum(kv_BHNFM, axis=2) + s0_BHFM[:, :, None]
    z_BHNF = _exclusive_cumsum(ksum_BHNF, axis=2) + z0_BHF[:, :, None]

    # Within a chunk: the masked quadratic form on C x C.
    sim_BHNCC = jnp.einsum("bhncf,bhndf->bhncd", q_BHNCF, k_BHNCF, preferred_element_type=acc)
    sim_BHNCC = jnp.where(jnp.tril(jnp.ones((C, C), bool)), sim_BHNCC, 0)

    q_acc = q_BHNCF.astype(acc)
    num_BHNCM = (jnp.einsum("bhncd,bhndm->bhncm", sim_BHNCC, v_BHNCM.astype(acc)) +
                 jnp.einsum("bhncf,bhnfm->bhncm", q_acc, s_BHNFM))
    den_BHNC = jnp.sum(sim_BHNCC, axis=-1) + jnp.einsum("bhncf,bhnf->bhnc", q_acc, z_BHNF)
    out_BHNCM = _normalise(num_BHNCM, den_BHNC, eps, v_BHNCM.dtype)
    carry = (s0_BHFM + jnp.sum(kv_BHNFM, axis=2), z0_BHF + jnp.sum(ksum_BHNF, axis=2))
    return carry, out_BHNCM


def _chunked(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc, chunk_size, segment):
    B, T, H, F = phi_q_BTHF.shape
    M = v_BTHM.shape[-1]
    C = min(chunk_size, T)
    num_chunks = -(-T // C)
    # G segments of N chunks each, scanned in sequence (G = 1: everything in parallel).
    G = 1 if segment is None else max(1, -(-num_chunks * C // segment))
    N = -(-num_chunks // G)
    pad = G * N * C - T
    if pad:
        # Padding goes after every real step, so causality keeps it out of every real output.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        phi_q_BTHF, phi_k_BTHF, v_BTHM = (jnp.pad(x, widths)
                                          for x in (phi_q_BTHF, phi_k_BTHF, v_BTHM))
    # Heads next to batch once, so every einsum is a batched matmul over (b, h, n) without a
    # transpose of its own; segments lead for the scan.
    xs = tuple(jnp.moveaxis(jnp.swapaxes(x, 1, 2).reshape(B, H, G, N, C, x.shape[-1]), 2, 0)
               for x in (phi_q_BTHF, phi_k_BTHF, v_BTHM))
    carry = (jnp.zeros((B, H, F, M), acc), jnp.zeros((B, H, F), acc))
    if G == 1:
        _, out_GBHNCM = _chunked_segment(carry, tuple(x[0] for x in xs), eps, acc)
        out_GBHNCM = out_GBHNCM[None]
    else:
        # Rematerialised: the backward pass recomputes a segment's blocks while they are in
        # cache instead of storing them all (less memory, and faster at T >= 16k on CPU).
        segment_fn = jax.checkpoint(functools.partial(_chunked_segment, eps=eps, acc=acc))
        _, out_GBHNCM = jax.lax.scan(segment_fn, carry, xs)
    out_BHTM = jnp.moveaxis(out_GBHNCM, 0, 2).reshape(B, H, G * N * C, M)
    return jnp.swapaxes(out_BHTM, 1, 2)[:, :T]


def _scan(q_BTHD, k_BTHD, v_BTHM, fm, eps, acc):
    B, _, H, D = q_BTHD.shape
    state = init_linear_state(B, H, fm.num_features(D), v_BTHM.shape[-1], dtype=acc)

    def step(state, qkv_t):
        return linear_attention_step(state, *qkv_t, feature_map=fm, eps=eps)

    time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (q_BTHD, k_BTHD, v_BTHM))
    _, out_TBHM = jax.lax.scan(step, state, time_major)
    return jnp.swapaxes(out_TBHM, 0, 1)


def causal_linear_attention(q_BTHD, k_BTHD, v_BTHM, *, feature_map="elu", impl="chunked",
                            chunk_size=None, eps=1e-6):
    """Causal linear attention: query t attends to keys s <= t.

    Args:
      q_BTHD, k_BTHD: [B, T, H, D]; v_BTHM: [B, T, H, M].
      feature_map: registered name, FeatureMap or callable (see `feature_maps`).
      impl: one of "quadratic", "associative_scan", "chunked", "scan" (see the module docstring);
        all give the same result for every T.
      chunk_size: chunk length C for impl="chunked" (>= 1; None: `default_chunk_size` for the
        default backend and the dtype of v); T need not be a multiple of it.
      eps: added to the normaliser.

    Returns:
      [B, T, H, M] in the dtype of v. States and normalisers are accumulated in float32 or wider.
    """
    if impl not in IMPLS:
        raise ValueError(f"causal_linear_attention: unknown impl {impl!r}; expected one of {IMPLS}.")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"causal_linear_attention: chunk_size must be None or an integer >= 1, "
                         f"got {chunk_size!r}.")
    _checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name="causal_linear_attention")
    if q_BTHD.shape[1] != k_BTHD.shape[1]:
        raise ValueError(f"causal_linear_attention: queries and keys must have the same length, "
                         f"got T={q_BTHD.shape[1]} and S={k_BTHD.shape[1]}.")
    fm = make_feature_map(feature_map)
    acc = _checks.accumulation_dtype(v_BTHM.dtype)
    if impl == "scan":
        return _scan(q_BTHD, k_BTHD, v_BTHM, fm, eps, acc)
    phi_q_BTHF, phi_k_BTHF = fm.query(q_BTHD), fm.key(k_BTHD)
    if impl == "quadratic":
        return _quadratic(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc)
    if impl == "associative_scan":
        return _associative_scan(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc)
    if chunk_size is None:
        chunk_size = default_chunk_size(jax.default_backend(), v_BTHM.dtype)
    return _chunked(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc, chunk_size, segment_length())
