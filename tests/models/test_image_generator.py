"""ImageGenerator: shapes, exact causality, every sub-pixel scored (START), recurrent = parallel,
recurrent and full-recompute samplers agree draw for draw, prefixes, training lowers the NLL, errors;
the authors' convention (no START, interleaved positions) against a reference built by hand.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import stats

from linear_transformers import TransformerConfig, generation
from linear_transformers.image_generator import ImageGenerator, sample_images, sample_images_full_recompute
from linear_transformers.lm import sinusoidal_encoding
from linear_transformers.mixture import mol_log_prob, mol_probs

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

B, T, C, K, E = 2, 12, 17, 3, 16


def _model(kind="linear", seed=0, *, start_token=True, position_layout="concatenated", **overrides):
    kwargs = dict(num_layers=2, num_heads=2, model_dim=E, feed_forward_dim=32, dropout=0.0, attention=kind)
    kwargs.update(overrides)
    return ImageGenerator(
        TransformerConfig(**kwargs),
        num_classes=C,
        num_mixtures=K,
        max_length=T,
        start_token=start_token,
        position_layout=position_layout,
        rngs=nnx.Rngs(seed),
    )


def _authors_model(kind="linear", seed=0, **overrides):
    """The convention of the authors' MNIST colab: no START token, interleaved positions."""
    return _model(kind, seed, start_token=False, position_layout="interleaved", **overrides)


def _colab_encoding(length, dim):
    """The authors' colab, in numpy: pe[:, 0::2] = sin(position * div_term), pe[:, 1::2] = cos."""
    position = np.arange(length, dtype=np.float64)[:, None]
    div_term = np.exp(np.arange(0, dim, 2) * (-np.log(10000.0) / dim))
    pe = np.zeros((length, dim))
    pe[:, 0::2] = np.sin(position * div_term)
    pe[:, 1::2] = np.cos(position * div_term)
    return pe


def _images(shape=(B, T), seed=1):
    return np.random.default_rng(seed).integers(0, C, size=shape).astype(np.int32)


# Compiled once per module structure and reused (eager dispatch is slow on CPU).
_call = nnx.jit(lambda m, x: m(x))
_nll = nnx.jit(lambda m, x: m.nll(x))
_log_prob = nnx.jit(lambda m, x: m.log_prob(x))
_step = nnx.jit(lambda m, s, tok: m.step(s, tok))
_prefill = nnx.jit(lambda m, s, toks: m.prefill(s, toks))
_decode = nnx.jit(lambda m, x_BTE: m.head(m.transformer(x_BTE)))


def test_shapes_and_dtypes():
    model = _model()
    x = _images()
    params = _call(model, x)
    chex.assert_shape(params, (B, T, 3 * K))
    chex.assert_tree_all_finite(params)
    chex.assert_shape(_call(model, x[:, :5]), (B, 5, 3 * K))
    log_prob = _log_prob(model, x)
    chex.assert_shape(log_prob, (B,))
    nll = _nll(model, x)
    chex.assert_shape(nll, ())
    assert nll.dtype == jnp.float32
    np.testing.assert_allclose(nll, -np.sum(log_prob) / (B * T), rtol=1e-5)
    np.testing.assert_array_equal(
        model.shifted_inputs(x), np.concatenate([np.full((B, 1), C), x[:, :-1]], axis=1)
    )


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_params_at_t_depend_only_on_earlier_sub_pixels(kind):
    model = _model(kind)
    x = _images((1, T))
    # Row t changes x_t, ..., x_{T-1}: params at positions <= t must not move.
    variants = np.repeat(x, T, axis=0)
    noise = _images((T, T), seed=7)
    future = np.arange(T)[None, :] >= np.arange(T)[:, None]
    variants = np.where(future, (variants + 1 + noise % (C - 1)) % C, variants)
    assert np.all((variants != x) == future)
    base = np.asarray(_call(model, x))[0]
    changed = np.asarray(_call(model, variants))
    for t in range(T):
        np.testing.assert_allclose(changed[t, : t + 1], base[: t + 1], atol=1e-5, rtol=1e-5)
        if t + 1 < T:  # and the test has teeth: position t + 1 sees the change.
            assert not np.allclose(changed[t, t + 1], base[t + 1], atol=1e-4)


