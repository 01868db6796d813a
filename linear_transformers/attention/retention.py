"""`"retention"`: RetNet's multi-scale retention (Sun et al., 2023), a constant decay per head.

Legend: B batch, T time, E layer input width, H heads.

Head h decays its state by gamma_h = 1 - 2^(-5 - h) every step, so the heads see from ~32 to
thousands of tokens back; queries and keys are rotated by their positions (`rotary`, RetNet's
xPos without its scaling, as FLA's retention layer), each head's output is normalised (RetNet's
GroupNorm: `norm="group"`, the default here) and gated by swish(x W_gate).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from linear_transformers.attention.base import register_attention
from linear_transformers.attention.gated import GatedLinearCore, GatedOptions


def retention_log_decay(num_heads: int):
    """log(gamma_h) = log(1 - 2^(-5 - h)) for h = 0 .. H - 1: [H] float32."""
    return jnp.log1p(-jnp.exp2(-5.0 - jnp.arange(num_heads, dtype=jnp.float32)))


@dataclasses.dataclass(frozen=True)
class RetentionOptions(GatedOptions):
    """Options of `"retention"`: `GatedOptions` with RetNet's GroupNorm, and

    Attributes:
      rotary: rotate queries and keys by their positions (default True, as RetNet).
    """

    norm: str | None = "group"
    rotary: bool = True


@register_attention("retention")
class Retention(GatedLinearCore):
    """RetNet's retention: s_t = gamma_h s_{t-1} + k_t v_t^T, out_t = q_t . s_t * D**-0.5, then
    the norm per head and the swish gate (`gated.py`). Options: `RetentionOptions`."""

    options_class = RetentionOptions

    def log_decay(self, x_BTE):
        """The constant decays [H] (the input does not change them)."""
        del x_BTE
        return retention_log_decay(self.num_heads)
