"""Transformer encoder and decoder layers and stacks, with parallel and recurrent forms.

Legend: B batch, T target time, S source (memory) time, E model width.

Layers follow the authors' post-norm layout (x = norm(x + dropout(sublayer(x)))) with an optional
final LayerNorm on the stack. Every stack built with causal self-attention also runs as an RNN:

  state = stack.init_state(batch, max_length, ...)    one pytree for all layers
  state, y_BE = stack.step(state, x_BE)               a `lax.scan` body
  state, y_BTE = stack.prefill(state, x_BTE)          T steps at once, in parallel form

`prefill` equals T calls of `step`: a prompt is read in one parallel pass, and decoding goes on
from the state it returns. Recurrent inference is inference: call `model.eval()` first so dropout
is off.

`TransformerConfig(sequence_axis="seq")` makes every attention layer split time over mesh axis
"seq" (sequence parallelism); run the model under `with jax.set_mesh(mesh):` on inputs whose
time axis is sharded over "seq" (P(None, "seq")), in the global view as usual.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers.attention import attention_class, check_inference_mode, check_sequence_axis
from linear_transformers.multi_head_attention import MultiHeadAttention, core_options

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
_DEFAULT_CROSS_KIND = {"causal-linear": ("linear", True), "reformer": ("softmax", False)}


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
        `from_kwargs` sets PyTorch's 1e-5, which the authors' models were trained with).
      attention: registered kind of self-attention ("softmax", "linear", "causal-linear", ...).
      attention_options: the kind's options, e.g. {"feature_map": "favor", "impl": "chunked"}.
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

    def __post_init__(self):
        object.__setattr__(self, "dtype", float_dtype(self.dtype, "TransformerConfig.dtype", allow_none=True))
        object.__setattr__(
            self, "param_dtype", float_dtype(self.param_dtype, "TransformerConfig.param_dtype")
        )
        for name in ("num_layers", "num_heads", "model_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig.{name} must be >= 1, got {getattr(self, name)}.")
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

    @classmethod
    def from_kwargs(cls, **kwargs) -> "TransformerConfig":
        """The config of the model the authors' builders (`TransformerEncoderBuilder`,
        `RecurrentEncoderBuilder`, `TransformerDecoderBuilder`, `RecurrentDecoderBuilder`)
        build from the same keyword arguments, with their defaults: see
        `linear_transformers.interop.config_from_builder_kwargs`.

        >>> TransformerConfig.from_kwargs(n_layers=8, n_heads=8, query_dimensions=32,
        ...                               value_dimensions=32, attention_type="causal-linear")
        """
        from linear_transformers.interop.builder_kwargs import config_from_builder_kwargs

        return config_from_builder_kwargs(**kwargs)


def _attention(config: TransformerConfig, *, cross: bool, causal: bool, rngs) -> MultiHeadAttention:
    kind = config.cross_kind if cross else config.attention
    return MultiHeadAttention(
        config.model_dim,
        config.num_heads,
        query_dim=config.head_query_dim,
        value_dim=config.head_value_dim,
        kind=kind,
        causal=causal,
        attention_options=config._core_options[1 if cross else 0],  # with attention_dropout, softmax_temp
        sequence_axis=config.sequence_axis,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


def layer_norm(config: TransformerConfig, rngs) -> nnx.LayerNorm:
    """LayerNorm in the config's dtypes; its statistics are float32 whatever the dtype."""
    return nnx.LayerNorm(
        config.model_dim,
        epsilon=config.layer_norm_epsilon,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


def dense(config: TransformerConfig, in_features: int, out_features: int, rngs, *, dtype=None) -> nnx.Linear:
    """nnx.Linear storing its parameters in config.param_dtype and computing in `dtype`
    (default config.dtype)."""
    return nnx.Linear(
        in_features,
        out_features,
        dtype=config.dtype if dtype is None else dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


def embedding(config: TransformerConfig, num_embeddings: int, features: int, rngs) -> nnx.Embed:
    """nnx.Embed in the config's dtypes."""
    return nnx.Embed(num_embeddings, features, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)


class _Residual(nnx.Module):
    """norm(x + dropout(y)): the post-norm residual connection."""

    def __init__(self, config: TransformerConfig, rngs):
        self.norm = layer_norm(config, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(self, x, y):
        return self.norm(x + self.dropout(y))


class FeedForward(nnx.Module):
    """Position-wise Linear(model_dim -> hidden_dim), activation, dropout, Linear back."""

    def __init__(self, config: TransformerConfig, rngs):
        self.linear1 = dense(config, config.model_dim, config.hidden_dim, rngs)
        self.linear2 = dense(config, config.hidden_dim, config.model_dim, rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.activation = config.activation

    def __call__(self, x):
        return self.linear2(self.dropout(ACTIVATIONS[self.activation](self.linear1(x))))


class EncoderLayer(nnx.Module):
    """Self-attention and feed-forward; causal=True makes it a decoder-only (GPT-style) layer."""

    def __init__(self, config: TransformerConfig, *, causal: bool = False, rngs: nnx.Rngs):
        self.attention = _attention(config, cross=False, causal=causal, rngs=rngs)
        self.attention_residual = _Residual(config, rngs)
        self.feed_forward = FeedForward(config, rngs)
        self.feed_forward_residual = _Residual(config, rngs)

    def __call__(self, x_BTE, *, key_lengths=None, mask=None):
        x_BTE = self.attention_residual(x_BTE, self.attention(x_BTE, key_lengths=key_lengths, mask=mask))
        return self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))

    def init_state(self, batch: int, max_length: int | None = None, dtype=None):
        """The self-attention's recurrent state (linear: (S, z); softmax: a KV cache)."""
        return self.attention.init_state(batch, max_length, dtype)

    def step(self, state, x_BE):
        """One token through the layer: (state, x_t [B, E]) -> (state, y_t [B, E])."""
        state, y_BE = self.attention.step(state, x_BE)
        x_BE = self.attention_residual(x_BE, y_BE)
        return state, self.feed_forward_residual(x_BE, self.feed_forward(x_BE))

    def prefill(self, state, x_BTE):
        """T tokens through the layer from `state`: -> (state, y [B, T, E]); equals T `step`s."""
        state, y_BTE = self.attention.prefill(state, x_BTE)
        x_BTE = self.attention_residual(x_BTE, y_BTE)
        return state, self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))


