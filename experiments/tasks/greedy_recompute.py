"""Greedy decoding by re-running the parallel model on the generated prefix at every step.

Slow (one full forward per generated token) but exact for any causal model, including those
with no recurrent form. It matters where a model's causal outputs depend on later positions:
causal LSH (Reformer) attention sorts every position by its hash, so the keys that share a
query's chunk depend on the queries after it, and teacher-forced accuracy is then not the
accuracy of greedy decoding. Each step masks the positions after the prefix as padding
(`key_lengths` / `target_lengths`), which LSH places in a bucket of their own, so the step sees
exactly the sequence generated so far.

Legend: B batch, T time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def _greedy_scan(logits_at, tokens_BT, generated_BT):
    """Predictions [B, T]: step t reads tokens[:, :t+1] (earlier generated positions holding
    the model's own predictions) and predicts token t+1; where generated_BT[:, t] is set, the
    prediction becomes the input at t+1 (elsewhere the given token stays: a prompt)."""
    B, T = tokens_BT.shape

    def body(buffer_BT, t):
        predicted_B = jnp.argmax(logits_at(buffer_BT, t, jnp.full((B,), t + 1, jnp.int32)), axis=-1).astype(
            buffer_BT.dtype
        )
        nxt = jnp.minimum(t + 1, T - 1)
        write_B = generated_BT[:, t] & (t + 1 < T)
        buffer_BT = buffer_BT.at[:, nxt].set(jnp.where(write_B, predicted_B, buffer_BT[:, nxt]))
        return buffer_BT, predicted_B

    _, predicted_TB = jax.lax.scan(body, tokens_BT, jnp.arange(T))
    return predicted_TB.T


@functools.partial(jax.jit, static_argnums=0)
def _decoder_only(graphdef, state, inputs_BT, generated_BT):
    model = nnx.merge(graphdef, state)

    def logits_at(buffer_BT, t, lengths_B):
        return jax.lax.dynamic_index_in_dim(model(buffer_BT, key_lengths=lengths_B), t, 1, False)

    return _greedy_scan(logits_at, inputs_BT, generated_BT)


def decoder_only(model, inputs_BT, generated_BT):
    """Greedy predictions [B, T] of a decoder-only model (`CausalLM`) in eval mode: at each
    position t, the argmax after inputs[:, :t+1], where the inputs after a generated position
    (generated_BT[:, t] True: the model wrote the next token) are its own predictions."""
    graphdef, state = nnx.split(model)
    return _decoder_only(graphdef, state, jnp.asarray(inputs_BT), jnp.asarray(generated_BT, bool))


@functools.partial(jax.jit, static_argnums=0)
def _encoder_decoder(graphdef, state, source_BS, source_lengths_B, target_in_BT, generated_BT):
    model = nnx.merge(graphdef, state)
    memory_BSE = model.encode(source_BS, source_lengths=source_lengths_B)

    def logits_at(buffer_BT, t, lengths_B):
        logits_BTV = model.decode(
            buffer_BT, memory_BSE, memory_lengths=source_lengths_B, target_lengths=lengths_B
        )
        return jax.lax.dynamic_index_in_dim(logits_BTV, t, 1, False)

    return _greedy_scan(logits_at, target_in_BT, generated_BT)


def encoder_decoder(model, source_BS, source_lengths_B, target_in_BT, generated_BT):
    """Greedy predictions [B, T] of an `EncoderDecoder` in eval mode: the source encoded once,
    then the parallel decoder re-run on the target prefix at each position (target_in_BT gives
    the start token; generated_BT as in `decoder_only`)."""
    graphdef, state = nnx.split(model)
    return _encoder_decoder(
        graphdef,
        state,
        jnp.asarray(source_BS),
        jnp.asarray(source_lengths_B),
        jnp.asarray(target_in_BT),
        jnp.asarray(generated_BT, bool),
    )
