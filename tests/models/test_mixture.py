"""Discretized mixture of logistics: log-probs against float64 SciPy references, normalisation and
finite gradients at extreme parameters, the sampler against the scored distribution, bf16, errors.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special, stats

from linear_transformers import mixture
from linear_transformers.mixture import (
    LOG_SCALE_MIN,
    bits_per_dim,
    class_centers,
    mol_log_prob,
    mol_probs,
    mol_sample,
    num_params,
    split_params,
)

K = 4


def _params(shape, seed=0, mean_range=1.2, log_scale_range=(-7.0, 1.0)):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=shape + (K,)) * 2.0
    means = rng.uniform(-mean_range, mean_range, size=shape + (K,))
    log_scales = rng.uniform(*log_scale_range, size=shape + (K,))
    return np.concatenate([logits, means, log_scales], axis=-1).astype(np.float32)


def _extreme_params(num_classes):
    """One position per (mean, log_scale) pair, every component alike: the edge cases one by one."""
    means = [-50.0, -3.0, -1.0, -1.0 + 1.0 / (num_classes - 1), 0.0, 0.3, 1.0, 3.0, 50.0]
    log_scales = [-20.0, LOG_SCALE_MIN, -3.0, 0.0, 5.0]
    rows = [[0.0] * K + [m] * K + [s] * K for m in means for s in log_scales]
    # And a mixture mixing all of them, with very uneven weights.
    rows.append([30.0, -30.0, 0.0, 5.0, -50.0, 0.0, 0.9, 3.0, -7.0, 5.0, -7.0, 0.0])
    return np.asarray(rows, np.float32)


def _reference_log_prob_plain(params, x, num_classes):
    """float64, the textbook form: log sum_k w_k (CDF(upper) - CDF(lower)) with SciPy's logistic."""
    params = params.astype(np.float64)
    logits, means, log_scales = np.split(params, 3, axis=-1)
    scales = np.exp(np.maximum(log_scales, LOG_SCALE_MIN))
    half = 1.0 / (num_classes - 1)
    center = (-1.0 + 2.0 * x / (num_classes - 1))[..., None]
    cdf_upper = stats.logistic.cdf(center + half, loc=means, scale=scales)
    cdf_lower = stats.logistic.cdf(center - half, loc=means, scale=scales)
    cdf_upper = np.where(x[..., None] == num_classes - 1, 1.0, cdf_upper)
    cdf_lower = np.where(x[..., None] == 0, 0.0, cdf_lower)
    weights = special.softmax(logits, axis=-1)
    return np.log(np.sum(weights * (cdf_upper - cdf_lower), axis=-1))


def _reference_log_prob_tails(params, x, num_classes):
    """float64 in log space: log CDF differences taken on the side of the mean the bin lies on."""
    params = params.astype(np.float64)
    logits, means, log_scales = np.split(params, 3, axis=-1)
    inv_scales = np.exp(-np.maximum(log_scales, LOG_SCALE_MIN))
    half = 1.0 / (num_classes - 1)
    center = (-1.0 + 2.0 * x / (num_classes - 1))[..., None]
    upper = (center + half - means) * inv_scales
    lower = (center - half - means) * inv_scales
    with np.errstate(divide="ignore"):
        # Left of the mean: log(CDF(u) - CDF(l)) = logCDF(u) + log(1 - exp(logCDF(l) - logCDF(u))).
        left = special.log_expit(upper) + np.log1p(
            -np.exp(special.log_expit(lower) - special.log_expit(upper))
        )
        # Right of the mean: the same with survival functions, which do not round to 1 there.
        right = special.log_expit(-lower) + np.log1p(
            -np.exp(special.log_expit(-upper) - special.log_expit(-lower))
        )
    middle = np.where(center > means, right, left)
    first = x[..., None] == 0
    last = x[..., None] == num_classes - 1
    component = np.where(first, special.log_expit(upper), np.where(last, special.log_expit(-lower), middle))
    return special.logsumexp(special.log_softmax(logits, axis=-1) + component, axis=-1)


def _float32_tolerance(params):
    """Absolute error float32 cannot avoid: an edge near 1 is rounded by ~6e-8, times 1/scale."""
    min_log_scale = np.maximum(params[..., 2 * K :], LOG_SCALE_MIN).min(-1)
    return 1e-5 + 4 * 6e-8 * np.exp(-min_log_scale)


