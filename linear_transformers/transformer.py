"""Transformer encoder and decoder layers and stacks, with parallel and recurrent forms.

Legend: B batch, T target time, S source (memory) time, E model width.

Layers follow the authors' post-norm layout (x = norm(x + dropout(sublayer(x)))) with an optional
final LayerNorm on the stack. A stack keeps its layers as one layer whose variables are stacked
along a leading axis of L and runs them by a scan (`layer_stack`): one compiled layer, whatever
the depth. `stack.layers` is that layer (`stack.layers.attention.core.kind`; parameters [L, ...]),
`layer_stack.layer(stack.layers, i)` a copy of layer i. Every stack built with causal
self-attention also runs as an RNN:

  state = stack.init_state(batch, max_length=...)     the layers' states, stacked [L, ...]
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

import weakref
from typing import Any, NamedTuple

import jax
from flax import nnx

from linear_transformers import layer_stack
from linear_transformers.attention.base import check_inference_mode, keyword_state_arguments
from linear_transformers.config import ACTIVATIONS, TransformerConfig
from linear_transformers.multi_head_attention import MultiHeadAttention


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

    def __call__(self, x_BTE, *, key_lengths=None, mask=None, segment_ids=None, positions=None):
        y_BTE = self.attention(
            x_BTE, key_lengths=key_lengths, mask=mask, segment_ids=segment_ids, positions=positions
        )
        x_BTE = self.attention_residual(x_BTE, y_BTE)
        return self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))

    @keyword_state_arguments
    def init_state(self, batch: int, *, max_length: int | None = None, dtype=None):
        """The self-attention's recurrent state (linear: (s, z); softmax: a KV cache)."""
        return self.attention.init_state(batch, max_length=max_length, dtype=dtype)

    def step(self, state, x_BE):
        """One token through the layer: (state, x_t [B, E]) -> (state, y_t [B, E])."""
        state, y_BE = self.attention.step(state, x_BE)
        x_BE = self.attention_residual(x_BE, y_BE)
        return state, self.feed_forward_residual(x_BE, self.feed_forward(x_BE))

    def prefill(self, state, x_BTE, *, segment_ids=None, positions=None):
        """T tokens through the layer from `state`: -> (state, y [B, T, E]); equals T `step`s."""
        state, y_BTE = self.attention.prefill(state, x_BTE, segment_ids=segment_ids, positions=positions)
        x_BTE = self.attention_residual(x_BTE, y_BTE)
        return state, self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))


def _check_memory(memory_BSE, batch: int, where: str) -> None:
    if getattr(memory_BSE, "ndim", None) != 3 or memory_BSE.shape[0] != batch:
        raise ValueError(
            f"{where}: memory must be the encoder's output [batch={batch}, S, E], got "
            f"{getattr(memory_BSE, 'shape', type(memory_BSE).__name__)}."
        )


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

    def __call__(
        self,
        x_BTE,
        memory_BSE,
        *,
        memory_lengths=None,
        target_lengths=None,
        segment_ids=None,
        memory_segment_ids=None,
        positions=None,
    ):
        y_BTE = self.self_attention(
            x_BTE, key_lengths=target_lengths, segment_ids=segment_ids, positions=positions
        )
        x_BTE = self.self_attention_residual(x_BTE, y_BTE)
        y_BTE = self.cross_attention(
            x_BTE,
            memory_BSE,
            key_lengths=memory_lengths,
            segment_ids=None if memory_segment_ids is None else segment_ids,
            context_segment_ids=memory_segment_ids,
        )
        x_BTE = self.cross_attention_residual(x_BTE, y_BTE)
        return self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))

    @keyword_state_arguments
    def init_state(
        self, batch: int, *, memory, memory_lengths=None, max_length: int | None = None, dtype=None
    ) -> DecoderLayerState:
        """Self-attention state plus the memory's keys/values (or their linear summary);
        `memory` [B, S, E] is the encoder's output, `memory_lengths` int [B] its valid lengths."""
        _check_memory(memory, batch, "DecoderLayer.init_state")
        return DecoderLayerState(
            self.self_attention.init_state(batch, max_length=max_length, dtype=dtype),
            self.cross_attention.init_memory(memory, memory_lengths),
        )

    def step(self, state: DecoderLayerState, x_BE):
        """One token: causal self-attention step, cross-attention over the memory, feed-forward."""
        self_state, y_BE = self.self_attention.step(state.self_attention, x_BE)
        x_BE = self.self_attention_residual(x_BE, y_BE)
        x_BE = self.cross_attention_residual(x_BE, self.cross_attention.attend_memory(state.memory, x_BE))
        x_BE = self.feed_forward_residual(x_BE, self.feed_forward(x_BE))
        return DecoderLayerState(self_state, state.memory), x_BE

    def prefill(self, state: DecoderLayerState, x_BTE, *, segment_ids=None, positions=None):
        """T tokens: causal self-attention prefill, cross-attention of the block over the memory
        kept in the state, feed-forward -> (state, y [B, T, E]); equals T `step`s."""
        self_state, y_BTE = self.self_attention.prefill(
            state.self_attention, x_BTE, segment_ids=segment_ids, positions=positions
        )
        x_BTE = self.self_attention_residual(x_BTE, y_BTE)
        x_BTE = self.cross_attention_residual(x_BTE, self.cross_attention.attend_memory(state.memory, x_BTE))
        x_BTE = self.feed_forward_residual(x_BTE, self.feed_forward(x_BTE))
        return DecoderLayerState(self_state, state.memory), x_BTE


