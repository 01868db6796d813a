"""The paper's autoregressive image model: sub-pixels scored by a discretized mixture of logistics.

Legend: B batch, T time (sub-pixels, row-major, channels interleaved), E model width,
K mixture components, Q = 3K mixture parameters (see `mixture`), V classes (sub-pixel values
0..V-1).

Two input conventions, chosen by `start_token` (f = `model.first_scored` below):

- start_token=True (f = 0): position 0 reads a START token (index V) and position t > 0 the
  previous sub-pixel x_{t-1}, so the output at t predicts x_t from x_{<t} and every sub-pixel,
  the first included, is scored.
- start_token=False (f = 1), the convention of pytorch-fast-transformers' MNIST demo: no START
  token; position t reads x_t and predicts x_{t+1} (the authors fed x[:-1] and scored x[1:]).
  The first sub-pixel is only read, never scored, so sampling needs a prefix of at least one.

The position encoding is [sin | cos] ("concatenated", the default) or sin, cos, sin, ...
("interleaved", the authors' colab): `position_layout`.

  params_BTQ = model(x_BT)                       parallel: [B, T - f, Q], params[:, i] for x_{i+f}
  state = model.init_state(batch)                recurrent (after `model.eval()`; a KV cache of
                                                 max_length slots for softmax kinds)
  state, params_BQ = model.step(state, token_B)  reads the input of the next position (see above)
  state, params_BTQ = model.prefill(state, tokens_BT)   T such tokens at once (= T steps)
  images_BT = sample_images(model, key, batch)   one compiled `lax.scan`, constant memory per step
  images_BT = sample_images(model, key, batch, prefix=x_BT[:, :k])   the known first k read by
                                                 one prefill, the rest drawn step by step
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_transformers.attention.base import check_inference_mode, keyword_state_arguments
from linear_transformers.finite import check_finite_parameters
from linear_transformers.lm import (
    POSITION_LAYOUTS,
    LMState,
    check_token_ids,
    embed_tokens,
    sinusoidal_encoding,
)
from linear_transformers.mixture import mol_log_prob, mol_sample, num_params
from linear_transformers.transformer import Encoder, TransformerConfig, check_state_type, dense, embedding


class ImageGenerator(nnx.Module):
    """Sub-pixel embedding + sinusoidal positions, a causal `Encoder`, and a mixture head.

    The input vector at position t is [embedding of the token read at t (model_dim // 2) |
    sine/cosine of t (the rest)], as in the paper; the head outputs 3 * num_mixtures
    mixture-of-logistics parameters per position.

    `start_token=True`: the token read at t is START (index num_classes, an extra embedding row)
    at t = 0, else x_{t-1}; the output at t is the distribution of x_t, every sub-pixel scored
    (`first_scored` = 0). `start_token=False` (pytorch-fast-transformers' MNIST demo): the
    embedding has num_classes rows, the token read at t is x_t and the output at t is the
    distribution of x_{t+1}; x_0 is never scored (`first_scored` = 1), so at most max_length - 1
    positions are read. `position_layout` orders the encoding's features: "concatenated"
    [sin | cos] or "interleaved" (sin, cos, ...; the authors' colab). max_length is the number of
    sub-pixels per image in both conventions.

    >>> config = TransformerConfig(num_layers=8, num_heads=8, model_dim=256, attention="linear")
    >>> model = ImageGenerator(config, num_classes=256, num_mixtures=10, max_length=784,
    ...                        rngs=nnx.Rngs(0))
    >>> loss = model.nll(x_BT)   # nats per sub-pixel; bits_per_dim(loss) for bits
    >>> authors = ImageGenerator(config, num_classes=256, num_mixtures=10, max_length=784,
    ...                          start_token=False, position_layout="interleaved", rngs=nnx.Rngs(0))
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        num_classes: int,
        num_mixtures: int,
        max_length: int,
        rngs: nnx.Rngs,
        position_layout: str = "concatenated",
        start_token: bool = True,
    ):
        if num_classes < 2:
            raise ValueError(f"ImageGenerator: num_classes must be >= 2, got {num_classes}.")
        if num_mixtures < 1:
            raise ValueError(f"ImageGenerator: num_mixtures must be >= 1, got {num_mixtures}.")
        if max_length < 1:
            raise ValueError(f"ImageGenerator: max_length must be >= 1, got {max_length}.")
        if position_layout not in POSITION_LAYOUTS:
            raise ValueError(
                f"ImageGenerator: position_layout must be one of {POSITION_LAYOUTS}, got {position_layout!r}."
            )
        if not isinstance(start_token, bool):
            raise ValueError(f"ImageGenerator: start_token must be True or False, got {start_token!r}.")
        if not start_token and max_length < 2:
            raise ValueError(
                f"ImageGenerator: without a start token the first sub-pixel is only "
                f"read, so max_length must be >= 2, got {max_length}."
            )
        embed_dim = config.model_dim // 2
        position_dim = config.model_dim - embed_dim
        if embed_dim < 1 or position_dim % 2:
            raise ValueError(
                f"ImageGenerator: model_dim={config.model_dim} splits into a {embed_dim}-wide "
                f"embedding and a {position_dim}-wide sinusoidal position encoding, which needs a "
                f"positive even width; use a model_dim that is a multiple of 4 (e.g. "
                f"{max(4, config.model_dim // 4 * 4)})."
            )
        self.num_classes = num_classes
        self.num_mixtures = num_mixtures
        self.max_length = max_length
        # START's index (an extra embedding row), or None: position t then reads x_t.
        self.start_token = num_classes if start_token else None
        # The first sub-pixel scored: params[:, i] are those of x_{i + first_scored}.
        self.first_scored = 0 if start_token else 1
        self.position_layout = position_layout
        self.position_dim = position_dim
        vocab = num_classes + 1 if start_token else num_classes
        self.embed = embedding(config, vocab, embed_dim, rngs)
        self.transformer = Encoder(config, causal=True, rngs=rngs)
        # float32 at least: mixture means a bin apart (2 / 255) would round together in bf16.
        self.head = dense(config, config.model_dim, num_params(num_mixtures), rngs, dtype=config.output_dtype)

    def transformer_inputs(self, tokens, positions):
        """The causal stack's input at `positions`: the tokens' embedding ++ their sinusoidal
        position encoding."""
        x = embed_tokens(self.embed, tokens)
        encoding = sinusoidal_encoding(positions, self.position_dim, x.dtype, layout=self.position_layout)
        return jnp.concatenate([x, jnp.broadcast_to(encoding, x.shape[:-1] + encoding.shape[-1:])], axis=-1)

    def _check_images(self, x_BT, where: str):
        x_BT = jnp.asarray(x_BT)
        shortest = 1 + self.first_scored
        if x_BT.ndim != 2 or not shortest <= x_BT.shape[1] <= self.max_length:
            why = (
                " (without a start token the first sub-pixel is only read, never scored)"
                if self.first_scored
                else ""
            )
            raise ValueError(
                f"ImageGenerator.{where}: expected [batch, length] sub-pixels with "
                f"{shortest} <= length <= max_length={self.max_length}, got shape "
                f"{tuple(x_BT.shape)}{why}."
            )
        if not jnp.issubdtype(x_BT.dtype, jnp.integer):
            raise ValueError(
                f"ImageGenerator.{where}: sub-pixels must be integers in "
                f"[0, {self.num_classes}), got dtype {x_BT.dtype}."
            )
        # Out-of-range values would give a NaN likelihood (or embed another value). Traced
        # values (under jit) cannot be read here: the trainer checks its data when it loads it.
        if not isinstance(x_BT, jax.core.Tracer) and x_BT.size:
            low, high = int(jnp.min(x_BT)), int(jnp.max(x_BT))
            if low < 0 or high >= self.num_classes:
                raise ValueError(
                    f"ImageGenerator.{where}: sub-pixels must be in "
                    f"[0, {self.num_classes}), got values in [{low}, {high}]."
                )
        return x_BT

    def shifted_inputs(self, x_BT):
        """The tokens the model reads, int32: [START, x_0, ..., x_{T-2}] per row ([B, T]) with a
        start token, x[:, :-1] ([B, T - 1]) without."""
        x_BT = self._check_images(x_BT, "shifted_inputs").astype(jnp.int32)
        if self.start_token is None:
            return x_BT[:, :-1]
        start_B1 = jnp.full((x_BT.shape[0], 1), self.start_token, jnp.int32)
        return jnp.concatenate([start_B1, x_BT[:, :-1]], axis=1)

    def __call__(self, x_BT):
        """Mixture parameters of the scored sub-pixels, [B, T - first_scored, Q]: params[:, i] is
        the distribution of x_{i + first_scored} given the sub-pixels before it. Without a start
        token T must be >= 2."""
        inputs_BT = self.shifted_inputs(x_BT)
        x_BTE = self.transformer_inputs(inputs_BT, jnp.arange(inputs_BT.shape[1]))
        return self.head(self.transformer(x_BTE))

    def log_prob(self, x_BT):
        """Total log-likelihood in nats of the scored sub-pixels x[:, first_scored:] of each
        sequence, [B] float32: log p(x) with a start token, log p(x_1, ... | x_0) without."""
        x_BT = self._check_images(x_BT, "log_prob")
        scored_BT = x_BT[:, self.first_scored :]
        return jnp.sum(mol_log_prob(self(x_BT), scored_BT, self.num_classes), axis=1)

    def nll(self, x_BT):
        """Mean negative log-likelihood in nats per scored sub-pixel (x[:, first_scored:]), scalar
        float32: the training loss."""
        x_BT = self._check_images(x_BT, "nll")
        scored_BT = x_BT[:, self.first_scored :]
        return -jnp.mean(mol_log_prob(self(x_BT), scored_BT, self.num_classes))

    @keyword_state_arguments
    def init_state(self, batch: int, *, max_length: int | None = None, dtype=None) -> LMState:
        """Empty recurrent state at position 0; softmax kinds allocate a KV cache of
        `max_length` slots (default the model's max_length, a whole image) in `dtype`."""
        max_length = self.max_length if max_length is None else max_length
        return LMState(
            self.transformer.init_state(batch, max_length=max_length, dtype=dtype),
            jnp.zeros((batch,), jnp.int32),
        )

    def step(self, state: LMState, token_B):
        """Read the input token of this position t (state.position); return its params_BQ, the
        distribution of x_{t + first_scored}. With a start token the token is START at t = 0,
        else x_{t-1}; without one it is x_t.

        Steps past max_length are not checked (the position is traced); softmax caches overflow.
        """
        token_B = check_token_ids(token_B, self.embed.num_embeddings, "ImageGenerator.step", "input tokens")
        check_state_type(
            state, LMState, "ImageGenerator.step", "ImageGenerator.init_state", batch=token_B.shape[0]
        )
        x_BE = self.transformer_inputs(token_B.astype(jnp.int32), state.position)
        layers, y_BE = self.transformer.step(state.layers, x_BE)
        return LMState(layers, state.position + 1), self.head(y_BE)

    def prefill(self, state: LMState, tokens_BT):
        """Read T input tokens at once, as T calls of `step` would (with a start token: START at
        position 0, else the previous sub-pixel; without: the sub-pixel at that position):
        -> (state, params [B, T, Q]), params[:, i] the distribution of the sub-pixel the i-th of
        these positions predicts (`step`); the position advances by T.

        From `init_state`, `shifted_inputs(x_BT)[:, :k]` reads the first k positions of x.
        Positions past max_length are not checked (as in `step`).
        """
        tokens_BT = check_token_ids(
            tokens_BT, self.embed.num_embeddings, "ImageGenerator.prefill", "input tokens"
        )
        check_state_type(
            state, LMState, "ImageGenerator.prefill", "ImageGenerator.init_state", batch=tokens_BT.shape[0]
        )
        tokens_BT = tokens_BT.astype(jnp.int32)
        T = tokens_BT.shape[1]
        x_BTE = self.transformer_inputs(tokens_BT, state.position[:, None] + jnp.arange(T, dtype=jnp.int32))
        layers, y_BTE = self.transformer.prefill(state.layers, x_BTE)
        return LMState(layers, state.position + T), self.head(y_BTE)


def _check_drawn(images_BT, where: str):
    """Raise where `mol_sample` found no distribution (-1): the outputs were not finite."""
    if isinstance(images_BT, jax.core.Tracer):
        return images_BT
    undrawn = int(jnp.sum(images_BT < 0))
    if undrawn:
        raise FloatingPointError(
            f"{where}: the model's outputs are not finite (its parameters are) at {undrawn} "
            f"sub-pixels, so there is no distribution to sample them from."
        )
    return images_BT


def _check_sampling_args(model: ImageGenerator, batch: int, prefix, where: str):
    """Validate the prefix: -> prefix_BT [B, k] int32 (k = 0 without one)."""
    if not isinstance(model, ImageGenerator):
        raise ValueError(f"{where}: model must be an ImageGenerator, got {type(model).__name__}.")
    if batch < 1:
        raise ValueError(f"{where}: batch must be >= 1, got {batch}.")
    # Before tracing, so the error names the fix rather than a dropout RNG.
    check_inference_mode(model)
    length = model.max_length
    no_start = (
        f"{where}: the model has no start token (start_token=False), so it has no "
        f"distribution for the first sub-pixel: pass a prefix of k >= 1 sub-pixels "
        f"(the authors' demo forces the first one)"
    )
    if prefix is None:
        if model.first_scored:
            raise ValueError(no_start + ".")
        return jnp.zeros((batch, 0), jnp.int32)
    prefix = jnp.asarray(prefix)
    if (
        prefix.ndim != 2
        or prefix.shape[0] != batch
        or prefix.shape[1] > length
        or not jnp.issubdtype(prefix.dtype, jnp.integer)
    ):
        raise ValueError(
            f"{where}: prefix must be integer sub-pixels of shape [batch={batch}, k] "
            f"with k <= max_length={length}, got {prefix.dtype} {tuple(prefix.shape)}."
        )
    if prefix.shape[1] < model.first_scored:
        raise ValueError(f"{no_start}, got k = {prefix.shape[1]}.")
    if not isinstance(prefix, jax.core.Tracer) and prefix.size:
        low, high = int(np.min(prefix)), int(np.max(prefix))
        if low < 0 or high >= model.num_classes:
            raise ValueError(
                f"{where}: prefix values must be in [0, {model.num_classes}), got values in [{low}, {high}]."
            )
    return prefix.astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3, 5))
