"""The recurrent state of linear attention, shared by every linear form.

Legend: B batch, H heads, F feature-map features, M value features; `x` in a suffix: any
leading shape.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LinearState(NamedTuple):
    """The recurrent state of linear attention: s = sum phi(k) v^T [B, H, F, M], z = sum phi(k)
    [B, H, F] (None for attention without a normaliser)."""

    s_BHFM: jax.Array
    z_BHF: jax.Array


def init_linear_state(
    batch: int, heads: int, d: int, m: int, dtype=jnp.float32, *, normalizer: bool = True
) -> LinearState:
    """Zero state for the linear-attention steps and the `initial_state` of the causal ops.

    `d` is the feature-map dimension F (equal to the head dimension D for "elu", "relu" and
    "identity"; `make_feature_map(...).num_features(D)` in general). `normalizer=False`: no z,
    for `gated_linear_attention(normalize=False)`. Keep `dtype` float32 or wider: the state is
    a running sum.
    """
    return LinearState(
        s_BHFM=jnp.zeros((batch, heads, d, m), dtype),
        z_BHF=jnp.zeros((batch, heads, d), dtype) if normalizer else None,
    )


def normalise(num_xM, den_x, eps, dtype):
    """num / (den + eps) in the accumulation dtype, then cast to `dtype` (the output's)."""
    return (num_xM / (den_x + eps)[..., None]).astype(dtype)
