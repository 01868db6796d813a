"""The paper's autoregressive image model: sub-pixels scored by a discretized mixture of logistics.

Legend: B batch, T time (sub-pixels, row-major, channels interleaved), E model width,
P = 3K mixture parameters (see `mixture`), C classes (sub-pixel values 0..C-1).

The input at position t is the previous sub-pixel x_{t-1}; position 0 reads a START token (index C),
so the output at t predicts x_t from x_{<t} and every sub-pixel, the first included, is scored
(the authors fed x[:-1] and scored x[1:], so their first sub-pixel never was).

  params_BTP = model(x_BT)                       parallel (training, scoring)
  state = model.init_state(batch)                recurrent (after `model.eval()`)
  state, params_BP = model.step(state, token_B)  token_B: START at t = 0, then x_{t-1}
  state, params_BTP = model.prefill(state, tokens_BT)   T such tokens at once (= T steps)
  images_BT = sample_images(model, key, batch)   one compiled `lax.scan`, constant memory per step
  images_BT = sample_images(model, key, batch, prefix=x_BK)   the known prefix read by one
                                                 prefill, the rest drawn step by step
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_transformers.lm import LMState, embed_tokens, sinusoidal_encoding
from linear_transformers.mixture import mol_log_prob, mol_sample, num_params
from linear_transformers.transformer import (Encoder, TransformerConfig, check_inference_mode,
                                             dense, embedding)


class ImageGenerator(nnx.Module):
    """Sub-pixel embedding + sinusoidal positions, a causal `Encoder`, and a mixture head.

    The input vector is [embedding of x_{t-1} (model_dim // 2) | sine/cosine of t (the rest)], as
    in the paper; the head outputs 3 * num_mixtures mixture-of-logistics parameters per position.

    >>> config = TransformerConfig(num_layers=8, num_heads=8, model_dim=256, attention="linear")
    >>> model = ImageGenerator(config, num_classes=256, num_mixtures=10, max_length=784,
    ...                        rngs=nnx.Rngs(0))
    >>> loss = model.nll(x_BT)   # nats per sub-pixel; bits_per_dim(loss) for bits
    """

    def __init__(self, config: TransformerConfig, *, num_classes: int, num_mixtures: int,
                 max_length: int, rngs: nnx.Rngs):
        if num_classes < 2:
            raise ValueError(f"ImageGenerator: num_classes must be >= 2, got {num_classes}.")
        if num_mixtures < 1:
            raise ValueError(f"ImageGenerator: num_mixtures must be >= 1, got {num_mixtures}.")
        if max_length < 1:
            raise ValueError(f"ImageGenerator: max_length must be >= 1, got {max_length}.")
        embed_dim = config.model_dim // 2
        position_dim = config.model_dim - embed_dim
        if embed_dim < 1 or position_dim % 2:
            raise ValueError(
                f"ImageGenerator: model_dim={config.model_dim} splits into a {embed_dim}-wide "
                f"embedding and a {position_dim}-wide sinusoidal position encoding, which needs a "
                f"positive even width; use a model_dim that is a multiple of 4 (e.g. "
                f"{max(4, config.model_dim // 4 * 4)}).")
        self.num_classes = num_classes
        self.num_mixtures = num_mixtures
        self.max_length = max_length
        self.start_token = num_classes
        self.position_dim = position_dim
        self.embed = embedding(config, num_classes + 1, embed_dim, rngs)
        self.decoder = Encoder(config, causal=True, rngs=rngs)
        # float32 at least: mixture means a bin apart (2 / 255) would round together in bf16.
        self.head = dense(config, config.model_dim, num_params(num_mixtures), rngs,
                          dtype=config.output_dtype)

    def _inputs(self, tokens, positions):
        x = embed_tokens(self.embed, tokens)
        encoding = sinusoidal_encoding(positions, self.position_dim, x.dtype)
        return jnp.concatenate([x, jnp.broadcast_to(encoding, x.shape[:-1] + encoding.shape[-1:])],
                               axis=-1)

    def _check_images(self, x_BT, where: str):
        x_BT = jnp.asarray(x_BT)
        if x_BT.ndim != 2 or not 1 <= x_BT.shape[1] <= self.max_length:
            raise ValueError(f"ImageGenerator.{where}: expected [batch, length] sub-pixels with "
                             f"1 <= length <= max_length={self.max_length}, got shape "
                             f"{tuple(x_BT.shape)}.")
        if not jnp.issubdtype(x_BT.dtype, jnp.integer):
            raise ValueError(f"ImageGenerator.{where}: sub-pixels must be integers in "
                             f"[0, {self.num_classes}), got dtype {x_BT.dtype}.")
        # Out-of-range values would give a NaN likelihood (or embed another value). Traced
        # values (under jit) cannot be read here: the trainer checks its data when it loads it.
        if not isinstance(x_BT, jax.core.Tracer) and x_BT.size:
            low, high = int(jnp.min(x_BT)), int(jnp.max(x_BT))
            if low < 0 or high >= self.num_classes:
                raise ValueError(f"ImageGenerator.{where}: sub-pixels must be in "
                                 f"[0, {self.num_classes}), got values in [{low}, {high}].")
        return x_BT

    def shifted_inputs(self, x_BT):
        """The tokens the model reads: [START, x_0, ..., x_{T-2}] per row, [B, T] int32."""
        x_BT = self._check_images(x_BT, "shifted_inputs").astype(jnp.int32)
        start_B1 = jnp.full((x_BT.shape[0], 1), self.start_token, jnp.int32)
        return jnp.concatenate([start_B1, x_BT[:, :-1]], axis=1)

    def __call__(self, x_BT):
        """Mixture parameters params_BTP, where params at t is the distribution of x_t given x_{<t}."""
        inputs_BT = self.shifted_inputs(x_BT)
        x_BTE = self._inputs(inputs_BT, jnp.arange(inputs_BT.shape[1]))
        return self.head(self.decoder(x_BTE))

    def log_prob(self, x_BT):
        """Total log-likelihood in nats of each sequence: [B] float32."""
        x_BT = self._check_images(x_BT, "log_prob")
        return jnp.sum(mol_log_prob(self(x_BT), x_BT, self.num_classes), axis=1)

    def nll(self, x_BT):
        """Mean negative log-likelihood in nats per sub-pixel (scalar float32): the training loss."""
        x_BT = self._check_images(x_BT, "nll")
        return -jnp.mean(mol_log_prob(self(x_BT), x_BT, self.num_classes))

    def init_state(self, batch: int, dtype=None) -> LMState:
        """Empty recurrent state at position 0; softmax kinds allocate a max_length KV cache."""
        return LMState(self.decoder.init_state(batch, self.max_length, dtype),
                       jnp.zeros((), jnp.int32))

    def step(self, state: LMState, token_B):
        """Read this position's input token (START at t = 0, else x_{t-1}); return its params_BP.

        Steps past max_length are not checked (the position is traced); softmax caches overflow.
        """
        x_BE = self._inputs(jnp.asarray(token_B, jnp.int32), state.position)
        layers, y_BE = self.decoder.step(state.layers, x_BE)
        return LMState(layers, state.position + 1), self.head(y_BE)

    def prefill(self, state: LMState, tokens_BT):
        """Read T input tokens at once, as T calls of `step` would (START at position 0, else
        the previous sub-pixel): -> (state, params [B, T, P]), the distribution of the sub-pixel
        at each of these positions; the position advances by T.

        From `init_state`, `shifted_inputs(x_BT)[:, :k]` reads the first k positions of x.
        Positions past max_length are not checked (as in `step`).
        """
        tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
        T = tokens_BT.shape[1]
        x_BTE = self._inputs(tokens_BT, state.position + jnp.arange(T, dtype=jnp.int32))
        layers, y_BTE = self.decoder.prefill(state.layers, x_BTE)
        return LMState(layers, state.position + T), self.head(y_BTE)


def _check_sampling_args(model: ImageGenerator, batch: int, prefix, where: str):
    """Validate the prefix: -> prefix [B, k] int32 (k = 0 without one)."""
    if not isinstance(model, ImageGenerator):
        raise ValueError(f"{where}: model must be an ImageGenerator, got {type(model).__name__}.")
    if batch < 1:
        raise ValueError(f"{where}: batch must be >= 1, got {batch}.")
    # Before tracing, so the error names the fix rather than a dropout RNG.
    check_inference_mode(model)
    length = model.max_length
    if prefix is None:
        return jnp.zeros((batch, 0), jnp.int32)
    prefix = jnp.asarray(prefix)
    if (prefix.ndim != 2 or prefix.shape[0] != batch or prefix.shape[1] > length
            or not jnp.issubdtype(prefix.dtype, jnp.integer)):
        raise ValueError(f"{where}: prefix must be integer sub-pixels of shape [batch={batch}, k] "
                         f"with k <= max_length={length}, got {prefix.dtype} {tuple(prefix.shape)}.")
    if not isinstance(prefix, jax.core.Tracer) and prefix.size:
        low, high = int(np.min(prefix)), int(np.max(prefix))
        if low < 0 or high >= model.num_classes:
            raise ValueError(f"{where}: prefix values must be in [0, {model.num_classes}), got "
                             f"values in [{low}, {high}].")
    return prefix.astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3, 5))
def _sample_recurrent(graphdef, params, key, batch, prefix_BK, num_steps):
    model = nnx.merge(graphdef, params)
    L, k = model.max_length, prefix_BK.shape[1]
    if num_steps <= k:  # Every requested sub-pixel is given: nothing to draw.
        return jnp.pad(prefix_BK[:, :num_steps], ((0, 0), (0, L - num_steps)))
    # Step t reads input t: START, then x_0, ..., x_{k-1} for the known sub-pixels.
    start_B1 = jnp.full((batch, 1), model.start_token, jnp.int32)
    inputs_BK1 = jnp.concatenate([start_B1, prefix_BK], axis=1)
    state = model.init_state(batch)
    if k:
        # The steps whose draws the prefix overrides, in one parallel pass; step k reads
        # x_{k-1} in the scan below and draws x_k.
        state, _ = model.prefill(state, inputs_BK1[:, :k])
    # Step t's key is the same whatever the prefix: the draws match sample_images_full_recompute.
    keys = jax.random.split(key, L)[k:num_steps]

    def body(carry, key_t):
        state, token_B = carry
        state, params_BP = model.step(state, token_B)
        token_B = mol_sample(key_t, params_BP, model.num_classes)
        return (state, token_B), token_B

    _, drawn_TB = jax.lax.scan(body, (state, inputs_BK1[:, k]), keys)
    images_BT = jnp.concatenate([prefix_BK, drawn_TB.T], axis=1)
    return jnp.pad(images_BT, ((0, 0), (0, L - num_steps)))


def sample_images(model: ImageGenerator, key, batch: int, *, prefix=None, num_steps=None):
    """Sample [batch, max_length] int32 sub-pixels with the recurrent form, in one compiled call.

    `prefix` [batch, k] forces the first k sub-pixels (conditional completion, like the authors'
    demo): they are read in one parallel `prefill`, and the rest are drawn one `step` at a time
    in a `lax.scan`. The prefix length k is static: each k compiles once. Step t uses
    `jax.random.split(key, max_length)[t]` whatever k, so `sample_images_full_recompute` draws
    the same samples from the same key. `num_steps` stops after that many sub-pixels (the rest
    are 0): previews and benchmarks. The model must be in eval mode.
    """
    prefix_BK = _check_sampling_args(model, batch, prefix, "sample_images")
    num_steps = _check_num_steps(model, num_steps, "sample_images")
    graphdef, params = nnx.split(model)
    return _sample_recurrent(graphdef, params, key, batch, prefix_BK, num_steps)


def _check_num_steps(model: ImageGenerator, num_steps, where: str) -> int:
    if num_steps is None:
        return model.max_length
    if not isinstance(num_steps, int) or not 1 <= num_steps <= model.max_length:
        raise ValueError(f"{where}: num_steps must be an integer in [1, max_length="
                         f"{model.max_length}], got {num_steps!r}.")
    return num_steps


@functools.partial(jax.jit, static_argnums=(0, 3, 6))
def _sample_full_recompute(graphdef, params, key, batch, prefix_BT, prefix_length, num_steps):
    model = nnx.merge(graphdef, params)
    keys = jax.random.split(key, model.max_length)[:num_steps]

    def body(images_BT, inputs):
        t, key_t = inputs
        # Causality makes the not-yet-drawn tail of the buffer irrelevant to position t.
        params_BP = jax.lax.dynamic_index_in_dim(model(images_BT), t, axis=1, keepdims=False)
        drawn_B = mol_sample(key_t, params_BP, model.num_classes)
        token_B = jnp.where(t < prefix_length, prefix_BT[:, t], drawn_B)
        return images_BT.at[:, t].set(token_B), None

    images_BT = jnp.zeros((batch, model.max_length), jnp.int32)
    images_BT, _ = jax.lax.scan(body, images_BT, (jnp.arange(num_steps), keys))
    return images_BT


def sample_images_full_recompute(model: ImageGenerator, key, batch: int, *, prefix=None,
                                 num_steps=None):
    """`sample_images` by the paper's slow baseline: the full parallel forward at every step.

    max_length parallel forwards per image (O(T^2) work with linear attention, O(T^3) with
    softmax); the same draws as `sample_images` for the same key, so the two return the same
    images unless a draw lands within rounding error of a bin edge. Every step runs the model
    over the whole max_length buffer, so each costs the same. `num_steps` as in `sample_images`.
    """
    prefix_BK = _check_sampling_args(model, batch, prefix, "sample_images_full_recompute")
    num_steps = _check_num_steps(model, num_steps, "sample_images_full_recompute")
    # Padded to max_length with the length traced: one compilation serves every prefix length.
    k = prefix_BK.shape[1]
    prefix_BT = jnp.pad(prefix_BK, ((0, 0), (0, model.max_length - k)))
    prefix_length = jnp.int32(k)
    graphdef, params = nnx.split(model)
    return _sample_full_recompute(graphdef, params, key, batch, prefix_BT, prefix_length,
                                  num_steps)