class DecoderLayerState(NamedTuple):
    self_attention: Any
    memory: Any


class DecoderLayer(nnx.Module):
    """Causal self-attention, cross-attention over an encoded memory, feed-forward."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.self_attention = _attention(config, cross=False, causal=True, rngs=rngs)
        self.self_attention_residual = _Residual(config, rngs)
        self.cross_attention = _attention(config, cross=True, causal=False, rngs=rngs)
        self.cross_attention_residual = _Residual(config, rngs)
        self.feed_forward = FeedForward(config, rngs)
        self.feed_forward_residual = _Residual(config, rngs)

    def __call__(self, x_BTE, memory_BSE, *, memory_lengths=None, target_lengths=None):
        x_BTE = self.self_attention_residual(x_BTE, self.self_attention(x_BTE, key_lengths=target_lengths))
        x_BTE = self.cross_attention_residual(
            x_BTE, self.cross_attention(x_BTE, memory_BSE, key_lengths=memory_lengths)
        )
        return self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))

    def init_state(
        self, batch: int, max_length: int | None, memory_BSE, *, memory_lengths=None, dtype=None
    ) -> DecoderLayerState:
        """Self-attention state plus the memory's keys/values (or their linear summary)."""
        return DecoderLayerState(
            self.self_attention.init_state(batch, max_length, dtype),
            self.cross_attention.init_memory(memory_BSE, memory_lengths),
        )

    def step(self, state: DecoderLayerState, x_BE):
        """One token: causal self-attention step, cross-attention over the memory, feed-forward."""
        self_state, y_BE = self.self_attention.step(state.self_attention, x_BE)
        x_BE = self.self_attention_residual(x_BE, y_BE)
        x_BE = self.cross_attention_residual(x_BE, self.cross_attention.attend_memory(state.memory, x_BE))
        x_BE = self.feed_forward_residual(x_BE, self.feed_forward(x_BE))
        return DecoderLayerState(self_state, state.memory), x_BE

    def prefill(self, state: DecoderLayerState, x_BTE):
        """T tokens: causal self-attention prefill, cross-attention of the block over the memory
        kept in the state, feed-forward -> (state, y [B, T, E]); equals T `step`s."""
        self_state, y_BTE = self.self_attention.prefill(state.self_attention, x_BTE)
        x_BTE = self.self_attention_residual(x_BTE, y_BTE)
        x_BTE = self.cross_attention_residual(x_BTE, self.cross_attention.attend_memory(state.memory, x_BTE))
        x_BTE = self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))
        return DecoderLayerState(self_state, state.memory), x_BTE


