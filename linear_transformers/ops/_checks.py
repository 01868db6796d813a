"""Input validation shared by the attention ops.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features.
Checks run on static shapes only, so they cost nothing under `jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_qkv(q_BTHD, k_BSHD, v_BSHM, *, name: str) -> None:
    """Raise a ValueError naming the bad shape unless q, k, v form a valid attention call."""
    for arr_name, arr in (("q", q_BTHD), ("k", k_BSHD), ("v", v_BSHM)):
        if arr.ndim != 4:
            raise ValueError(
                    f"{name}: {arr_name} must have 4 dimensions [batch, time, heads, features], "
                    f"got shape {tuple(arr.shape)}.")
    B, _, H, D = q_BTHD.shape
    if k_BSHD.shape[0] != B or k_BSHD.shape[2] != H or k_BSHD.shape[3] != D:
        raise ValueError(
                f"{name}: k shape {tuple(k_BSHD.shape)} does not match q shape {tuple(q_BTHD.shape)}; "
                "k must be [B, S, H, D] with the batch, heads and features of q.")
    if v_BSHM.shape[:3] != k_BSHD.shape[:3]:
        raise ValueError(
                f"{name}: v shape {tuple(v_BSHM.shape)} does not match k shape {tuple(k_BSHD.shape)}; "
                "v must be [B, S, H, M] with the batch, length and heads of k.")


def check_step_qkv(q_BHD, k_BHD, v_BHM, *, name: str) -> None:
    """Like `check_qkv` for one time step: q, k are [B, H, D] and v is [B, H, M]."""
    for arr_name, arr in (("q_t", q_BHD), ("k_t", k_BHD), ("v_t", v_BHM)):
        if arr.ndim != 3:
            raise ValueError(
                    f"{name}: {arr_name} must have 3 dimensions [batch, heads, features], "
                    f"got shape {tuple(arr.shape)}.")
    if q_BHD.shape != k_BHD.shape:
        raise ValueError(f"{name}: q_t shape {tuple(q_BHD.shape)} and k_t shape "
                                          f"{tuple(k_BHD.shape)} must be equal.")
    if v_BHM.shape[:2] != q_BHD.shape[:2]:
        raise ValueError(f"{name}: v_t shape {tuple(v_BHM.shape)} must share batch and heads "
                                          f"with q_t shape {tuple(q_BHD.shape)}.")


def check_key_lengths(key_lengths, batch: int, *, name: str):
    """Return key_lengths as an int32 [B] array, or raise if its shape is not [B]."""
    if key_lengths is None:
        return None
    key_lengths = jnp.asarray(key_lengths)
    if key_lengths.shape != (batch,) or not jnp.issubdtype(key_lengths.dtype, jnp.integer):
        raise ValueError(
                f"{name}: key_lengths must be an integer array of shape ({batch},) giving the number of "
                f"valid keys per batch element, got {key_lengths.dtype} array of shape "
                f"{tuple(key_lengths.shape)}.")
    return key_lengths.astype(jnp.int32)


def key_padding_mask(key_lengths_B, length: int):
    """[B, S] boolean mask, True where key index < key_lengths[b]."""
    return jnp.arange(length)[None, :] < key_lengths_B[:, None]


def accumulation_dtype(dtype) -> jnp.dtype:
    """float32 for half-precision inputs, the input precision when it is higher (float64 tests)."""
    return jnp.promote_types(dtype, jnp.float32)


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)
