"""Causal linear attention: every impl equals the quadratic reference (values and gradients).

Legend: B batch, T time, H heads, D key/query features, F feature-map features, M value features.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import chunk_size_for

from linear_transformers import ops

B, H, D, M = 2, 2, 4, 6  # M != D throughout
F_FAVOR = 10  # != D and not a multiple of D: the last orthogonal block is partial

# (T, chunk_size): T a multiple of C, T not a multiple of C, T < C, T == 1, C == 1, default C.
LENGTHS_AND_CHUNKS = [(1, 4), (5, 8), (16, 8), (37, 8), (13, 1), (70, 64)]
FEATURE_MAPS = ["elu", "relu", "favor", "softplus"]


@functools.lru_cache(maxsize=None)
def _favor_map():
    """Drawn once (the op-by-op QR compiles on first use)."""
    fm = ops.make_feature_map("favor", key=jax.random.key(42), head_dim=D, num_features=F_FAVOR)
    assert fm.num_features(D) == F_FAVOR
    return fm


def _feature_map(name):
    """The spec passed to the op, and an independent numpy version (query_fn, key_fn)."""
    if name == "elu":
        f = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))  # noqa: E731
        return "elu", f, f
    if name == "relu":
        f = lambda x: np.maximum(x, 0.0)  # noqa: E731
        return "relu", f, f
    if name == "softplus":
        return (
            (lambda x: jax.nn.softplus(x)),
            (lambda x: np.logaddexp(0.0, x)),
            (lambda x: np.logaddexp(0.0, x)),
        )
    if name == "favor":
        fm = _favor_map()
        w_FD = np.asarray(fm.projection_FD, np.float64)

        def exponent(x):
            x = x * x.shape[-1] ** -0.25
            return x @ w_FD.T - 0.5 * np.sum(x * x, axis=-1, keepdims=True)

        def key_fn(x):
            return np.exp(exponent(x)) / np.sqrt(F_FAVOR)

        def query_fn(x):
            e = exponent(x)
            return np.exp(e - e.max(axis=-1, keepdims=True)) / np.sqrt(F_FAVOR)

        return fm, query_fn, key_fn
    raise AssertionError(name)


def _inputs(seed, T, dtype=np.float64, scale=1.0):
    rng = np.random.default_rng(seed)
    q = scale * rng.standard_normal((B, T, H, D))
    k = scale * rng.standard_normal((B, T, H, D))
    v = rng.standard_normal((B, T, H, M))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _numpy_causal(q, k, v, query_fn, key_fn, eps=1e-6):
    """The RNN form in numpy float64: prefix sums of phi(k) v^T and phi(k)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    phi_q, phi_k = query_fn(q), key_fn(k)
    s_BTHFM = np.cumsum(phi_k[..., :, None] * v[..., None, :], axis=1)
    z_BTHF = np.cumsum(phi_k, axis=1)
    num = np.einsum("bthf,bthfm->bthm", phi_q, s_BTHFM)
    den = np.einsum("bthf,bthf->bth", phi_q, z_BTHF)
    return num / (den + eps)[..., None]


@functools.lru_cache(maxsize=None)
def _op(impl, chunk_size=ops.DEFAULT_CHUNK_SIZE, fm_name="elu", jit=True):
    """The op with static kwargs bound; jitted functions are cached so equal shapes reuse a
    compile (XLA compiles dominate this file's run time on CPU)."""
    fn = functools.partial(
        ops.causal_linear_attention,
        implementation=impl,
        chunk_size=chunk_size_for(impl, chunk_size),
        feature_map=_feature_map(fm_name)[0],
    )
    return jax.jit(fn) if jit else fn


@functools.lru_cache(maxsize=None)
def _grad_fn(impl, chunk_size, fm_name):
    """jit(grad) of sum(out * w) w.r.t. q, k, v."""
    op = _op(impl, chunk_size, fm_name, jit=False)
    return jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(op(q, k, v) * w), argnums=(0, 1, 2)))