def _sample_recurrent(graphdef, params, key, batch, prefix_BT, num_steps):
    model = nnx.merge(graphdef, params)
    T, k, f = model.max_length, prefix_BT.shape[1], model.first_scored
    if num_steps <= k:  # Every requested sub-pixel is given: nothing to draw.
        return jnp.pad(prefix_BT[:, :num_steps], ((0, 0), (0, T - num_steps)))
    # Position p reads input p and predicts x_{p + f}: the inputs known are START, x_0, ...,
    # x_{k-1} with a start token (f = 0), x_0, ..., x_{k-1} without (f = 1, k >= 1).
    if model.start_token is None:
        inputs_BT = prefix_BT
    else:
        start_B1 = jnp.full((batch, 1), model.start_token, jnp.int32)
        inputs_BT = jnp.concatenate([start_B1, prefix_BT], axis=1)
    state = model.init_state(batch)
    n = k - f  # positions whose predictions the prefix overrides
    if n:
        # In one parallel pass; position n reads x_{k-1} (or START) in the scan below and
        # draws x_k.
        state, _ = model.prefill(state, inputs_BT[:, :n])
    # x_t's key is the same whatever the prefix and the convention: the draws match
    # sample_images_full_recompute.
    keys = jax.random.split(key, T)[k:num_steps]

    def body(carry, key_t):
        state, token_B = carry
        state, params_BQ = model.step(state, token_B)
        token_B = mol_sample(key_t, params_BQ, model.num_classes)
        return (state, token_B), token_B

    _, drawn_TB = jax.lax.scan(body, (state, inputs_BT[:, n]), keys)
    images_BT = jnp.concatenate([prefix_BT, drawn_TB.T], axis=1)
    return jnp.pad(images_BT, ((0, 0), (0, T - num_steps)))