def test_nll_gradient_wrt_inputs_after_t_is_zero():
    """nanodo's causality test on embedded inputs: the loss at t ignores inputs after t."""
    model = _model()
    x = _images((1, T))
    inputs = model.shifted_inputs(x)
    x_BTE = model.transformer_inputs(inputs, jnp.arange(T))

    def log_prob_at(x_BTE, t):
        params = model.head(model.transformer(x_BTE))
        return mol_log_prob(params, jnp.asarray(x), C)[0, t]

    jacobian = jax.jit(jax.vmap(jax.grad(log_prob_at), in_axes=(None, 0)))(x_BTE, jnp.arange(T))
    norms = np.abs(np.asarray(jacobian)[:, 0]).sum(-1)  # [t, input position]
    after = np.arange(T)[None, :] > np.arange(T)[:, None]
    assert np.all(norms[after] == 0.0)
    assert np.all(norms[~after] > 0.0)


def test_first_sub_pixel_is_scored_from_start_alone():
    model = _model()
    x = _images((4, T), seed=3)
    params = np.asarray(_call(model, x))
    np.testing.assert_allclose(params[:, 0], np.broadcast_to(params[0, 0], params[:, 0].shape), atol=1e-6)
    # ...and it counts: the loss changes when only the first sub-pixel changes.
    y = x.copy()
    y[:, 0] = (y[:, 0] + 5) % C
    assert not np.allclose(_log_prob(model, x), _log_prob(model, y))