class _Stack(nnx.Module):
    def _final(self, x):
        return self.final_norm(x) if self.final_norm is not None else x

    def _step_layers(self, state, x, method: str):
        check_inference_mode(self)
        new_state = []
        for layer, layer_state in zip(self.layers, state, strict=True):
            layer_state, x = getattr(layer, method)(layer_state, x)
            new_state.append(layer_state)
        return tuple(new_state), self._final(x)


class Encoder(_Stack):
    """A stack of `EncoderLayer`s; causal=True gives a decoder-only stack with a recurrent form.

    >>> config = TransformerConfig(num_layers=2, num_heads=4, model_dim=64, attention="linear")
    >>> encoder = Encoder(config, rngs=nnx.Rngs(0))
    >>> y_BTE = encoder(x_BTE, key_lengths=lengths_B)

    Causal stacks also run recurrently (after `encoder.eval()`): `init_state`, then `step` one
    token or `prefill` a block of tokens at a time. Streaming a long input through in segments
    gives the parallel pass over the whole of it (linear kinds keep a constant-size state;
    softmax needs a cache of `max_length` >= the total length):

    >>> state = encoder.init_state(batch, max_length)
    >>> for x_BTE in segments:                     # [B, T_i, E] pieces of one long input
    ...     state, y_BTE = encoder.prefill(state, x_BTE)
    """

    def __init__(self, config: TransformerConfig, *, causal: bool = False, rngs: nnx.Rngs):
        self.causal = causal
        self.layers = nnx.List(
            [EncoderLayer(config, causal=causal, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.final_norm = layer_norm(config, rngs) if config.final_normalization else None

    def __call__(self, x_BTE, *, key_lengths=None, mask=None):
        for layer in self.layers:
            x_BTE = layer(x_BTE, key_lengths=key_lengths, mask=mask)
        return self._final(x_BTE)

    def init_state(self, batch: int, max_length: int | None = None, dtype=None):
        """Tuple of per-layer states (causal stacks only). `dtype`: of KV caches; default the
        config's dtype (float32 when that is None); linear states are float32 at least."""
        check_inference_mode(self)
        return tuple(layer.init_state(batch, max_length, dtype) for layer in self.layers)

    def step(self, state, x_BE):
        """One token through every layer; usable as a `lax.scan` body (see `generation`)."""
        return self._step_layers(state, x_BE, "step")

    def prefill(self, state, x_BTE):
        """T tokens through every layer in parallel form, from `state` (from `init_state`, `step`
        or `prefill`): -> (state, y [B, T, E]). Equals T calls of `step`; causal stacks only."""
        return self._step_layers(state, x_BTE, "prefill")


class Decoder(_Stack):
    """A stack of `DecoderLayer`s attending to an encoder's output.

    Parallel: decoder(x_BTE, memory_BSE, memory_lengths=...). Recurrent:
    state = decoder.init_state(batch, max_length, memory_BSE); state, y_BE = decoder.step(state,
    x_BE), where the memory's keys/values are projected once in init_state; state, y_BTE =
    decoder.prefill(state, x_BTE) reads a block of target tokens at once (a forced prefix).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = layer_norm(config, rngs) if config.final_normalization else None

    def __call__(self, x_BTE, memory_BSE, *, memory_lengths=None, target_lengths=None):
        """target_lengths int [B]: decoder positions at index >= target_lengths are padding that
        no valid position attends to (what matters where a kind's causal outputs depend on
        later positions, as LSH's buckets do)."""
        for layer in self.layers:
            x_BTE = layer(x_BTE, memory_BSE, memory_lengths=memory_lengths, target_lengths=target_lengths)
        return self._final(x_BTE)

    def init_state(self, batch: int, max_length: int | None, memory_BSE, *, memory_lengths=None, dtype=None):
        """Per-layer states; each layer projects the memory's keys/values here, once."""
        check_inference_mode(self)
        return tuple(
            layer.init_state(batch, max_length, memory_BSE, memory_lengths=memory_lengths, dtype=dtype)
            for layer in self.layers
        )

    def step(self, state, x_BE):
        """One decoder token through every layer -> (state, y_t [B, E])."""
        return self._step_layers(state, x_BE, "step")

    def prefill(self, state, x_BTE):
        """T decoder tokens through every layer in parallel form, cross-attending to the memory
        kept in the state: -> (state, y [B, T, E]). Equals T calls of `step`."""
        return self._step_layers(state, x_BTE, "prefill")
