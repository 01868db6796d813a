"""`TransformerConfig`: the hyperparameters of an encoder or decoder stack.

The authors' builder arguments become a config through `interop.config_from_builder_kwargs`
(`TransformerConfig.from_kwargs`, deprecated, is the same; interop/convert.py defines it).

Legend: E model width, D key/query features per head, M value features per head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from linear_transformers.attention import attention_class, check_sequence_axis
from linear_transformers.core_options import core_options
from linear_transformers.ops.input_checks import check_int

# "gelu" is the exact erf form, as torch.nn.functional.gelu and the authors' layers compute it;
# "gelu_tanh" is the tanh approximation (jax.nn.gelu's default).
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}

FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def float_dtype(value, name: str, *, allow_none: bool = False):
    """`value` ("bfloat16", jnp.bfloat16, np.dtype(...), ...) as a numpy dtype; anything but a
    floating dtype of FLOAT_DTYPES (or None where allowed) is an error naming `name`."""
    if value is None and allow_none:
        return None
    try:
        dtype = None if value is None else jnp.dtype(value)  # jnp.dtype(None) is float32
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in FLOAT_DTYPES:
        allowed = ", ".join(FLOAT_DTYPES) + (" or None" if allow_none else "")
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}.")
    return dtype


# Cross-attention when only the self-attention kind is given, as (kind, whether it inherits the
# self-attention options): the non-causal relative of a causal-only kind, and full softmax for
# reformer, whose shared query/key needs self-attention (as in the Reformer's encoder-decoder).
_DEFAULT_CROSS_KIND = {
    "causal-linear": ("linear", True),
    "reformer": ("softmax", False),
    # The gated and delta-rule kinds run along time, so they have no non-causal form: linear
    # cross-attention.
    "retention": ("linear", False),
    "simple-gla": ("linear", False),
    "gla": ("linear", False),
    "deltanet": ("linear", False),
    "gated-deltanet": ("linear", False),
    "kda": ("linear", False),
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of an encoder or decoder stack.

    Attributes:
      num_layers, num_heads: stack depth and attention heads.
      model_dim: width E of the residual stream.
      query_dim, value_dim: per-head D and M; default model_dim // num_heads.
      feed_forward_dim: hidden width of the feed-forward block; default 4 * model_dim.
      activation: "relu", "gelu" (exact, with erf, as in PyTorch) or "gelu_tanh" (the tanh
        approximation).
      dropout: on the residual branches and inside the feed-forward block.
      attention_dropout: on attention probabilities (kinds with a probability matrix only).
      softmax_temp: logit scale for softmax kinds; default 1/sqrt(query_dim).
      final_normalization: LayerNorm after the last layer.
      layer_norm_epsilon: added to the variance in every LayerNorm (Flax's 1e-6 by default;
        `interop.config_from_builder_kwargs` sets PyTorch's 1e-5, which the authors' models
        were trained with).
      attention: registered kind of self-attention ("softmax", "linear", "causal-linear", ...).
      attention_options: the kind's options, e.g. {"feature_map": "favor", "implementation": "chunked"}.
      cross_attention, cross_attention_options: decoder cross-attention; default the
        self-attention kind and options ("linear" where self-attention is "causal-linear",
        "softmax" with default options where it is "reformer").
      sequence_axis: mesh axis name to split time over in every attention layer (sequence
        parallelism), or None. Both kinds (self- and cross-attention) need a sequence-parallel
        form (softmax, linear, causal-linear). Sequence lengths must divide over the axis; the
        recurrent forms (`step`, `prefill`) run whatever the length.
      dtype: computation dtype of every projection, LayerNorm output and activation, as in Flax
        ("bfloat16", "float32", a jnp dtype, or None: from the inputs and parameters). Whatever
        it is, LayerNorm statistics, softmax, linear-attention states and normalisers stay in
        float32 (at least), and models compute their heads (logits, mixture parameters) in
        float32.
      param_dtype: storage dtype of every parameter (default float32: the master copy an
        optimizer updates; parameters are cast to `dtype` where they are used).
      unroll_layers: layers per iteration of the scan that runs the stack (`layer_stack`): 1
        compiles one layer whatever the depth (the fastest compile); up to num_layers unrolls
        them all, so XLA may fuse across layers at the cost of a compile that grows with the
        depth again (BENCHMARKS.md, "Compile time"). The parameters stay stacked either way,
        and the function is the same.
    """

    num_layers: int = 4
    num_heads: int = 4
    model_dim: int = 128
    query_dim: int | None = None
    value_dim: int | None = None
    feed_forward_dim: int | None = None
    activation: str = "relu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    softmax_temp: float | None = None
    final_normalization: bool = True
    layer_norm_epsilon: float = 1e-6
    attention: str = "linear"
    attention_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    cross_attention: str | None = None
    cross_attention_options: Mapping[str, Any] | None = None
    sequence_axis: str | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    unroll_layers: int = 1

    def __post_init__(self):
        object.__setattr__(self, "dtype", float_dtype(self.dtype, "TransformerConfig.dtype", allow_none=True))
        object.__setattr__(
            self, "param_dtype", float_dtype(self.param_dtype, "TransformerConfig.param_dtype")
        )
        # A numpy integer is stored as an int; a bool or a float is refused, naming the field.
        for name in ("num_layers", "num_heads", "model_dim"):
            object.__setattr__(
                self, name, check_int(getattr(self, name), f"TransformerConfig.{name}", minimum=None)
            )
        for name in ("query_dim", "value_dim", "feed_forward_dim"):
            value = check_int(getattr(self, name), f"TransformerConfig.{name}", minimum=None, allow_none=True)
            object.__setattr__(self, name, value)
        for name in ("num_layers", "num_heads", "model_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}.")
        unroll = check_int(self.unroll_layers, "TransformerConfig.unroll_layers", minimum=None)
        if not 1 <= unroll <= self.num_layers:
            raise ValueError(
                f"TransformerConfig.unroll_layers must be in [1, num_layers={self.num_layers}] "
                f"(layers per iteration of the scan over the stack), got {unroll}."
            )
        object.__setattr__(self, "unroll_layers", unroll)
        for name in ("query_dim", "value_dim", "feed_forward_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(
                    f"TransformerConfig.{name} must be None (derived) or >= 1, got {getattr(self, name)}."
                )
        if self.softmax_temp is not None and not self.softmax_temp > 0:
            raise ValueError(
                f"TransformerConfig.softmax_temp must be None (1/sqrt(query_dim)) or > 0, "
                f"got {self.softmax_temp}."
            )
        if self.query_dim is None and self.model_dim % self.num_heads:
            raise ValueError(
                f"TransformerConfig: model_dim={self.model_dim} is not divisible by "
                f"num_heads={self.num_heads}; choose a width that divides or set query_dim."
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"TransformerConfig.activation {self.activation!r} is unknown; "
                f"expected one of {sorted(ACTIVATIONS)}."
            )
        if not self.layer_norm_epsilon > 0:
            raise ValueError(
                f"TransformerConfig.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}."
            )
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TransformerConfig.{name} must be in [0, 1), got {getattr(self, name)}.")
        if attention_class(self.cross_kind).shares_query_key:
            raise ValueError(
                f"TransformerConfig.cross_attention {self.cross_kind!r} shares queries "
                "and keys, so it cannot attend to a memory; choose another kind."
            )
        # Each kind's options class, built (so validated) once, here, with attention_dropout and
        # softmax_temp included: every layer is handed these instances (self-, cross-attention).
        object.__setattr__(
            self,
            "_core_options",
            tuple(
                core_options(
                    kind, options, attention_dropout=self.attention_dropout, softmax_temp=self.softmax_temp
                )
                for kind, options in (
                    (self.attention, self.attention_options),
                    (self.cross_kind, self.cross_options),
                )
            ),
        )
        try:
            for kind in dict.fromkeys((self.attention, self.cross_kind)):
                check_sequence_axis(kind, self.sequence_axis)
        except ValueError as e:
            raise ValueError(f"TransformerConfig: {e}") from None

    @property
    def output_dtype(self):
        """Dtype of a model's head (logits, mixture parameters): float32 at least; None (from
        the inputs and parameters) when `dtype` is None."""
        return None if self.dtype is None else jnp.promote_types(self.dtype, jnp.float32)

    @property
    def head_query_dim(self) -> int:
        return self.query_dim or self.model_dim // self.num_heads

    @property
    def head_value_dim(self) -> int:
        return self.value_dim or self.head_query_dim

    @property
    def hidden_dim(self) -> int:
        return self.feed_forward_dim or 4 * self.model_dim

    @property
    def cross_kind(self) -> str:
        if self.cross_attention is not None:
            return self.cross_attention
        return _DEFAULT_CROSS_KIND.get(self.attention, (self.attention, True))[0]

    @property
    def cross_options(self) -> Mapping[str, Any]:
        if self.cross_attention_options is not None:
            return self.cross_attention_options
        if self.cross_attention is None and _DEFAULT_CROSS_KIND.get(self.attention, ("", True))[1]:
            return self.attention_options
        return {}