def sample_images(model: ImageGenerator, key, batch: int, *, prefix=None, num_steps=None):
    """Sample [batch, max_length] int32 sub-pixels with the recurrent form, in one compiled call.

    `prefix` [batch, k] forces the first k sub-pixels (conditional completion, like the authors'
    demo): they are read in one parallel `prefill`, and the rest are drawn one `step` at a time
    in a `lax.scan`. A model without a start token has no distribution for x_0 and needs k >= 1.
    The prefix length k is static: each k compiles once. x_t is drawn with
    `jax.random.split(key, max_length)[t]` whatever k and whatever the convention, so
    `sample_images_full_recompute` draws the same samples from the same key. `num_steps` stops
    after that many sub-pixels (the rest are 0): previews and benchmarks. The model must be in
    eval mode.

    A broken model is never sampled into an image: parameters holding NaN or inf are a
    FloatingPointError before sampling, and so are outputs that are not finite (overflow from
    finite parameters) after it, rather than pixels of value 0.
    """
    prefix_BT = _check_sampling_args(model, batch, prefix, "sample_images")
    num_steps = _check_num_steps(model, num_steps, "sample_images")
    check_finite_parameters(model, "sample_images")
    graphdef, params = nnx.split(model)
    return _check_drawn(
        _sample_recurrent(graphdef, params, key, batch, prefix_BT, num_steps), "sample_images"
    )


