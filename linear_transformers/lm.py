"""A decoder-only transformer over tokens with a recurrent form for generation.

Legend: B batch, T time, E model width, V vocabulary.

  logits_BTV = model(tokens_BT)                         parallel (training, scoring)
  logits_BTV = model(tokens_BT, segment_ids=ids_BT)     packed sequences (`pack_sequences`)
  state = model.init_state(batch, max_length=...)       recurrent (after `model.eval()`)
  state, logits_BTV = model.prefill(state, tokens_BT)   a prompt (or segment) in one pass
  state, logits_BV = model.step(state, token_B)         then one token at a time
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from linear_transformers.attention.base import keyword_state_arguments
from linear_transformers.ops import input_checks
from linear_transformers.packing import continue_positions, next_positions, segment_positions
from linear_transformers.transformer import Encoder, TransformerConfig, check_state_type, dense, embedding


def check_token_ids(tokens, vocab_size: int, where: str, what: str = "tokens"):
    """`tokens` as an integer array, or a ValueError naming `where`: ids must be integers in
    [0, vocab_size) -- one outside would embed a row of NaN (or another token) silently. The
    values are read where they are concrete (eager calls); traced ones (under `jit`, a
    `lax.scan`) cannot be, at no cost."""
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"{where}: {what} must be integer ids in [0, {vocab_size}), got dtype {tokens.dtype}."
        )
    if not isinstance(tokens, jax.core.Tracer) and tokens.size:
        low, high = int(jnp.min(tokens)), int(jnp.max(tokens))
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{where}: {what} must be ids in [0, {vocab_size}) (the vocabulary), got values in "
                f"[{low}, {high}]."
            )
    return tokens


def embed_tokens(embed: nnx.Embed, tokens):
    """`embed(tokens)`; under a mesh with explicit axis types, the embeddings keep the tokens'
    sharding (features replicated), which the lookup cannot infer by itself."""
    spec = getattr(getattr(jax.typeof(tokens), "sharding", None), "spec", None)
    if spec is None or all(axis is None for axis in spec):
        return embed(tokens)
    return embed(tokens, out_sharding=PartitionSpec(*spec, None))


def check_sequence_inputs(where: str, shape_BT, segment_ids, positions):
    """(segment_ids, positions) checked against the tokens' [B, T]: segment ids int [B, T]
    (`input_checks.check_segment_ids`), positions int [B, T] or [T]; a ValueError names the
    argument and both shapes."""
    segment_ids = input_checks.check_segment_ids(segment_ids, shape_BT, name=where)
    if positions is not None:
        positions = jnp.asarray(positions)
        if tuple(positions.shape) not in (tuple(shape_BT), tuple(shape_BT[1:])) or not jnp.issubdtype(
            positions.dtype, jnp.integer
        ):
            raise ValueError(
                f"{where}: positions must be an integer array of shape {tuple(shape_BT)} or "
                f"{tuple(shape_BT[1:])} (each token's position in its sequence), as the tokens "
                f"{tuple(shape_BT)}; got {positions.dtype} array of shape {tuple(positions.shape)}."
            )
    return segment_ids, positions


def token_inputs(embed: nnx.Embed, tokens, positions):
    """Token embeddings plus the sine/cosine encoding of `positions`, in the embeddings' dtype
    (a float32 encoding would promote a bf16 model back to float32)."""
    x = embed_tokens(embed, tokens)
    return x + sinusoidal_encoding(positions, x.shape[-1], x.dtype)


POSITION_LAYOUTS = ("concatenated", "interleaved")


def sinusoidal_encoding(positions, dim: int, dtype=jnp.float32, *, layout: str = "concatenated"):
    """Transformer sine/cosine position encoding: positions [...] -> [..., dim].

    The angles are position * 10000^(-2i / dim), i = 0 .. dim/2 - 1. `layout` orders the features:
    "concatenated" is [sin(angles) | cos(angles)]; "interleaved" is sin, cos, sin, cos, ... as
    pytorch-fast-transformers' colabs build it (pe[:, 0::2] = sin, pe[:, 1::2] = cos).
    """
    if layout not in POSITION_LAYOUTS:
        raise ValueError(f"sinusoidal_encoding: layout must be one of {POSITION_LAYOUTS}, got {layout!r}.")
    if dim % 2:
        raise ValueError(f"sinusoidal_encoding needs an even dim, got {dim}.")
    inv_freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    if layout == "interleaved":
        encoding = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
        return encoding.reshape(angles.shape[:-1] + (dim,)).astype(dtype)
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1).astype(dtype)


class LMState(NamedTuple):
    layers: Any  # the stack's attention states (linear (s, z) or KV caches), stacked [L, ...]
    position: jax.Array  # int32 [B]: the position of each row's next token


class CausalLM(nnx.Module):
    """Token embedding plus sinusoidal positions, a causal `Encoder` stack, and logits.

    Parallel: logits_BTV = model(tokens_BT). Recurrent (after `model.eval()`):
    state = model.init_state(batch, max_length=...); state, logits_BV = model.step(state, token_B);
    state, logits_BTV = model.prefill(state, tokens_BT) reads T tokens at once (equal to T
    `step`s), e.g. a prompt before generating (`generation.generate` does so).

    Streaming: a sequence too long for one parallel pass goes through in segments, the state
    carried between them, with the logits of the one pass over the whole of it (positions
    continue across segments; linear kinds keep a constant-size state, softmax needs
    `max_length` >= the total length):

    >>> state = model.init_state(batch, max_length=max_length)
    >>> for tokens_BT in segments:                  # consecutive [B, T_i] pieces
    ...     state, logits_BTV = model.prefill(state, tokens_BT)
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, *, rngs: nnx.Rngs):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
        self.model_dim = config.model_dim
        self.embed = embedding(config, vocab_size, config.model_dim, rngs)
        self.transformer = Encoder(config, causal=True, rngs=rngs)
        self.head = dense(config, config.model_dim, vocab_size, rngs, dtype=config.output_dtype)

    def __call__(self, tokens_BT, *, key_lengths=None, segment_ids=None, positions=None):
        """Logits [B, T, V]. segment_ids int [B, T]: packed sequences (0 = padding), each scored
        as if alone; positions int [B, T]: each token's position in its sequence (default:
        restarting at every segment, else 0..T-1)."""
        tokens_BT = check_token_ids(tokens_BT, self.embed.num_embeddings, "CausalLM")
        segment_ids, positions = check_sequence_inputs("CausalLM", tokens_BT.shape, segment_ids, positions)
        B, T = tokens_BT.shape
        key_lengths = input_checks.check_key_lengths(key_lengths, B, name="CausalLM", length=T)
        if positions is None:
            positions = (
                jnp.arange(tokens_BT.shape[1]) if segment_ids is None else segment_positions(segment_ids)
            )
        x_BTE = token_inputs(self.embed, tokens_BT, positions)
        return self.head(
            self.transformer(x_BTE, key_lengths=key_lengths, segment_ids=segment_ids, positions=positions)
        )

    @keyword_state_arguments
    def init_state(self, batch: int, *, max_length: int | None = None, dtype=None) -> LMState:
        """Empty state; softmax kinds allocate a KV cache of `max_length` steps (in `dtype`,
        default the config's)."""
        return LMState(
            self.transformer.init_state(batch, max_length=max_length, dtype=dtype),
            jnp.zeros((batch,), jnp.int32),
        )

    def step(self, state: LMState, token_B):
        """Consume one token per batch element; return the logits for the next one."""
        token_B = check_token_ids(token_B, self.embed.num_embeddings, "CausalLM.step")
        check_state_type(state, LMState, "CausalLM.step", "CausalLM.init_state", batch=token_B.shape[0])
        x_BE = token_inputs(self.embed, token_B, state.position)
        layers, y_BE = self.transformer.step(state.layers, x_BE)
        return LMState(layers, state.position + 1), self.head(y_BE)

    def prefill(self, state: LMState, tokens_BT, *, segment_ids=None, positions=None):
        """Consume T tokens per batch element at once, from `state`: -> (state, logits [B, T, V]),
        where logits at t score the token after tokens_BT[:, t]. Equal to T calls of `step`;
        the position advances by T.

        segment_ids int [B, T]: a packed prompt (0 = padding), whose first segment continues the
        state and whose later segments start afresh (positions from 0); `step` then continues
        each row's last segment."""
        tokens_BT = check_token_ids(tokens_BT, self.embed.num_embeddings, "CausalLM.prefill")
        check_state_type(state, LMState, "CausalLM.prefill", "CausalLM.init_state", batch=tokens_BT.shape[0])
        segment_ids, positions = check_sequence_inputs(
            "CausalLM.prefill", tokens_BT.shape, segment_ids, positions
        )
        if positions is None:
            positions = continue_positions(state.position, segment_ids, tokens_BT.shape[1])
        x_BTE = token_inputs(self.embed, tokens_BT, positions)
        layers, y_BTE = self.transformer.prefill(
            state.layers, x_BTE, segment_ids=segment_ids, positions=positions
        )
        return LMState(layers, next_positions(positions, segment_ids, state.position)), self.head(y_BTE)
