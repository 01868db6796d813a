"""Linformer attention (Wang et al., 2020): keys and values projected along time to J rows.

Legend: B batch, T query time, S key time, L maximum key length, J projected rows, H heads,
D query/key features, M value features.

softmax(q (E^T k)^T * scale) (F^T v) with the paper's learned projections E, F (`e_LJ`, `f_LJ`
here; not the model width E or feature-map features F) of shape [L, J]: O(T J) instead of O(T S).
Inputs shorter than L use the first S rows of E and F, which is the same as zero-padding them
to L. Padded keys (key_lengths) are zeroed before the projection, so their content cannot reach
any output; they still occupy no row of their own, as every projected row mixes all positions.
There is no causal form: every projected row depends on every position.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_transformers.ops import input_checks, precision
from linear_transformers.ops.softmax import softmax_attention


def linformer_project(k_BSHD, v_BSHM, e_LJ, f_LJ, *, key_lengths=None):
    """The J projected keys [B, J, H, D] and values [B, J, H, M] (accumulated in float32)."""
    S = k_BSHD.shape[1]
    for name, p in (("e", e_LJ), ("f", f_LJ)):
        if p.ndim != 2:
            raise ValueError(
                f"linformer: projection {name} must be [max_length, rows], got shape {tuple(p.shape)}."
            )
    if S > e_LJ.shape[0] or S > f_LJ.shape[0]:
        raise ValueError(
            f"linformer: {S} keys exceed the maximum length {e_LJ.shape[0]} its "
            f"projections were built for; build the layer with max_length >= {S} "
            f"or shorten the input."
        )
    key_lengths = input_checks.check_key_lengths(
        key_lengths, k_BSHD.shape[0], name="linformer", length=k_BSHD.shape[1]
    )
    if key_lengths is not None:
        valid_BS11 = input_checks.key_padding_mask(key_lengths, S)[:, :, None, None]
        k_BSHD = jnp.where(valid_BS11, k_BSHD, 0)
        v_BSHM = jnp.where(valid_BS11, v_BSHM, 0)
    acc = input_checks.accumulation_dtype(k_BSHD.dtype)
    k_BJHD = precision.einsum_in(acc, "bshd,sj->bjhd", k_BSHD, e_LJ[:S].astype(k_BSHD.dtype))
    v_BJHM = precision.einsum_in(acc, "bshm,sj->bjhm", v_BSHM, f_LJ[:S].astype(v_BSHM.dtype))
    return k_BJHD, v_BJHM


def linformer_attention(q_BTHD, k_BSHD, v_BSHM, e_LJ, f_LJ, *, key_lengths=None, scale=None):
    """Linformer attention of [B, T, H, D] queries over S <= L keys -> [B, T, H, M] (v's dtype)."""
    input_checks.check_qkv(q_BTHD, k_BSHD, v_BSHM, name="linformer_attention")
    k_BJHD, v_BJHM = linformer_project(k_BSHD, v_BSHM, e_LJ, f_LJ, key_lengths=key_lengths)
    acc = k_BJHD.dtype
    out_BTHM = softmax_attention(q_BTHD.astype(acc), k_BJHD, v_BJHM, scale=scale)
    return out_BTHM.astype(v_BSHM.dtype)
