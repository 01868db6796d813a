"""A decoder-only transformer over tokens with a recurrent form for generation.

Legend: B batch, T time, E model width, V vocabulary.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers.transformer import Encoder, TransformerConfig


def sinusoidal_encoding(positions, dim: int, dtype=jnp.float32):
    """Transformer sine/cosine position encoding: positions [...] -> [..., dim]."""
    if dim % 2:
        raise ValueError(f"sinusoidal_encoding needs an even dim, got {dim}.")
    inv_freq = jnp.exp(-jnp.log(10000.0) * jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1).astype(dtype)


class LMState(NamedTuple):
    layers: Any          # per-layer attention states (linear (S, z) or KV caches)
    position: jax.Array  # int32 scalar: index of the next token


class CausalLM(nnx.Module):
    """Token embedding plus sinusoidal positions, a causal `Encoder` stack, and logits.

    Parallel: logits_BTV = model(tokens_BT). Recurrent (after `model.eval()`):
    state = model.init_state(batch, max_length); state, logits_BV = model.step(state, token_B).
    """

    def __init__(self, config: TransformerConfig, vocab_size: int, *, rngs: nnx.Rngs):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
        self.model_dim = config.model_dim
        self.embed = nnx.Embed(vocab_size, config.model_dim, rngs=rngs)
        self.decoder = Encoder(config, causal=True, rngs=rngs)
        self.head = nnx.Linear(config.model_dim, vocab_size, rngs=rngs)

    def _inputs(self, tokens, positions):
        return self.embed(tokens) + sinusoidal_encoding(positions, self.model_dim)

    def __call__(self, tokens_BT, *, key_lengths=None):
        x_BTE = self._inputs(tokens_BT, jnp.arange(tokens_BT.shape[1]))
        return self.head(self.decoder(x_BTE, key_lengths=key_lengths))

    def init_state(self, batch: int, max_length: int | None = None, dtype=jnp.float32) -> LMState:
        """Empty state; softmax kinds allocate a KV cache of `max_length` steps."""
        return LMState(self.decoder.init_state(batch, max_length, dtype),
                       jnp.zeros((), jnp.int32))

    def step(self, state: LMState, token_B):
        """Consume one token per batch element; return the logits for the next one."""
        x_BE = self._inputs(token_B, state.position)
        layers, y_BE = self.decoder.step(state.layers, x_BE)
        return LMState(layers, state.position + 1), self.head(y_BE)