@functools.lru_cache(maxsize=None)
def _quadratic_expected(seed, T, fm_name, dtype=np.float64):
    """The quadratic reference on `_inputs(seed, T, dtype)`, computed in float32 or wider."""
    inputs = (x.astype(jnp.promote_types(dtype, jnp.float32)) for x in _inputs(seed, T, dtype))
    return _op("reference", fm_name=fm_name)(*inputs)


def _grad_weights(T):
    """Coefficients of a random linear functional of the output."""
    return jnp.asarray(np.random.default_rng(100 + T).standard_normal((B, T, H, M)))


@functools.lru_cache(maxsize=None)
def _quadratic_grads(seed, T, fm_name):
    return _grad_fn("reference", ops.DEFAULT_CHUNK_SIZE, fm_name)(*_inputs(seed, T), _grad_weights(T))


def test_impls_cover_the_documented_set():
    assert set(ops.LINEAR_IMPLEMENTATIONS) == {"reference", "associative_scan", "chunked", "scan", "pallas"}


@pytest.mark.parametrize("fm_name,T", [("elu", 1)] + [(fm, 37) for fm in FEATURE_MAPS])
def test_quadratic_matches_numpy_rnn_form(x64, fm_name, T):
    """The reference itself against an independent numpy prefix-sum computation."""
    _, query_fn, key_fn = _feature_map(fm_name)
    q, k, v = _inputs(1, T)
    out = _quadratic_expected(1, T, fm_name)
    assert out.dtype == jnp.float64
    chex.assert_shape(out, (B, T, H, M))
    chex.assert_trees_all_close(out, _numpy_causal(q, k, v, query_fn, key_fn), rtol=1e-10, atol=1e-10)


# chunk_size only matters to "chunked": it gets every (T, C) pair, the others several T.
# ("reference" is checked under jit against numpy above.)
ELU_CASES = [("chunked", T, c) for T, c in LENGTHS_AND_CHUNKS] + [
    (impl, T, 8) for impl in ("associative_scan", "scan") for T in (1, 37)
]


@pytest.mark.parametrize("impl,T,chunk_size", ELU_CASES)
def test_impl_matches_quadratic_elu_under_jit(x64, impl, T, chunk_size):
    q, k, v = _inputs(1, T)
    out = _op(impl, chunk_size)(q, k, v)
    assert out.dtype == jnp.float64
    chex.assert_shape(out, (B, T, H, M))
    chex.assert_trees_all_close(out, _quadratic_expected(1, T, "elu"), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ops.LINEAR_IMPLEMENTATIONS)
def test_impl_matches_quadratic_eagerly(x64, impl):
    """Without jit (op by op, which is slow on CPU: one short case)."""
    T = 5
    q, k, v = _inputs(1, T)
    out = _op(impl, 2, jit=False)(q, k, v)
    assert out.dtype == jnp.float64
    chex.assert_shape(out, (B, T, H, M))
    chex.assert_trees_all_close(out, _quadratic_expected(1, T, "elu"), rtol=1e-10, atol=1e-10)


# The pallas kernel prepares its inputs itself with a pointwise map (relu), XLA does before it
# with any other (favor, and softplus, a plain callable).
FM_CASES = [(impl, "favor") for impl in ("associative_scan", "chunked", "scan", "pallas")] + [
    (impl, fm) for impl in ("chunked", "pallas") for fm in ("relu", "softplus")
]


@pytest.mark.parametrize("impl,fm_name", FM_CASES)
def test_impl_matches_quadratic_feature_maps(x64, impl, fm_name):
    T, chunk_size = 37, 8
    _, query_fn, key_fn = _feature_map(fm_name)
    q, k, v = _inputs(1, T)
    out = _op(impl, chunk_size, fm_name)(q, k, v)
    chex.assert_shape(out, (B, T, H, M))
    chex.assert_trees_all_close(out, _quadratic_expected(1, T, fm_name), rtol=1e-10, atol=1e-10)
    chex.assert_trees_all_close(out, _numpy_causal(q, k, v, query_fn, key_fn), rtol=1e-9, atol=1e-9)