@pytest.mark.parametrize("num_classes", [2, 17, 256])
def test_log_prob_matches_scipy_on_random_params(num_classes):
    params = _params((3, 40), seed=num_classes)
    x = np.random.default_rng(1).integers(0, num_classes, size=(3, 40))
    x[:, :3] = [0, num_classes - 1, num_classes // 2]  # the edge bins, always
    got = np.asarray(mol_log_prob(params, x, num_classes))
    assert got.dtype == np.float32
    chex.assert_shape(got, (3, 40))
    tolerance = _float32_tolerance(params)
    np.testing.assert_array_less(
        np.abs(got - _reference_log_prob_tails(params, x, num_classes)), tolerance + 1e-5 * np.abs(got)
    )
    # The textbook CDF difference, wherever float64 holds it without cancelling to 0.
    with np.errstate(divide="ignore"):
        plain = _reference_log_prob_plain(params, x, num_classes)
    sane = np.isfinite(plain) & (plain > -15)
    assert sane.mean() > 0.8
    np.testing.assert_array_less(np.abs(got - plain)[sane], (tolerance + 1e-5 * np.abs(got))[sane])


@pytest.mark.parametrize("num_classes", [2, 17, 256])
def test_log_prob_matches_log_space_reference_at_extremes(num_classes):
    params = _extreme_params(num_classes)
    x = np.tile(
        np.array([0, 1 % num_classes, num_classes // 2, num_classes - 2, num_classes - 1]),
        (params.shape[0], 1),
    )
    params_b = np.broadcast_to(params[:, None, :], x.shape + params.shape[-1:])
    got = np.asarray(mol_log_prob(params_b, x, num_classes))
    want = _reference_log_prob_tails(params_b, x, num_classes)
    assert np.all(np.isfinite(got)), got
    # Keep to entries whose float64 reference did not underflow (those past ~-700 nats).
    ok = np.isfinite(want)
    assert ok.mean() > 0.9
    tolerance = _float32_tolerance(params_b) + 1e-5 * np.abs(got)
    np.testing.assert_array_less(np.abs(got - want)[ok], tolerance[ok])
    # The plain CDF difference agrees wherever float64 holds it without cancelling.
    with np.errstate(divide="ignore"):
        plain = _reference_log_prob_plain(params_b, x, num_classes)
    sane = np.isfinite(plain) & (plain > -15)
    np.testing.assert_array_less(np.abs(got - plain)[sane], tolerance[sane])


@pytest.mark.parametrize("num_classes", [17, 256])
@pytest.mark.parametrize("which", ["random", "extreme"])
def test_probabilities_sum_to_one(num_classes, which):
    params = (
        _params((64,), seed=3, mean_range=5.0, log_scale_range=(-9.0, 5.0))
        if which == "random"
        else _extreme_params(num_classes)
    )
    probs = mol_probs(params, num_classes)
    chex.assert_shape(probs, (params.shape[0], num_classes))
    assert np.all(np.asarray(probs) >= 0)
    np.testing.assert_allclose(np.sum(np.asarray(probs, np.float64), axis=-1), 1.0, atol=1e-5)
    # mol_probs is mol_log_prob at every class.
    x = np.broadcast_to(np.arange(num_classes), probs.shape)
    params_b = np.broadcast_to(params[:, None, :], probs.shape + params.shape[-1:])
    np.testing.assert_allclose(probs, np.exp(mol_log_prob(params_b, x, num_classes)), rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("num_classes", [2, 17, 256])
def test_gradients_finite_at_extremes(num_classes):
    params = _extreme_params(num_classes)
    x = np.broadcast_to(np.arange(num_classes), (params.shape[0], num_classes))
    params_b = jnp.broadcast_to(params[:, None, :], x.shape + params.shape[-1:])
    grads = jax.grad(lambda p: jnp.sum(mol_log_prob(p, x, num_classes)))(params_b)
    chex.assert_tree_all_finite(grads)
    # The floor on log_scale stops the gradient below it (and only there).
    _, _, log_scale_grads = np.split(np.asarray(grads), 3, axis=-1)
    floored = np.asarray(params_b)[..., 2 * K :] < LOG_SCALE_MIN
    assert np.all(log_scale_grads[floored] == 0)
    assert np.any(log_scale_grads[~floored] != 0)


def test_log_scale_floor_and_split_layout():
    params = np.arange(3 * K, dtype=np.float32)[None] - 20.0
    logits, means, log_scales = split_params(params.astype(jnp.bfloat16))
    assert logits.dtype == means.dtype == log_scales.dtype == jnp.float32
    np.testing.assert_array_equal(logits, params[:, :K])
    np.testing.assert_array_equal(means, params[:, K : 2 * K])
    np.testing.assert_array_equal(log_scales, np.maximum(params[:, 2 * K :], LOG_SCALE_MIN))
    # Below the floor the parameters are indistinguishable.
    lower = params.copy()
    lower[:, 2 * K :] = -30.0
    floor = params.copy()
    floor[:, 2 * K :] = LOG_SCALE_MIN
    np.testing.assert_array_equal(mol_probs(lower, 17), mol_probs(floor, 17))


def test_class_centers_and_bin_edges():
    centers = np.asarray(class_centers(17))
    np.testing.assert_allclose(centers, np.linspace(-1.0, 1.0, 17), atol=1e-7)
    # A very narrow logistic centred on a class puts (almost) all mass there.
    params = np.array([[0.0, centers[5], LOG_SCALE_MIN]], np.float32)
    probs = np.asarray(mol_probs(params, 17))[0]
    assert probs[5] > 0.99
    # Centred on the boundary between two bins: half on each side.
    params = np.array([[0.0, (centers[5] + centers[6]) / 2, LOG_SCALE_MIN]], np.float32)
    np.testing.assert_allclose(np.asarray(mol_probs(params, 17))[0, 5:7], 0.5, atol=1e-4)
    # Mean far outside [-1, 1]: the edge bin takes everything.
    params = np.array([[0.0, 40.0, 0.0]], np.float32)
    np.testing.assert_allclose(np.asarray(mol_probs(params, 17))[0, -1], 1.0, atol=1e-6)


def _merge_small(expected, observed, minimum=5.0):
    """Pool classes with small expected counts so the chi-square approximation holds."""
    small = expected < minimum
    if not small.any():
        return expected, observed
    return (
        np.append(expected[~small], expected[small].sum()),
        np.append(observed[~small], observed[small].sum()),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_samples_follow_the_scored_distribution(seed):
    num_classes, n = 17, 200_000
    params = _params((1,), seed=seed, mean_range=1.5, log_scale_range=(-4.0, 0.0))
    params[0, 2 * K] = LOG_SCALE_MIN  # one component narrower than a bin
    params[0, K + 1] = 1.4  # and one centred past the last class
    probs = np.asarray(mol_probs(params, num_classes), np.float64)[0]
    samples = mol_sample(jax.random.key(seed), np.broadcast_to(params, (n, 3 * K)), num_classes)
    assert samples.dtype == jnp.int32
    chex.assert_shape(samples, (n,))
    samples = np.asarray(samples)
    assert samples.min() >= 0 and samples.max() < num_classes
    observed = np.bincount(samples, minlength=num_classes).astype(np.float64)
    expected, observed = _merge_small(probs * n / probs.sum(), observed)
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    np.testing.assert_allclose(np.bincount(samples, minlength=num_classes) / n, probs, atol=5e-3)


def test_sample_shapes_edges_and_reproducibility():
    params = _extreme_params(17)
    a = mol_sample(jax.random.key(0), params, 17)
    b = mol_sample(jax.random.key(0), params, 17)
    chex.assert_shape(a, params.shape[:1])
    np.testing.assert_array_equal(a, b)
    assert np.asarray(a).min() >= 0 and np.asarray(a).max() <= 16
    # Means at +-50 with ordinary scales land in the edge bins.
    means = _extreme_params(17)[:, K]
    log_scales = _extreme_params(17)[:, 2 * K]
    far = (np.abs(means) == 50.0) & (log_scales <= 0.0)
    np.testing.assert_array_equal(np.asarray(a)[far], np.where(means[far] > 0, 16, 0))


def test_bf16_params_give_float32_log_probs():
    params = _params((5, 7), seed=4)
    x = np.random.default_rng(2).integers(0, 256, size=(5, 7))
    got = mol_log_prob(params.astype(jnp.bfloat16), x, 256)
    assert got.dtype == jnp.float32
    # Computed in float32 from the bf16 values: the same as upcasting first.
    want = mol_log_prob(params.astype(jnp.bfloat16).astype(np.float32), x, 256)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # And close to the float32 params wherever rounding the mean moves it by well under a bin.
    wide = np.exp(params[..., 2 * K :]).min(-1) > 0.1
    np.testing.assert_allclose(
        np.asarray(got)[wide], np.asarray(mol_log_prob(params, x, 256))[wide], atol=0.05
    )


def test_out_of_range_classes_get_zero_probability():
    params = _params((3,), seed=5)
    got = np.asarray(mol_log_prob(params, np.array([-1, 17, 3]), 17))
    assert got[0] == -np.inf and got[1] == -np.inf and np.isfinite(got[2])


def test_num_params_and_bits_per_dim():
    assert num_params(10) == 30
    np.testing.assert_allclose(bits_per_dim(math.log(2.0) * 3.0), 3.0)
    np.testing.assert_allclose(bits_per_dim(jnp.float32(1.0)), 1.0 / math.log(2.0), rtol=1e-6)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: mol_log_prob(np.zeros((2, 7)), np.zeros(2, np.int32), 17), r"3 \* num_mixtures"),
        (lambda: mol_probs(np.zeros((2, 0)), 17), r"3 \* num_mixtures"),
        (lambda: mol_sample(jax.random.key(0), np.zeros((2, 4)), 17), r"3 \* num_mixtures"),
        (lambda: split_params(np.zeros(5)), r"got shape \(5,\)"),
        (lambda: mol_log_prob(np.zeros((2, 6)), np.zeros(2, np.int32), 1), "num_classes must be"),
        (lambda: mol_probs(np.zeros((2, 6)), 0), "num_classes must be"),
        (lambda: mol_sample(jax.random.key(0), np.zeros((2, 6)), 1), "num_classes must be"),
        (lambda: class_centers(1), "num_classes must be"),
        (lambda: mol_log_prob(np.zeros((2, 6)), np.zeros(2), 17), "integer classes"),
        (lambda: mol_log_prob(np.zeros((2, 6)), np.zeros(3, np.int32), 17), r"x shape \(3,\)"),
        (lambda: num_params(0), "num_mixtures must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_module_constants():
    assert mixture.LOG_SCALE_MIN == -7.0


@pytest.mark.parametrize("seed", [0, 1])
def test_the_same_check_rejects_the_authors_sampler_scale(seed):
    """Sampling with scale elu(r) + 1.0001 (the authors' sampler) is not the trained distribution."""
    num_classes, n = 17, 200_000
    params = _params((1,), seed=seed, mean_range=1.5, log_scale_range=(-4.0, 0.0))
    params[0, 2 * K] = LOG_SCALE_MIN
    params[0, K + 1] = 1.4
    probs = np.asarray(mol_probs(params, num_classes), np.float64)[0]
    authors = params.copy()
    r = np.maximum(authors[0, 2 * K :], LOG_SCALE_MIN)
    authors[0, 2 * K :] = np.log(np.where(r > 0, r, np.expm1(r)) + 1.0001)
    samples = mol_sample(jax.random.key(seed), np.broadcast_to(authors, (n, 3 * K)), num_classes)
    observed = np.bincount(np.asarray(samples), minlength=num_classes).astype(np.float64)
    expected, observed = _merge_small(probs * n / probs.sum(), observed)
    assert stats.chisquare(observed, expected).pvalue < 1e-6


def test_uint8_classes_give_the_same_log_probs_as_int32():
    """Images arrive as uint8; with C = 256 nothing may be computed in uint8 (256 wraps to 0)."""
    params = jnp.asarray(np.random.default_rng(5).standard_normal((6, 9)), jnp.float32)
    x = np.array([0, 1, 127, 128, 254, 255])
    expected = mixture.mol_log_prob(params, x.astype(np.int32), 256)
    chex.assert_tree_all_finite(expected)
    chex.assert_trees_all_close(mixture.mol_log_prob(params, x.astype(np.uint8), 256), expected)
