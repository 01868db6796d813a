"""Every op family at the precision its users get by default, with tolerances that hold there.

The library follows `jax.default_matmul_precision` (ops/precision.py): float32 inputs get full
float32 products on a CPU and TF32 products on an NVIDIA GPU; bfloat16 inputs multiply in
bfloat16 everywhere. The other op tests pin float32 products (the `float32_products` fixture)
to check exactness; these check what a user gets without pinning anything, in two regimes:

  default    float32 inputs at the platform's default precision where that rounds products
             (TF32 on a GPU); on the CPU, whose default is exact float32 (what the other tests
             check), TF32 products emulated by tests/tf32.py, so that the GPU's tolerance is
             checked without a GPU;
  bfloat16   bfloat16 inputs at the default precision.

Each output is compared with a float64 reference on the same (rounded) inputs by the relative
error |out - ref| / |ref| (Frobenius norms). TF32 products land near 1e-3 and bfloat16 inputs
near 5e-3 (their outputs are bfloat16 too); a wrong formula, or a decay summed at TF32 (a log
decay of 30 off by 1.5%), misses these tolerances by far.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tf32
from conftest import enable_x64

from linear_transformers import ops
from linear_transformers.ops import precision, softmax
from linear_transformers.ops.gated_linear import chunk_scores, totals

B, T, H, D, M = 2, 48, 2, 16, 8
TOLERANCE = {"default": 5e-3, "bfloat16": 2e-2}
REGIMES = tuple(TOLERANCE)


@contextlib.contextmanager
def _regime(name):
    if name == "default" and jax.default_backend() == "cpu":
        with tf32.tf32_products():
            yield
    else:
        yield


def _dtype(regime):
    return jnp.bfloat16 if regime == "bfloat16" else jnp.float32


def _inputs(seed, regime, *, d=D):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, H, d), (B, T, H, d), (B, T, H, M))
    return tuple(jnp.asarray(rng.standard_normal(s), _dtype(regime)) for s in shapes)


def _relative_error(got, expected):
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(got))
    return np.linalg.norm(got - expected) / np.linalg.norm(expected)


def _check(regime, fast, reference, *arrays):
    """`fast(*arrays)` in the regime against `reference` on the same arrays in float64."""
    with _regime(regime):
        got = jax.jit(fast)(*arrays)
    with enable_x64():
        expected = reference(*(jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), a) for a in arrays))
    error = jax.tree.map(_relative_error, got, expected)
    assert max(jax.tree.leaves(error)) < TOLERANCE[regime], error


def _softmax_implementations():
    forms = [None, "xla", "blocked", "chunked", "reference"]
    return forms + (["cudnn"] if softmax.platform() == "cuda" else [])


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("implementation", _softmax_implementations())
def test_softmax(regime, implementation):
    if implementation == "cudnn" and regime != "bfloat16":
        pytest.skip("cuDNN's flash attention takes half precision only")
    lengths = jnp.array([T, 29], jnp.int32)

    def fast(q, k, v):
        return ops.softmax_attention(q, k, v, causal=True, key_lengths=lengths, implementation=implementation)

    def reference(q, k, v):
        return ops.softmax_attention_reference(q, k, v, causal=True, key_lengths=lengths)

    _check(regime, fast, reference, *_inputs(0, regime, d=M))


@pytest.mark.parametrize("regime", REGIMES)
def test_softmax_gradients(regime):
    q, k, v = _inputs(1, regime, d=M)
    w = _inputs(2, regime, d=M)[2]

    def grads(softmax_fn):
        return lambda q, k, v, w: jax.grad(
            lambda q, k, v: jnp.sum(softmax_fn(q, k, v, causal=True) * w), (0, 1, 2)
        )(q, k, v)

    _check(regime, grads(ops.softmax_attention), grads(ops.softmax_attention_reference), q, k, v, w)


@pytest.mark.parametrize("regime", REGIMES)
def test_kv_cache_prefill_and_step(regime):
    q, k, v = _inputs(3, regime)

    def run(prefill, step):
        def run(q, k, v):
            cache = ops.init_kv_cache(B, T, H, D, M, q.dtype)
            cache, out = prefill(cache, q[:, :-1], k[:, :-1], v[:, :-1])
            return out, step(cache, q[:, -1], k[:, -1], v[:, -1])[1]

        return run

    _check(
        regime,
        run(ops.softmax_attention_prefill, ops.softmax_attention_step),
        run(ops.softmax_attention_prefill_reference, ops.softmax_attention_step_reference),
        q,
        k,
        v,
    )


@pytest.mark.parametrize("regime", REGIMES)
def test_linear(regime):
    lengths = jnp.array([T, 29], jnp.int32)
    _check(
        regime,
        lambda q, k, v: ops.linear_attention(q, k, v, key_lengths=lengths),
        lambda q, k, v: ops.linear_attention_reference(q, k, v, key_lengths=lengths),
        *_inputs(4, regime),
    )


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("impl", ops.LINEAR_IMPLEMENTATIONS)
def test_causal_linear(regime, impl):
    def form(impl):
        return lambda q, k, v: ops.causal_linear_attention(
            q, k, v, implementation=impl, chunk_size=16, return_state=True
        )

    _check(regime, form(impl), form("reference"), *_inputs(5, regime))


@pytest.mark.parametrize("regime", REGIMES)
def test_causal_linear_gradients(regime):
    q, k, v = _inputs(6, regime)
    w = _inputs(7, regime)[2]

    def grads(impl):
        def f(q, k, v):
            return jnp.sum(ops.causal_linear_attention(q, k, v, implementation=impl, chunk_size=16) * w)

        return lambda q, k, v: jax.grad(f, argnums=(0, 1, 2))(q, k, v)

    _check(regime, grads("chunked"), grads("reference"), q, k, v)


def _log_decay(kind, seed):
    """Log decays of each shape the gated op takes: typical gates, and strong ones whose
    cumulative sums over a chunk reach hundreds (the form's exact, blocked path)."""
    rng = np.random.default_rng(seed)
    if kind == "head":
        return jnp.asarray(np.log(1 - 2.0 ** (-5 - np.arange(H))), jnp.float32)
    if kind == "step":
        return jnp.asarray(-rng.uniform(0.0, 1.0, (B, T, H)), jnp.float32)
    if kind == "feature":
        return jnp.asarray(jax.nn.log_sigmoid(rng.standard_normal((B, T, H, D)) + 3) / 4, jnp.float32)
    return jnp.asarray(-rng.uniform(2.0, 20.0, (B, T, H)), jnp.float32)  # "strong"


GATED = [("chunked", kind) for kind in ("head", "step", "feature", "strong")] + [
    ("scan", "feature"),
    ("associative_scan", "step"),
]


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("impl,decay", GATED, ids=lambda x: x)
def test_gated(regime, impl, decay):
    g = _log_decay(decay, 8)

    def form(impl):
        def f(q, k, v, g):
            return ops.gated_linear_attention(
                q, k, v, log_decay=g, implementation=impl, chunk_size=16, return_state=True
            )

        return f

    _check(regime, form(impl), form("reference"), *_inputs(9, regime), g)


@pytest.mark.parametrize("regime", REGIMES)
def test_gated_gradients(regime):
    q, k, v = _inputs(10, regime)
    w = _inputs(11, regime)[2]
    g = _log_decay("step", 12)

    def grads(impl):
        def f(q, k, v, g):
            return jnp.sum(
                ops.gated_linear_attention(q, k, v, log_decay=g, implementation=impl, chunk_size=16) * w
            )

        return lambda q, k, v, g: jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, g)

    _check(regime, grads("chunked"), grads("reference"), q, k, v, g)