GRAD_CASES = (
    [("chunked", T, c, "elu") for T, c in [(1, 4), (13, 1), (13, 4)]]
    + [(impl, 13, 4, "elu") for impl in ("associative_scan", "scan")]
    + [(impl, 13, 4, fm) for impl in ("chunked", "pallas") for fm in ("favor", "relu")]
)


@pytest.mark.parametrize("impl,T,chunk_size,fm_name", GRAD_CASES)
def test_impl_gradients_match_quadratic(x64, impl, T, chunk_size, fm_name):
    q, k, v = _inputs(3, T)
    expected = _quadratic_grads(3, T, fm_name)
    got = _grad_fn(impl, chunk_size, fm_name)(q, k, v, _grad_weights(T))
    # The functional really depends on every input (with one step only on v: out_0 = v_0).
    for g in expected if T > 1 else expected[2:]:
        assert float(jnp.max(jnp.abs(g))) > 1e-3
    chex.assert_trees_all_close(got, expected, rtol=1e-8, atol=1e-10)


BF16_CASES = [(impl, "elu") for impl in ops.LINEAR_IMPLEMENTATIONS] + [("chunked", "favor")]


@pytest.mark.parametrize("impl,fm_name", BF16_CASES)
def test_bfloat16_inputs(impl, fm_name):
    T, chunk_size = 37, 8
    q, k, v = _inputs(7, T, dtype=jnp.bfloat16)
    out = _op(impl, chunk_size, fm_name)(q, k, v)
    assert out.dtype == jnp.bfloat16
    chex.assert_shape(out, (B, T, H, M))
    chex.assert_tree_all_finite(out)
    # Reference: the same (bf16-rounded) inputs in float32.
    expected = _quadratic_expected(7, T, fm_name, jnp.bfloat16)
    assert expected.dtype == jnp.float32
    chex.assert_trees_all_close(out.astype(jnp.float32), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["chunked"])
def test_causality_by_gradients(impl):
    """Output t has exactly zero gradient w.r.t. q at s != t and w.r.t. k, v at s > t."""
    T, chunk_size = 14, 4  # crosses chunk boundaries and has a padded tail
    q, k, v = _inputs(8, T, dtype=jnp.float32)
    grad_fn = _grad_fn(impl, chunk_size, "elu")
    w_full = jnp.asarray(np.random.default_rng(9).standard_normal((B, T, H, M)), jnp.float32)
    for t in (0, 2, 3, 4, 9, 13):
        w = w_full * (jnp.arange(T) == t)[None, :, None, None]
        gq, gk, gv = (np.asarray(g) for g in grad_fn(q, k, v, w))
        others = np.arange(T) != t
        assert np.all(gq[:, others] == 0), (t, np.abs(gq[:, others]).max())
        assert np.all(gk[:, t + 1 :] == 0), (t, np.abs(gk[:, t + 1 :]).max())
        assert np.all(gv[:, t + 1 :] == 0), (t, np.abs(gv[:, t + 1 :]).max())
        # ...and the dependence on the past is really there.
        assert np.all(np.abs(gq[:, t]).max(axis=(-1, -2)) > 0)
        assert np.all(np.abs(gv[:, : t + 1]).max(axis=(0, -1, -2)) > 0)
        if t > 0:  # with a single key the output is v_0 whatever k_0 is
            assert np.all(np.abs(gk[:, : t + 1]).max(axis=(0, -1, -2)) > 0)