@pytest.mark.parametrize("kind", ["linear", "softmax", "causal-linear"])
def test_recurrent_steps_equal_parallel(kind):
    model = _model(kind)
    model.eval()
    x = _images()
    inputs = model.shifted_inputs(x)
    state, params_rec = generation.scan_steps(model, model.init_state(B), inputs)
    np.testing.assert_allclose(params_rec, _call(model, x), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(state.position, T)
    # The plain Python loop of single steps, for the first few positions.
    step = nnx.jit(lambda m, s, tok: m.step(s, tok))
    state = model.init_state(B)
    for t in range(3):
        state, params_t = step(model, state, inputs[:, t])
        np.testing.assert_allclose(params_t, params_rec[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_samplers_agree_and_honour_prefix(kind):
    model = _model(kind, seed=2)
    model.eval()
    key = jax.random.key(11)
    images = sample_images(model, key, 3)
    chex.assert_shape(images, (3, T))
    assert images.dtype == jnp.int32
    assert int(images.min()) >= 0 and int(images.max()) < C
    np.testing.assert_array_equal(images, sample_images(model, key, 3))
    assert not np.array_equal(images, sample_images(model, jax.random.key(12), 3))
    np.testing.assert_array_equal(images, sample_images_full_recompute(model, key, 3))
    # Conditional completion: the prefix is kept verbatim, the rest still agrees across samplers.
    prefix = _images((3, 5), seed=4)
    completed = sample_images(model, key, 3, prefix=prefix)
    np.testing.assert_array_equal(completed[:, :5], prefix)
    np.testing.assert_array_equal(completed, sample_images_full_recompute(model, key, 3, prefix=prefix))
    # A full-length prefix is returned unchanged; an empty one is unconditional sampling.
    full = _images((3, T), seed=5)
    np.testing.assert_array_equal(sample_images(model, key, 3, prefix=full), full)
    np.testing.assert_array_equal(sample_images(model, key, 3, prefix=full[:, :0]), images)
    # Stopping early: the same first sub-pixels, zeros after them, in both samplers.
    for sample in (sample_images, sample_images_full_recompute):
        partial = sample(model, key, 3, num_steps=5)
        chex.assert_shape(partial, (3, T))
        np.testing.assert_array_equal(partial[:, :5], images[:, :5])
        np.testing.assert_array_equal(partial[:, 5:], 0)


def test_first_sampled_sub_pixel_follows_the_model():
    """The sampler draws from the distribution the loss scores (here at position 0)."""
    model = _model(seed=3)
    model.eval()
    n = 4000
    images = np.asarray(sample_images(model, jax.random.key(0), n))
    probs = np.asarray(mol_probs(_call(model, images[:1])[0, 0], C), np.float64)
    observed = np.bincount(images[:, 0], minlength=C).astype(np.float64)
    expected = probs * n / probs.sum()
    keep = expected >= 5  # pool rare classes so the chi-square approximation holds
    expected = np.append(expected[keep], expected[~keep].sum())
    observed = np.append(observed[keep], observed[~keep].sum())
    if expected[-1] == 0:
        expected, observed = expected[:-1], observed[:-1]
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_nll_gradient_finite_and_training_lowers_nll():
    model = _model(seed=4)
    data = _images((8, T), seed=6)
    data[:, ::2] = np.arange(T // 2) % C  # some structure to learn
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: m.nll(x))(model)
        optimizer.update(model, grads)
        return loss, grads

    first, grads = train_step(model, optimizer, data)
    chex.assert_tree_all_finite(grads)
    for _ in range(40):
        last, _ = train_step(model, optimizer, data)
    last = float(_nll(model, data))
    assert np.isfinite(last) and last < float(first) - 0.3, (float(first), last)


def test_bad_inputs_raise_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match=r"max_length=12, got shape \(2, 13\)"):
        model(_images((B, T + 1)))
    with pytest.raises(ValueError, match="got shape"):
        model.nll(_images((T,)))
    with pytest.raises(ValueError, match="must be integers"):
        model(np.zeros((B, T), np.float32))
    with pytest.raises(ValueError, match="model_dim=18 splits into a 9-wide embedding and a 9-wide"):
        _model(model_dim=18, num_heads=2)
    with pytest.raises(ValueError, match="num_classes must be >= 2"):
        ImageGenerator(
            TransformerConfig(model_dim=E, num_heads=2),
            num_classes=1,
            num_mixtures=K,
            max_length=T,
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="num_mixtures must be >= 1"):
        ImageGenerator(
            TransformerConfig(model_dim=E, num_heads=2),
            num_classes=C,
            num_mixtures=0,
            max_length=T,
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        ImageGenerator(
            TransformerConfig(model_dim=E, num_heads=2),
            num_classes=C,
            num_mixtures=K,
            max_length=0,
            rngs=nnx.Rngs(0),
        )


def test_sampling_errors():
    model = _model(dropout=0.1)
    with pytest.raises(ValueError, match="call model.eval"):
        sample_images(model, jax.random.key(0), 2)
    with pytest.raises(ValueError, match="call model.eval"):
        sample_images_full_recompute(model, jax.random.key(0), 2)
    model.eval()
    with pytest.raises(ValueError, match=r"prefix must be .* \[batch=2, k\]"):
        sample_images(model, jax.random.key(0), 2, prefix=_images((3, 4)))
    with pytest.raises(ValueError, match=r"k <= max_length=12"):
        sample_images(model, jax.random.key(0), 2, prefix=_images((2, T + 1)))
    with pytest.raises(ValueError, match=r"prefix values must be in \[0, 17\)"):
        sample_images(model, jax.random.key(0), 2, prefix=np.full((2, 3), C, np.int32))
    with pytest.raises(ValueError, match="batch must be >= 1"):
        sample_images(model, jax.random.key(0), 0)
    for bad in (0, T + 1, 2.0):
        with pytest.raises(ValueError, match=r"num_steps must be an integer in \[1, max_length=12\]"):
            sample_images_full_recompute(model, jax.random.key(0), 2, num_steps=bad)


def test_sinusoidal_encoding_layouts():
    length, dim = 40, 10
    pe = _colab_encoding(length, dim)
    positions = np.arange(length)
    interleaved = sinusoidal_encoding(positions, dim, layout="interleaved")
    np.testing.assert_allclose(interleaved, pe, atol=1e-5)
    concatenated = np.concatenate([pe[:, 0::2], pe[:, 1::2]], axis=-1)
    np.testing.assert_allclose(sinusoidal_encoding(positions, dim), concatenated, atol=1e-5)
    np.testing.assert_allclose(
        sinusoidal_encoding(positions, dim, layout="concatenated"), concatenated, atol=1e-5
    )
    assert not np.allclose(interleaved, concatenated, atol=1e-2)
    # Leading axes: each position's features in the same order.
    grid = sinusoidal_encoding(positions.reshape(4, 10), dim, jnp.bfloat16, layout="interleaved")
    chex.assert_shape(grid, (4, 10, dim))
    assert grid.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grid, np.float32).reshape(length, dim), pe, atol=1e-2)
    with pytest.raises(
        ValueError,
        match=r"layout must be one of \('concatenated', 'interleaved'\), "
        r"got 'stacked'",
    ):
        sinusoidal_encoding(positions, dim, layout="stacked")


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_without_start_token_params_equal_a_reference_built_by_hand(kind):
    model = _authors_model(kind)
    assert model.start_token is None and model.first_scored == 1
    chex.assert_shape(model.embed.embedding[...], (C, E // 2))
    x = _images()
    np.testing.assert_array_equal(model.shifted_inputs(x), x[:, :-1])
    params = np.asarray(_call(model, x))
    chex.assert_shape(params, (B, T - 1, 3 * K))
    # Position t reads x_t with the colab's encoding of t; its output scores x_{t+1}.
    embedded_BTE = model.embed(jnp.asarray(x[:, :-1]))
    pe_BTE = np.broadcast_to(_colab_encoding(T - 1, E - E // 2), (B, T - 1, E - E // 2))
    inputs_BTE = jnp.concatenate([embedded_BTE, jnp.asarray(pe_BTE, embedded_BTE.dtype)], axis=-1)
    reference = np.asarray(_decode(model, inputs_BTE))
    np.testing.assert_allclose(params, reference, atol=1e-5, rtol=1e-5)
    # The layout counts: the same weights with [sin | cos] give other params.
    assert not np.allclose(_call(_model(kind, start_token=False), x), reference, atol=1e-3)
    # x_0 is only read, never scored: log p(x_1, ..., x_{T-1} | x_0).
    expected = np.sum(np.asarray(mol_log_prob(jnp.asarray(reference), jnp.asarray(x[:, 1:]), C)), axis=1)
    log_prob = _log_prob(model, x)
    chex.assert_shape(log_prob, (B,))
    np.testing.assert_allclose(log_prob, expected, rtol=1e-5)
    np.testing.assert_allclose(_nll(model, x), -np.sum(expected) / (B * (T - 1)), rtol=1e-5)
    # The last sub-pixel is scored but never read.
    y = x.copy()
    y[:, -1] = (y[:, -1] + 5) % C
    np.testing.assert_array_equal(_call(model, y), params)
    assert not np.allclose(_log_prob(model, y), log_prob)


@pytest.mark.parametrize("kind", ["linear", "softmax", "causal-linear"])
def test_without_start_token_recurrent_steps_and_prefill_equal_parallel(kind):
    model = _authors_model(kind)
    model.eval()
    x = _images()
    parallel = np.asarray(_call(model, x))
    state = model.init_state(B)
    for t in range(T - 1):  # position t reads x_t and gives the params of x_{t+1}
        state, params_t = _step(model, state, x[:, t])
        np.testing.assert_allclose(params_t, parallel[:, t], atol=2e-5, rtol=2e-5, err_msg=f"t={t}")
    np.testing.assert_array_equal(state.position, T - 1)
    # A block of the first sub-pixels in one prefill, then steps.
    state, block = _prefill(model, model.init_state(B), x[:, :5])
    np.testing.assert_allclose(block, parallel[:, :5], atol=2e-5, rtol=2e-5)
    for t in range(5, T - 1):
        state, params_t = _step(model, state, x[:, t])
        np.testing.assert_allclose(params_t, parallel[:, t], atol=2e-5, rtol=2e-5, err_msg=f"t={t}")


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_without_start_token_samplers_agree_and_honour_prefix(kind):
    model = _authors_model(kind, seed=2)
    model.eval()
    key = jax.random.key(11)
    prefix = _images((3, T), seed=4)
    completions = {}
    for k in (1, 3):
        images = sample_images(model, key, 3, prefix=prefix[:, :k])
        chex.assert_shape(images, (3, T))
        assert images.dtype == jnp.int32
        assert int(images.min()) >= 0 and int(images.max()) < C
        np.testing.assert_array_equal(images[:, :k], prefix[:, :k])
        np.testing.assert_array_equal(
            images, sample_images_full_recompute(model, key, 3, prefix=prefix[:, :k]), err_msg=f"k={k}"
        )
        completions[k] = np.asarray(images)
    assert not np.array_equal(
        completions[1], sample_images(model, jax.random.key(12), 3, prefix=prefix[:, :1])
    )
    # Stopping early: the same first sub-pixels, zeros after them, in both samplers.
    for sample in (sample_images, sample_images_full_recompute):
        partial = sample(model, key, 3, prefix=prefix[:, :1], num_steps=5)
        np.testing.assert_array_equal(partial[:, :5], completions[1][:, :5])
        np.testing.assert_array_equal(partial[:, 5:], 0)
    np.testing.assert_array_equal(sample_images(model, key, 3, prefix=prefix), prefix)


def test_without_start_token_errors():
    model = _authors_model()
    with pytest.raises(
        ValueError,
        match=r"2 <= length <= max_length=12, got shape \(2, 1\) "
        r"\(without a start token",
    ):
        model(_images((B, 1)))
    model.eval()
    key = jax.random.key(0)
    for sample in (sample_images, sample_images_full_recompute):
        with pytest.raises(ValueError, match=r"no start token .* pass a prefix of k >= 1"):
            sample(model, key, 2)
        with pytest.raises(ValueError, match=r"pass a prefix of k >= 1 .* got k = 0"):
            sample(model, key, 2, prefix=_images((2, 0)))
    with pytest.raises(
        ValueError,
        match=r"position_layout must be one of \('concatenated', "
        r"'interleaved'\), got 'stacked'",
    ):
        _model(position_layout="stacked")
    with pytest.raises(ValueError, match="without a start token .* max_length must be >= 2"):
        ImageGenerator(
            TransformerConfig(model_dim=E, num_heads=2),
            num_classes=C,
            num_mixtures=K,
            max_length=1,
            start_token=False,
            rngs=nnx.Rngs(0),
        )
