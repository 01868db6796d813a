"""Causal linear attention in four forms that compute the same thing.

Legend: B batch, T time, H heads, D key/query features, F feature-map features, M value
features, N chunks, C chunk length.

  out_t = phi(q_t) . S_t / (phi(q_t) . z_t + eps),  S_t = sum_{s<=t} phi(k_s) v_s^T,
                                                     z_t = sum_{s<=t} phi(k_s)

- "quadratic": the masked [T, T] product; O(T^2) time and memory. The reference.
- "associative_scan": `jax.lax.associative_scan` of the prefix states; O(T log T) work but one
  [F, M] state per position in memory.
- "chunked": within a chunk of C steps the masked [C, C] product, between chunks the prefix sum of
  per-chunk states; O(T*C + (T/C)*F*M) memory, matmul-shaped work. The default.
- "scan": the RNN, `lax.scan` over `linear_attention_step`; O(F*M) state, T sequential steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import _checks
from linear_transformers.ops.feature_maps import make_feature_map
from linear_transformers.ops.linear import init_linear_state, linear_attention_step

IMPLS = ("quadratic", "associative_scan", "chunked", "scan")
DEFAULT_CHUNK_SIZE = 64


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


def _exclusive_cumsum(x_BN):
    """Sum over chunks m < n along axis 1, by shifting rather than cumsum(x) - x, which would
    let chunk n's own (partly future) entries in up to rounding and break exact causality."""
    shifted = jnp.pad(x_BN[:, :-1], ((0, 0), (1, 0)) + ((0, 0),) * (x_BN.ndim - 2))
    return jnp.cumsum(shifted, axis=1)


def _chunked(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc, chunk_size):
    B, T, H, F = phi_q_BTHF.shape
    M = v_BTHM.shape[-1]
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T
    if pad:
        # Padding goes after every real step, so causality keeps it out of every real output.
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        phi_q_BTHF, phi_k_BTHF, v_BTHM = (jnp.pad(x, widths)
                                          for x in (phi_q_BTHF, phi_k_BTHF, v_BTHM))
    q_BNCHF = phi_q_BTHF.reshape(B, N, C, H, F)
    k_BNCHF = phi_k_BTHF.reshape(B, N, C, H, F)
    v_BNCHM = v_BTHM.reshape(B, N, C, H, M)

    # Between chunks: state of everything before chunk n (exclusive prefix sum of chunk states).
    kv_BNHFM = jnp.einsum("bnchf,bnchm->bnhfm", k_BNCHF, v_BNCHM, preferred_element_type=acc)
    ksum_BNHF = jnp.sum(k_BNCHF.astype(acc), axis=2)
    s_BNHFM = _exclusive_cumsum(kv_BNHFM)
    z_BNHF = _exclusive_cumsum(ksum_BNHF)

    # Within a chunk: the masked quadratic form on C x C.
    sim_BNHCC = jnp.einsum("bnchf,bndhf->bnhcd", q_BNCHF, k_BNCHF, preferred_element_type=acc)
    sim_BNHCC = jnp.where(jnp.tril(jnp.ones((C, C), bool)), sim_BNHCC, 0)

    q_acc = q_BNCHF.astype(acc)
    num_BNCHM = (jnp.einsum("bnhcd,bndhm->bnchm", sim_BNHCC, v_BNCHM.astype(acc)) +
                 jnp.einsum("bnchf,bnhfm->bnchm", q_acc, s_BNHFM))
    den_BNCH = (jnp.einsum("bnhcd->bnch", sim_BNHCC) +
                jnp.einsum("bnchf,bnhf->bnch", q_acc, z_BNHF))
    out_BNCHM = _normalise(num_BNCHM, den_BNCH, eps, v_BTHM.dtype)
    return out_BNCHM.reshape(B, N * C, H, M)[:, :T]


def _scan(q_BTHD, k_BTHD, v_BTHM, fm, eps, acc):
    B, _, H, D = q_BTHD.shape
    state = init_linear_state(B, H, fm.num_features(D), v_BTHM.shape[-1], dtype=acc)

    def step(state, qkv_t):
        return linear_attention_step(state, *qkv_t, feature_map=fm, eps=eps)

    time_major = tuple(jnp.swapaxes(x, 0, 1) for x in (q_BTHD, k_BTHD, v_BTHM))
    _, out_TBHM = jax.lax.scan(step, state, time_major)
    return jnp.swapaxes(out_TBHM, 0, 1)


def causal_linear_attention(q_BTHD, k_BTHD, v_BTHM, *, feature_map="elu", impl="chunked",
                            chunk_size=DEFAULT_CHUNK_SIZE, eps=1e-6):
    """Causal linear attention: query t attends to keys s <= t.

    Args:
      q_BTHD, k_BTHD: [B, T, H, D]; v_BTHM: [B, T, H, M].
      feature_map: registered name, FeatureMap or callable (see `feature_maps`).
      impl: one of "quadratic", "associative_scan", "chunked", "scan" (see the module docstring);
        all give the same result for every T.
      chunk_size: chunk length C for impl="chunked" (>= 1); T need not be a multiple of it.
      eps: added to the normaliser.

    Returns:
      [B, T, H, M] in the dtype of v. States and normalisers are accumulated in float32 or wider.
    """
    if impl not in IMPLS:
        raise ValueError(f"causal_linear_attention: unknown impl {impl!r}; expected one of {IMPLS}.")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"causal_linear_attention: chunk_size must be an integer >= 1, "
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
    return _chunked(phi_q_BTHF, phi_k_BTHF, v_BTHM, eps, acc, chunk_size)
