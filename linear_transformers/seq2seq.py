"""An encoder-decoder transformer over tokens, with recurrent greedy decoding.

Legend: B batch, S source time, T target time, E model width, V vocabulary.

  logits_BTV = model(source_BS, target_in_BT, source_lengths=lengths_B)   parallel (training)
  tokens_BT = greedy_decode(model, source_BS, T, start_token=0)          one compiled loop
  tokens_BT = greedy_decode(model, source_BS, T, start_token=0, prefix=prefix_BT)
                                                 a forced target prefix, read by one prefill

Recurrently (after `model.eval()`): memory_BSE = model.encode(source_BS, source_lengths=...);
state = model.init_state(batch, memory=memory_BSE, memory_lengths=source_lengths, max_length=...);
state, logits_BV = model.step(state, token_B) for one target token, or state, logits_BTV =
model.prefill(state, tokens_BT) for T of them at once (equal to T steps).

`source_lengths` are the valid lengths of the source tokens; once encoded, the same lengths are
the `memory_lengths` of the memory, the name every decoder takes them by.

Decoding encodes the source once; each decoder layer then reduces the memory once to what its
cross-attention needs per step (softmax: the projected keys/values; linear: one (S, z) summary;
linformer: J projected rows), and the decoder's self-attention runs as an RNN.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers.attention.base import keyword_state_arguments
from linear_transformers.finite import check_finite_outputs, check_finite_parameters
from linear_transformers.lm import check_token_ids, token_inputs
from linear_transformers.ops import input_checks
from linear_transformers.transformer import (
    Decoder,
    Encoder,
    TransformerConfig,
    check_state_type,
    dense,
    embedding,
)


class Seq2SeqState(NamedTuple):
    layers: Any  # the decoder layers' (self-attention state, cross-attention memory), stacked [L, ...]
    position: jax.Array  # int32 [B]: the position of each row's next target token


def _lengths(lengths_B, shape_BT, name: str, where: str):
    """Lengths int [B] of tokens [B, T], in [0, T] where concrete; a ValueError names them."""
    if lengths_B is None:
        return None
    B, T = shape_BT
    return input_checks.check_lengths(lengths_B, B, T, name=name, what="tokens", where=where)


class EncoderDecoder(nnx.Module):
    """Shared token embedding plus sinusoidal positions, an `Encoder`, a `Decoder`, logits.

    The encoder and decoder configs may use different attention kinds (e.g. a linformer encoder
    and a linear decoder) but must share `model_dim`.
    """

    def __init__(
        self,
        encoder_config: TransformerConfig,
        decoder_config: TransformerConfig,
        vocab_size: int,
        *,
        rngs: nnx.Rngs,
    ):
        if encoder_config.model_dim != decoder_config.model_dim:
            raise ValueError(
                f"EncoderDecoder: encoder model_dim {encoder_config.model_dim} and "
                f"decoder model_dim {decoder_config.model_dim} must be equal."
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
        self.model_dim = encoder_config.model_dim
        self.embed = embedding(encoder_config, vocab_size, self.model_dim, rngs)
        self.encoder = Encoder(encoder_config, causal=False, rngs=rngs)
        self.decoder = Decoder(decoder_config, rngs=rngs)
        self.head = dense(decoder_config, self.model_dim, vocab_size, rngs, dtype=decoder_config.output_dtype)

    def encode(self, source_BS, *, source_lengths=None):
        """The memory [B, S, E]; source tokens at index >= source_lengths are padding."""
        source_BS = check_token_ids(
            source_BS, self.embed.num_embeddings, "EncoderDecoder.encode", "source tokens"
        )
        source_lengths = _lengths(source_lengths, source_BS.shape, "source_lengths", "EncoderDecoder.encode")
        x_BSE = token_inputs(self.embed, source_BS, jnp.arange(source_BS.shape[1]))
        return self.encoder(x_BSE, key_lengths=source_lengths)

    def decode(self, target_in_BT, memory_BSE, *, memory_lengths=None, target_lengths=None):
        """Teacher-forced decoder: logits [B, T, V] for the token after each input token;
        memory positions at index >= memory_lengths and target tokens at index >=
        target_lengths are padding."""
        target_in_BT = check_token_ids(
            target_in_BT, self.embed.num_embeddings, "EncoderDecoder.decode", "target tokens"
        )
        where = "EncoderDecoder.decode"
        target_lengths = _lengths(target_lengths, target_in_BT.shape, "target_lengths", where)
        memory_lengths = _lengths(memory_lengths, jnp.shape(memory_BSE)[:2], "memory_lengths", where)
        y_BTE = token_inputs(self.embed, target_in_BT, jnp.arange(target_in_BT.shape[1]))
        return self.head(
            self.decoder(y_BTE, memory_BSE, memory_lengths=memory_lengths, target_lengths=target_lengths)
        )

    def __call__(self, source_BS, target_in_BT, *, source_lengths=None, target_lengths=None):
        memory_BSE = self.encode(source_BS, source_lengths=source_lengths)
        return self.decode(
            target_in_BT, memory_BSE, memory_lengths=source_lengths, target_lengths=target_lengths
        )

    @keyword_state_arguments
    def init_state(
        self, batch: int, *, memory, memory_lengths=None, max_length: int | None = None, dtype=None
    ) -> Seq2SeqState:
        """Decoder state over an encoded memory [B, S, E] (`encode`) whose valid lengths are
        `memory_lengths` (the source lengths); call `model.eval()` first."""
        layers = self.decoder.init_state(
            batch, memory=memory, memory_lengths=memory_lengths, max_length=max_length, dtype=dtype
        )
        return Seq2SeqState(layers, jnp.zeros((batch,), jnp.int32))

    def step(self, state: Seq2SeqState, token_B):
        """Consume one target token per batch element; return the logits for the next one."""
        token_B = check_token_ids(token_B, self.embed.num_embeddings, "EncoderDecoder.step")
        check_state_type(
            state, Seq2SeqState, "EncoderDecoder.step", "EncoderDecoder.init_state", batch=token_B.shape[0]
        )
        x_BE = token_inputs(self.embed, token_B, state.position)
        layers, y_BE = self.decoder.step(state.layers, x_BE)
        return Seq2SeqState(layers, state.position + 1), self.head(y_BE)

    def prefill(self, state: Seq2SeqState, tokens_BT):
        """Consume T target tokens per batch element at once, from `state`: -> (state, logits
        [B, T, V]), where logits at t score the token after tokens_BT[:, t]. Equal to T calls of
        `step`; the position advances by T."""
        tokens_BT = check_token_ids(tokens_BT, self.embed.num_embeddings, "EncoderDecoder.prefill")
        check_state_type(
            state,
            Seq2SeqState,
            "EncoderDecoder.prefill",
            "EncoderDecoder.init_state",
            batch=tokens_BT.shape[0],
        )
        T = tokens_BT.shape[1]
        x_BTE = token_inputs(self.embed, tokens_BT, state.position[:, None] + jnp.arange(T, dtype=jnp.int32))
        layers, y_BTE = self.decoder.prefill(state.layers, x_BTE)
        return Seq2SeqState(layers, state.position + T), self.head(y_BTE)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _greedy_decode(graphdef, params, source_BS, num_steps, start_token, source_lengths, prefix_BT):
    model = nnx.merge(graphdef, params)
    memory_BSE = model.encode(source_BS, source_lengths=source_lengths)
    k = prefix_BT.shape[1]
    # The decoder reads start, the k prefix tokens, then num_steps - 1 decoded ones.
    state = model.init_state(
        source_BS.shape[0], memory=memory_BSE, memory_lengths=source_lengths, max_length=k + num_steps
    )
    start_B1 = jnp.full(source_BS.shape[:1] + (1,), start_token, source_BS.dtype)
    inputs_BT = jnp.concatenate([start_B1, prefix_BT], axis=1)  # k + 1 tokens
    if k:
        # All but the last known token in one parallel pass; the loop reads the last one.
        state, _ = model.prefill(state, inputs_BT[:, :k])

    def body(carry, _):
        state, token_B, finite_B = carry
        state, logits_BV = model.step(state, token_B)
        token_B = jnp.argmax(logits_BV, axis=-1).astype(source_BS.dtype)
        # argmax returns id 0 for NaN logits: remember that they were not finite.
        finite_B = finite_B & jnp.all(jnp.isfinite(logits_BV), axis=-1)
        return (state, token_B, finite_B), token_B

    carry = (state, inputs_BT[:, k], jnp.ones(source_BS.shape[:1], bool))
    (_, _, finite_B), tokens_TB = jax.lax.scan(body, carry, length=num_steps)
    return tokens_TB.T, finite_B


def greedy_decode(
    model: EncoderDecoder, source_BS, num_steps: int, *, start_token: int, source_lengths=None, prefix=None
):
    """Decode `num_steps` tokens greedily after `start_token`: [B, num_steps] tokens.

    `prefix` [B, k] forces the first k target tokens after `start_token` (e.g. a known start of
    the answer): they are read in one parallel `prefill`, and the `num_steps` tokens returned
    are the ones decoded after them (the prefix itself is not repeated). Each k compiles once.

    Encoding, the memory reduction, the prefill and every decoding step run in one compiled
    function; the decoder's self-attention must have a recurrent form (softmax, linear) and the
    model must be in eval mode. Parameters or logits holding NaN or inf are a FloatingPointError
    (inside `jit` the parameters cannot be read: only the logits are).
    """
    source_BS = jnp.asarray(source_BS)
    if source_BS.ndim != 2:
        raise ValueError(
            f"greedy_decode: source must be [batch, length] tokens, got shape {tuple(source_BS.shape)}."
        )
    if num_steps < 1:
        raise ValueError(f"greedy_decode: num_steps must be >= 1, got {num_steps}.")
    batch = source_BS.shape[0]
    if prefix is None:
        prefix_BT = jnp.zeros((batch, 0), source_BS.dtype)
    else:
        prefix_BT = jnp.asarray(prefix)
        if (
            prefix_BT.ndim != 2
            or prefix_BT.shape[0] != batch
            or not jnp.issubdtype(prefix_BT.dtype, jnp.integer)
        ):
            raise ValueError(
                f"greedy_decode: prefix must be integer tokens of shape "
                f"[batch={batch}, K], got {prefix_BT.dtype} "
                f"{tuple(prefix_BT.shape)}."
            )
        prefix_BT = prefix_BT.astype(source_BS.dtype)
    vocab_size = model.embed.num_embeddings
    check_token_ids(source_BS, vocab_size, "greedy_decode", "source tokens")
    check_token_ids(prefix_BT, vocab_size, "greedy_decode", "prefix tokens")
    check_token_ids(jnp.asarray([start_token]), vocab_size, "greedy_decode", "start_token")
    check_finite_parameters(model, "greedy_decode")
    graphdef, params = nnx.split(model)
    tokens_BT, finite_B = _greedy_decode(
        graphdef,
        params,
        source_BS,
        num_steps,
        int(start_token),
        None if source_lengths is None else jnp.asarray(source_lengths),
        prefix_BT,
    )
    check_finite_outputs(finite_B, "greedy_decode")
    return tokens_BT