@pytest.mark.parametrize("regime", REGIMES)
def test_lsh(regime):
    q, _, v = _inputs(13, regime)
    rotations = ops.lsh_rotations(jax.random.key(0), 2, D, 4)
    _check(
        regime,
        lambda q, v: ops.lsh_attention(q, v, rotations, chunk_size=8, causal=True),
        lambda q, v: ops.lsh_attention_reference(q, v, rotations, chunk_size=8, causal=True),
        q,
        v,
    )


@pytest.mark.parametrize("regime", REGIMES)
def test_linformer(regime):
    q, k, v = _inputs(14, regime)
    rng = np.random.default_rng(15)
    e, f = (jnp.asarray(rng.standard_normal((T, 8)) / np.sqrt(T), jnp.float32) for _ in range(2))

    def fast(q, k, v):
        return ops.linformer_attention(q, k, v, e, f)

    def reference(q, k, v):
        k_BJHD, v_BJHM = ops.linformer_project(k, v, e.astype(k.dtype), f.astype(v.dtype))
        return ops.softmax_attention_reference(q, k_BJHD, v_BJHM)

    _check(regime, fast, reference, q, k, v)


def test_round_to_tf32_rounds_to_the_nearest_tf32_value():
    """`precision.round_to_tf32` (integer operations on the bits) against float64 arithmetic:
    11 significant bits, ties away from zero, TF32's subnormal spacing below 2^-126, inf past
    the largest TF32 value; NaN and inf kept."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    ties = (bits[:2000] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)  # exactly halfway
    x = np.concatenate([bits, ties, np.uint32([0x7F7FFFFF, 0x7F7FEFFF, 0x00000FFF, 0x3F7FF000])])
    x = np.concatenate([x.view(np.float32), np.float32([np.inf, -np.inf, 0.0, -0.0])])
    x = x[~np.isnan(x)]
    got = np.asarray(precision.round_to_tf32(jnp.asarray(x)), np.float64)

    x64 = x.astype(np.float64)
    _, exponent = np.frexp(x64)
    ulp = np.exp2(np.maximum(exponent, -125) - 11)  # 11 significant bits; subnormal below 2^-126
    with np.errstate(invalid="ignore"):
        want = np.sign(x64) * np.floor(np.abs(x64) / ulp + 0.5) * ulp
    want = np.where(np.isfinite(x64), want, x64)
    want[np.abs(want) >= 2.0**128] *= np.inf
    np.testing.assert_array_equal(got, want)
    nans = np.uint32([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001]).view(np.float32)  # 0x7FFFFFFF: CUDA's
    assert np.isnan(np.asarray(precision.round_to_tf32(jnp.asarray(nans)))).all()


@pytest.mark.parametrize(
    "sums",
    [totals.prefix_sum, totals.suffix_sum, chunk_scores.from_midpoint],
    ids=lambda f: f.__name__,
)
def test_the_decays_sums_stay_float32_sums_under_tf32(sums):
    """The cumulative sums of log decays are matmuls with a 0/1 matrix (fast on the CPU); at
    TF32 a sum of 30 would be off by ~1e-2 and its decay by 1.5%. They are pinned to float32
    (`precision.EXACT_SUMS`), so under TF32 products they equal float64 sums to float32
    rounding."""
    g = jnp.asarray(-np.random.default_rng(16).uniform(0.5, 3.0, (2, 64, 3)), jnp.float32)
    with tf32.tf32_products():
        got = jax.jit(lambda g: sums(g, axis=1))(g)
    with enable_x64():
        expected = sums(jnp.asarray(g, jnp.float64), axis=1)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)
    assert float(jnp.max(jnp.abs(expected))) > 30


def test_forms_agree_to_the_products_rounding():
    """`tf32.assert_close` (the README's claims): float32's tolerance at float32 products, TF32's
    (a share of the largest magnitude) where the products round float32 operands."""
    desired = np.linspace(-1.0, 1.0, 8)
    with jax.default_matmul_precision("highest"):
        assert not tf32.rounds_float32_products()
        with pytest.raises(AssertionError):
            tf32.assert_close(desired + 1e-3, desired, atol=1e-5, rtol=1e-5)
    with tf32.tf32_products():
        assert tf32.rounds_float32_products()
        tf32.assert_close(desired + 1e-3, desired, atol=1e-5, rtol=1e-5)
        with pytest.raises(AssertionError, match="at TF32 products"):
            tf32.assert_close(desired + 1e-2, desired, atol=1e-5, rtol=1e-5)