def _check_num_steps(model: ImageGenerator, num_steps, where: str) -> int:
    if num_steps is None:
        return model.max_length
    if not isinstance(num_steps, int) or not 1 <= num_steps <= model.max_length:
        raise ValueError(
            f"{where}: num_steps must be an integer in [1, max_length={model.max_length}], got {num_steps!r}."
        )
    return num_steps


@functools.partial(jax.jit, static_argnums=(0, 3, 6))
def _sample_full_recompute(graphdef, params, key, batch, prefix_BT, prefix_length, num_steps):
    model = nnx.merge(graphdef, params)
    keys = jax.random.split(key, model.max_length)[:num_steps]

    def draw(images_BT, t, key_t):
        # Causality makes the not-yet-drawn tail of the buffer irrelevant to x_t's params, at
        # index t - first_scored (x_0 without a start token has none; the prefix gives it).
        index = jnp.maximum(t - model.first_scored, 0)
        params_BQ = jax.lax.dynamic_index_in_dim(model(images_BT), index, axis=1, keepdims=False)
        return mol_sample(key_t, params_BQ, model.num_classes)

    def body(images_BT, inputs):
        t, key_t = inputs
        # A given sub-pixel is copied without running the model: k forwards fewer.
        token_B = jax.lax.cond(t < prefix_length, lambda *_: prefix_BT[:, t], draw, images_BT, t, key_t)
        return images_BT.at[:, t].set(token_B), None

    images_BT = jnp.zeros((batch, model.max_length), jnp.int32)
    images_BT, _ = jax.lax.scan(body, images_BT, (jnp.arange(num_steps), keys))
    return images_BT


