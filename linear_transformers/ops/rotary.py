"""Rotary position embedding (RoPE): relative positions as rotations of query and key features.

Legend: B batch, T time, H heads, D features (even).

Feature pairs (i, i + D/2) of a token at position p are rotated by the angle p * base^(-2i/D)
(the half-split layout of GPT-NeoX and of FLA's `RotaryEmbedding`), so q_t . k_s depends on
t - s only. RetNet's retention rotates its queries and keys this way (its xPos without the
scaling, as FLA's retention layer does).
"""

from __future__ import annotations

import jax.numpy as jnp


def rotary_embedding(x_BTHD, positions_BT, *, base: float = 10000.0):
    """x rotated by its positions: [B, T, H, D] and int [B, T] (or [T]) -> [B, T, H, D] in x's
    dtype; the angles are computed in float32. One step: x [B, H, D] with positions [B]."""
    D = x_BTHD.shape[-1]
    if D % 2:
        raise ValueError(f"rotary_embedding: the feature count must be even, got {D}.")
    inv_freq = jnp.exp(-jnp.log(base) * jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    angles = jnp.asarray(positions_BT, jnp.float32)[..., None, None] * inv_freq  # [..., 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x = x_BTHD.astype(jnp.promote_types(x_BTHD.dtype, jnp.float32))
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return rotated.astype(x_BTHD.dtype)