def describe_state(state) -> str:
    """A state's kind in words, "KVCache(k_BSHD, v_BSHM, ...)" or "tuple of 2 states", for errors."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        fields = (
            f"{name}={type(value).__name__}"
            if isinstance(value, tuple) and hasattr(value, "_fields")
            else name
            for name, value in zip(state._fields, state)
        )
        return f"{type(state).__name__}({', '.join(fields)})"
    if isinstance(state, (tuple, list)):
        return f"a {type(state).__name__} of {len(state)} states"
    return type(state).__name__


def check_state_type(state, expected: type, where: str, made_by: str, *, batch: int | None = None):
    """Refuse a state that is not an `expected` (another model's), naming both; with `batch`,
    also one made for another batch (its `position` [B] says which)."""
    if not isinstance(state, expected):
        raise ValueError(
            f"{where}: the state must be a {expected.__name__} ({made_by}), got "
            f"{describe_state(state)}: pass the state this model's init_state, step or prefill "
            f"returned."
        )
    held = tuple(getattr(state.position, "shape", ()))
    if batch is not None and held != (batch,):
        raise ValueError(
            f"{where}: the state holds a batch of {held[0] if held else held} (its position has "
            f"shape {held}), the tokens a batch of {batch}: make it with {made_by}({batch})."
        )


_STATE_STRUCTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _self_attention_state(attention: MultiHeadAttention):
    """The shape of the state `attention.init_state` makes (no arrays allocated); traced once
    per layer, so an eager `step` does not pay for it each time."""
    if attention not in _STATE_STRUCTURES:
        try:
            _STATE_STRUCTURES[attention] = jax.eval_shape(lambda: attention.init_state(1, max_length=1))
        except ValueError:  # No recurrent form (or non-causal): the layer's own call says so.
            _STATE_STRUCTURES[attention] = None
    return _STATE_STRUCTURES[attention]


class _Stack(nnx.Module):
    def _final(self, x):
        return self.final_norm(x) if self.final_norm is not None else x

    def _check_state(self, state, method: str):
        """Another model's state (another kind, number of layers or model) would fail deep in
        an op, or be misread: name what this stack keeps and what was passed."""
        where = f"{type(self).__name__}.{method}"
        n = self.num_layers
        if isinstance(self.layers, DecoderLayer):
            if not isinstance(state, DecoderLayerState):
                raise ValueError(
                    f"{where}: the state must be the DecoderLayerState this stack's init_state "
                    f"returns (its {n} layers' states stacked), got {describe_state(state)}."
                )
            expected, got = _self_attention_state(self.layers.self_attention), state.self_attention
        else:
            expected, got = _self_attention_state(self.layers.attention), state
        if expected is None:  # No recurrent form (or non-causal): the layer's own call says so.
            return
        if jax.tree.structure(got) != jax.tree.structure(expected):
            raise ValueError(
                f"{where}: the state is {describe_state(got)}, but this model's layers keep "
                f"{describe_state(expected)}; pass the state this model's init_state, step or "
                f"prefill returned (another model's, or another attention kind's, does not fit)."
            )
        layers = {x.shape[0] if getattr(x, "ndim", 0) else None for x in jax.tree.leaves(state)}
        if layers != {n}:
            found = ", ".join(str(x) for x in sorted(layers, key=str))
            raise ValueError(
                f"{where}: the state must stack the states of this stack's {n} layers along a "
                f"leading axis (its init_state); its arrays lead with {found}."
            )

    def _step_layers(self, state, x, method: str, **kwargs):
        check_inference_mode(self)
        self._check_state(state, method)
        state, x = layer_stack.run_with_state(
            self.layers,
            state,
            x,
            lambda layer, state, x: getattr(layer, method)(state, x, **kwargs),
            unroll=self.unroll_layers,
        )
        return state, self._final(x)


class Encoder(_Stack):
    """A stack of `EncoderLayer`s; causal=True gives a decoder-only stack with a recurrent form.

    >>> config = TransformerConfig(num_layers=2, num_heads=4, model_dim=64, attention="linear")
    >>> encoder = Encoder(config, rngs=nnx.Rngs(0))
    >>> y_BTE = encoder(x_BTE, key_lengths=lengths_B)

    Causal stacks also run recurrently (after `encoder.eval()`): `init_state`, then `step` one
    token or `prefill` a block of tokens at a time. Streaming a long input through in segments
    gives the parallel pass over the whole of it (linear kinds keep a constant-size state;
    softmax needs a cache of `max_length` >= the total length):

    >>> state = encoder.init_state(batch, max_length=max_length)
    >>> for x_BTE in segments:                     # [B, T_i, E] pieces of one long input
    ...     state, y_BTE = encoder.prefill(state, x_BTE)
    """

    def __init__(self, config: TransformerConfig, *, causal: bool = False, rngs: nnx.Rngs):
        self.causal = causal
        self.num_layers, self.unroll_layers = config.num_layers, config.unroll_layers
        self.layers = layer_stack.stack(
            [EncoderLayer(config, causal=causal, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.final_norm = layer_norm(config, rngs) if config.final_normalization else None

    def __call__(self, x_BTE, *, key_lengths=None, mask=None, segment_ids=None, positions=None):
        """key_lengths int [B]: padding at the end; mask: boolean [T, S] or [B, H, T, S] (softmax
        only); segment_ids int [B, T]: packed sequences, each computed alone (0 = padding);
        positions int [B, T]: each token's position in its sequence, for kinds that use them."""
        x_BTE = layer_stack.run(
            self.layers,
            x_BTE,
            lambda layer, x: layer(
                x, key_lengths=key_lengths, mask=mask, segment_ids=segment_ids, positions=positions
            ),
            unroll=self.unroll_layers,
        )
        return self._final(x_BTE)

    @keyword_state_arguments
    def init_state(self, batch: int, *, max_length: int | None = None, dtype=None):
        """The layers' states stacked along a leading axis of L (causal stacks only). `dtype`:
        of KV caches; default the config's dtype (float32 when that is None); linear states are
        float32 at least."""
        check_inference_mode(self)
        return layer_stack.init(
            self.layers, lambda layer: layer.init_state(batch, max_length=max_length, dtype=dtype)
        )

    def step(self, state, x_BE):
        """One token through every layer; usable as a `lax.scan` body (see `generation`)."""
        return self._step_layers(state, x_BE, "step")

    def prefill(self, state, x_BTE, *, segment_ids=None, positions=None):
        """T tokens through every layer in parallel form, from `state` (from `init_state`, `step`
        or `prefill`): -> (state, y [B, T, E]). Equals T calls of `step`; causal stacks only.
        segment_ids: a packed block (its first segment continues the state, decoding continues
        its last)."""
        return self._step_layers(state, x_BTE, "prefill", segment_ids=segment_ids, positions=positions)


class Decoder(_Stack):
    """A stack of `DecoderLayer`s attending to an encoder's output.

    Parallel: decoder(x_BTE, memory_BSE, memory_lengths=...). Recurrent:
    state = decoder.init_state(batch, memory=memory_BSE, max_length=...); state, y_BE =
    decoder.step(state, x_BE), where the memory's keys/values are projected once in init_state;
    state, y_BTE = decoder.prefill(state, x_BTE) reads a block of target tokens at once (a forced
    prefix).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.num_layers, self.unroll_layers = config.num_layers, config.unroll_layers
        self.layers = layer_stack.stack([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
        self.final_norm = layer_norm(config, rngs) if config.final_normalization else None

    def __call__(
        self,
        x_BTE,
        memory_BSE,
        *,
        memory_lengths=None,
        target_lengths=None,
        segment_ids=None,
        memory_segment_ids=None,
        positions=None,
    ):
        """target_lengths int [B]: decoder positions at index >= target_lengths are padding that
        no valid position attends to (what matters where a kind's causal outputs depend on
        later positions, as LSH's buckets do). segment_ids int [B, T]: packed targets, each
        computed alone; with memory_segment_ids [B, S] (softmax cross-attention) each segment
        reads only the memory segment of the same id. positions: for kinds that use them."""
        x_BTE = layer_stack.run(
            self.layers,
            x_BTE,
            lambda layer, x: layer(
                x,
                memory_BSE,
                memory_lengths=memory_lengths,
                target_lengths=target_lengths,
                segment_ids=segment_ids,
                memory_segment_ids=memory_segment_ids,
                positions=positions,
            ),
            unroll=self.unroll_layers,
        )
        return self._final(x_BTE)

    @keyword_state_arguments
    def init_state(
        self, batch: int, *, memory, memory_lengths=None, max_length: int | None = None, dtype=None
    ):
        """The layers' states stacked along a leading axis of L; each layer projects the memory
        [B, S, E] (valid lengths `memory_lengths`) to its keys/values here, once."""
        check_inference_mode(self)
        _check_memory(memory, batch, "Decoder.init_state")
        return layer_stack.init(
            self.layers,
            lambda layer: layer.init_state(
                batch, memory=memory, memory_lengths=memory_lengths, max_length=max_length, dtype=dtype
            ),
        )

    def step(self, state, x_BE):
        """One decoder token through every layer -> (state, y_t [B, E])."""
        return self._step_layers(state, x_BE, "step")

    def prefill(self, state, x_BTE, *, segment_ids=None, positions=None):
        """T decoder tokens through every layer in parallel form, cross-attending to the memory
        kept in the state: -> (state, y [B, T, E]). Equals T calls of `step`."""
        return self._step_layers(state, x_BTE, "prefill", segment_ids=segment_ids, positions=positions)
