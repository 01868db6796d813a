"""`"simple-gla"` and `"gla"`: gated linear attention (Yang et al., 2024) with decays computed
from the input, one per head and step, or one per key feature and step.

Legend: B batch, T time, E layer input width, H heads, D key features per head.

  simple-gla (Mamba-2's SSD, FLA's simple GLA):  g_t = log_sigmoid(x_t W + b) / normalizer  [B, T, H]
  gla:  g_t = log_sigmoid((x_t W1) W2 + b) / normalizer, W1 [E, rank], W2 [rank, H*D]     [B, T, H, D]

as FLA's `SimpleGatedLinearAttention` and `GatedLinearAttention` layers compute them (their
normalizer 16: decays close to 1, so the state keeps a long memory at initialisation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers.attention.base import integer_option, register_attention
from linear_transformers.attention.gated import GatedLinearCore, GatedOptions


@dataclasses.dataclass(frozen=True)
class SimpleGLAOptions(GatedOptions):
    """Options of `"simple-gla"`: `GatedOptions` and

    Attributes:
      gate_logit_normalizer: the log-sigmoid of the gate logits is divided by it (default 16).
    """

    gate_logit_normalizer: float = 16.0

    def __post_init__(self):
        super().__post_init__()
        if not self.gate_logit_normalizer > 0:
            raise ValueError(
                f"{type(self).__name__}: gate_logit_normalizer must be > 0, got "
                f"{self.gate_logit_normalizer!r}."
            )


@dataclasses.dataclass(frozen=True)
class GLAOptions(SimpleGLAOptions):
    """Options of `"gla"`: `SimpleGLAOptions` and

    Attributes:
      gate_low_rank_dim: the rank of the gate projection (default 16).
    """

    gate_low_rank_dim: int = 16

    def __post_init__(self):
        super().__post_init__()
        integer_option(self, "gate_low_rank_dim", where="GLAOptions")


def _linear(rngs, param_dtype, dtype, i, o, *, use_bias):
    return nnx.Linear(i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


@register_attention("simple-gla")
class SimpleGLA(GatedLinearCore):
    """A scalar decay per head and step from the input: s_t = exp(g_t) s_{t-1} + k_t v_t^T.
    Options: `SimpleGLAOptions`."""

    options_class = SimpleGLAOptions

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        self.decay_projection = _linear(
            rngs, param_dtype, self.dtype, self.in_features, self.num_heads, use_bias=True
        )

    def log_decay(self, x_BTE):
        """log_sigmoid(x W + b) / normalizer: [B, T, H], in float32."""
        logits_BTH = self.decay_projection(x_BTE).astype(jnp.float32)
        return jax.nn.log_sigmoid(logits_BTH) / self.options.gate_logit_normalizer


@register_attention("gla")
class GLA(GatedLinearCore):
    """One decay per key feature and step, from a low-rank projection of the input:
    s_t = diag(exp(g_t)) s_{t-1} + k_t v_t^T. Options: `GLAOptions`."""

    options_class = GLAOptions

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        rank = self.options.gate_low_rank_dim
        F = self.feature_map.num_features(self.head_dim)
        self.decay_down = _linear(rngs, param_dtype, self.dtype, self.in_features, rank, use_bias=False)
        self.decay_up = _linear(rngs, param_dtype, self.dtype, rank, self.num_heads * F, use_bias=True)

    def log_decay(self, x_BTE):
        """log_sigmoid((x W1) W2 + b) / normalizer: [B, T, H, F], in float32."""
        logits = self.decay_up(self.decay_down(x_BTE)).astype(jnp.float32)
        logits_BTHF = logits.reshape(logits.shape[:-1] + (self.num_heads, -1))
        return jax.nn.log_sigmoid(logits_BTHF) / self.options.gate_logit_normalizer