def sample_images_full_recompute(model: ImageGenerator, key, batch: int, *, prefix=None, num_steps=None):
    """`sample_images` by the paper's slow baseline: the full parallel forward at every step.

    One parallel forward per drawn sub-pixel (O(T^2) work with linear attention, O(T^3) with
    softmax); the same draws as `sample_images` for the same key, so the two return the same
    images unless a draw lands within rounding error of a bin edge. Every draw runs the model
    over the whole max_length buffer, so each costs the same; the k sub-pixels of a prefix are
    copied, not drawn. `prefix` and `num_steps` as in `sample_images`, and so is the
    FloatingPointError of a model that is not finite.
    """
    where = "sample_images_full_recompute"
    prefix_BT = _check_sampling_args(model, batch, prefix, where)
    num_steps = _check_num_steps(model, num_steps, where)
    check_finite_parameters(model, where)
    # Padded to max_length with the length traced: one compilation serves every prefix length.
    k = prefix_BT.shape[1]
    padded_BT = jnp.pad(prefix_BT, ((0, 0), (0, model.max_length - k)))
    prefix_length = jnp.int32(k)
    graphdef, params = nnx.split(model)
    images_BT = _sample_full_recompute(graphdef, params, key, batch, padded_BT, prefix_length, num_steps)
    return _check_drawn(images_BT, where)