@pytest.mark.parametrize("impl", ops.LINEAR_IMPLEMENTATIONS)
def test_future_inputs_do_not_change_past_outputs(impl):
    """Causality by values: outputs up to t are bit-identical whatever comes after t.

    (An exclusive prefix of chunk states computed as cumsum(kv) - kv lets a chunk's own later
    steps into its earlier outputs up to rounding, ~1e-3 relative with these magnitudes.)
    """
    T, t = 19, 10  # chunk_size 4: step 11 is in the same chunk as step 10
    q, k, v = _inputs(10, T, dtype=jnp.float32)
    rng = np.random.default_rng(11)
    later = (jnp.arange(T) > t)[None, :, None, None]
    q2, k2, v2 = (
        jnp.where(later, jnp.asarray(100 * rng.standard_normal(x.shape), x.dtype), x) for x in (q, k, v)
    )
    op = _op(impl, 4)
    out, out2 = op(q, k, v), op(q2, k2, v2)
    assert not np.allclose(out[:, t + 1 :], out2[:, t + 1 :])
    chex.assert_trees_all_equal(out[:, : t + 1], out2[:, : t + 1])


def test_default_chunk_size_and_impl_under_jit(x64):
    q, k, v = _inputs(1, 70)
    out = jax.jit(ops.causal_linear_attention)(q, k, v)
    chex.assert_trees_all_close(out, _quadratic_expected(1, 70, "elu"), rtol=1e-10, atol=1e-10)


def test_static_kwargs_via_static_argnames(x64):
    q, k, v = _inputs(1, 37)
    fn = jax.jit(ops.causal_linear_attention, static_argnames=("implementation", "chunk_size", "feature_map"))
    chex.assert_trees_all_close(
        fn(q, k, v, implementation="chunked", chunk_size=5, feature_map="elu"),
        _quadratic_expected(1, 37, "elu"),
        rtol=1e-10,
        atol=1e-10,
    )


@pytest.mark.parametrize("T,chunk_size", [(11, 4), (12, 12), (6, 1)])
def test_chunked_gradients_match_numerical_derivatives(x64, T, chunk_size):
    """Independent of the quadratic reference: finite differences of the chunked form itself."""
    q, k, v = _inputs(12, T, scale=0.5)
    jax.test_util.check_grads(
        lambda q, k, v: ops.causal_linear_attention(q, k, v, implementation="chunked", chunk_size=chunk_size),
        (q, k, v),
        order=1,
        modes=["rev"],
        atol=1e-6,
        rtol=1e-6,
    )


def test_bfloat16_gradients_are_bfloat16_and_close_to_float32():
    T, chunk_size = 37, 8
    q, k, v = _inputs(13, T, dtype=jnp.bfloat16)
    w = _grad_weights(T).astype(jnp.bfloat16)
    got = _grad_fn("chunked", chunk_size, "elu")(q, k, v, w)
    assert all(g.dtype == jnp.bfloat16 for g in got)
    chex.assert_tree_all_finite(got)
    expected = _grad_fn("reference", chunk_size, "elu")(*(x.astype(jnp.float32) for x in (q, k, v, w)))
    for g, e in zip(got, expected):
        scale = float(jnp.max(jnp.abs(e)))
        chex.assert_trees_all_close(g.astype(jnp.float32), e, atol=2e-2 * scale, rtol=0)


@pytest.mark.parametrize("segment", [None, 8, 12, 1000])
@pytest.mark.parametrize("T,chunk_size", [(37, 4), (1, 4), (24, 4), (9, 16)])
def test_segmented_chunked_form_matches_quadratic(x64, monkeypatch, segment, T, chunk_size):
    """The chunked form scanned over segments (CPU) or all at once (GPU): same values, same grads."""
    from linear_transformers.ops.gated_linear import chunked

    monkeypatch.setattr(chunked, "segment_length", lambda platform=None: segment)
    q, k, v = _inputs(14, T)
    w = _grad_weights(T)

    def loss(q, k, v):
        out = ops.causal_linear_attention(q, k, v, implementation="chunked", chunk_size=chunk_size)
        return jnp.sum(out * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    chex.assert_trees_all_close(out, _quadratic_expected(14, T, "elu"), rtol=1e-10, atol=1e-12)
    expected = jax.grad(
        lambda q, k, v: jnp.sum(ops.causal_linear_attention(q, k, v, implementation="reference") * w),
        argnums=(0, 1, 2),
    )(q, k, v)
    chex.assert_trees_all_close(grads, expected, rtol=1e-8, atol=1e-10)
