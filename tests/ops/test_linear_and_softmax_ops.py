"""Non-causal linear attention, softmax attention, their recurrent steps, and the feature maps.

Legend: B batch, T query time, S key time, H heads, D key/query features, F feature-map features,
M value features.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import enable_x64

from linear_transformers import ops

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

B, T, S, H, D, M = 2, 5, 9, 2, 4, 6
EPS = 1e-6


def _qkv(seed, *, t=T, s=S, d=D, m=M, dtype=np.float64, scale=1.0):
    rng = np.random.default_rng(seed)
    q = scale * rng.standard_normal((B, t, H, d))
    k = scale * rng.standard_normal((B, s, H, d))
    v = rng.standard_normal((B, s, H, m))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _np_elu_plus_one(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _np_valid(key_lengths, s):
    """[B, S] bool, True for real keys."""
    if key_lengths is None:
        return np.ones((B, s), bool)
    return np.arange(s)[None, :] < np.asarray(key_lengths)[:, None]


def _np_linear_attention(q, k, v, key_lengths=None, eps=EPS):
    """Explicit kernel formula: out_t = sum_s sim_ts v_s / (sum_s sim_ts + eps), elu + 1."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    valid_BS = _np_valid(key_lengths, k.shape[1])
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            ks, vs = k[b, valid_BS[b], h], v[b, valid_BS[b], h]
            sim_TS = _np_elu_plus_one(q[b, :, h]) @ _np_elu_plus_one(ks).T
            out[b, :, h] = (sim_TS @ vs) / (sim_TS.sum(-1) + eps)[:, None]
    return out


def _np_softmax_attention(q, k, v, *, causal=False, key_lengths=None, mask=None, scale=None):
    """softmax(q k^T * scale) v over the allowed keys, float64; rows with no allowed key are 0
    (the documented rule)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    t, s, d = q.shape[1], k.shape[1], q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    allowed = np.broadcast_to(_np_valid(key_lengths, s)[:, None, None, :], (B, H, t, s)).copy()
    if causal:
        allowed &= np.tril(np.ones((t, s), bool))
    if mask is not None:
        allowed &= np.broadcast_to(np.asarray(mask, bool), (B, H, t, s))
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    logits = np.where(allowed, logits, -np.inf)
    logits = np.where(allowed.any(-1, keepdims=True), logits, 0.0)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    w = np.where(allowed.any(-1, keepdims=True), w, 0.0)
    return np.einsum("bhts,bshm->bthm", w, v)


# ---------------------------------------------------------------- non-causal linear attention


@pytest.mark.parametrize("key_lengths", [None, [S, 4], [0, 7], [1, S]])
def test_linear_attention_matches_reference_and_numpy(x64, key_lengths):
    q, k, v = _qkv(0)
    kl = None if key_lengths is None else jnp.asarray(key_lengths, jnp.int32)
    out = ops.linear_attention(q, k, v, key_lengths=kl)
    assert out.dtype == jnp.float64
    chex.assert_shape(out, (B, T, H, M))
    ref = ops.linear_attention_reference(q, k, v, key_lengths=kl)
    chex.assert_trees_all_close(out, ref, rtol=1e-12, atol=1e-12)
    chex.assert_trees_all_close(out, _np_linear_attention(q, k, v, key_lengths), rtol=1e-12, atol=1e-12)


def test_linear_attention_key_lengths_really_mask(x64):
    """Guards the test above: padding changes the result, and full lengths equal no padding."""
    q, k, v = _qkv(0)
    full = ops.linear_attention(q, k, v)
    chex.assert_trees_all_close(
        ops.linear_attention(q, k, v, key_lengths=jnp.array([S, S])), full, rtol=1e-14, atol=1e-14
    )
    padded = ops.linear_attention(q, k, v, key_lengths=jnp.array([S, 4]))
    chex.assert_trees_all_close(padded[0], full[0], rtol=1e-14, atol=1e-14)
    assert not np.allclose(padded[1], full[1])
    # With no valid key the output is 0 (numerator and denominator are both 0).
    empty = ops.linear_attention(q, k, v, key_lengths=jnp.array([0, S]))
    chex.assert_trees_all_equal(empty[0], jnp.zeros_like(empty[0]))


@pytest.mark.parametrize("feature_map", ["relu", "favor"])
def test_linear_attention_other_feature_maps_match_reference(x64, feature_map):
    q, k, v = _qkv(1)
    if feature_map == "favor":
        feature_map = _favor_fm()
    kl = jnp.array([S, 6])
    out = ops.linear_attention(q, k, v, feature_map=feature_map, key_lengths=kl)
    chex.assert_shape(out, (B, T, H, M))
    ref = ops.linear_attention_reference(q, k, v, feature_map=feature_map, key_lengths=kl)
    chex.assert_trees_all_close(out, ref, rtol=1e-10, atol=1e-12)


def test_linear_attention_under_jit(x64):
    q, k, v = _qkv(2)
    kl = jnp.array([3, S], jnp.int32)
    out = jax.jit(ops.linear_attention)(q, k, v, key_lengths=kl)
    chex.assert_trees_all_close(out, _np_linear_attention(q, k, v, kl), rtol=1e-12, atol=1e-12)


def test_state_from_keys_reused_for_queries(x64):
    """Cross-attention over a fixed memory: one summary state serves every query."""
    q, k, v = _qkv(3)
    kl = jnp.array([S, 5])
    state = ops.linear_state_from_keys(k, v, key_lengths=kl)
    chex.assert_shape([state.s_BHFM, state.z_BHF], [(B, H, D, M), (B, H, D)])
    out = ops.linear_attention_from_state(state, q, out_dtype=v.dtype)
    chex.assert_trees_all_close(out, _np_linear_attention(q, k, v, kl), rtol=1e-12, atol=1e-12)
    one = ops.linear_attention_from_state(state, q[:, 2])  # [B, H, D] queries
    chex.assert_trees_all_close(one, out[:, 2], rtol=1e-12, atol=1e-12)


@functools.lru_cache(maxsize=None)
def _padded_grad_fn():
    def f(q, k, v, kl, w):
        return jnp.sum(ops.linear_attention(q, k, v, key_lengths=kl) * w)

    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))


@pytest.mark.parametrize("garbage", [1e30, np.inf, np.nan])
@pytest.mark.parametrize("op", ["linear_attention", "linear_attention_reference"])
def test_linear_attention_ignores_anything_at_padded_keys(op, garbage):
    """Keys/values at index >= key_lengths[b] may hold huge values, inf or NaN: nothing leaks into
    the output, nor (for the op itself) into the gradients of the real inputs."""
    fn = getattr(ops, op)
    q, k, v = _qkv(4, dtype=np.float32)
    kl = jnp.array([6, 3], jnp.int32)
    pad_BS11 = jnp.asarray(~_np_valid(kl, S))[:, :, None, None]
    k_bad, v_bad = jnp.where(pad_BS11, garbage, k), jnp.where(pad_BS11, -garbage, v)
    fn = jax.jit(fn)
    out, out_bad = fn(q, k, v, key_lengths=kl), fn(q, k_bad, v_bad, key_lengths=kl)
    chex.assert_tree_all_finite(out_bad)
    chex.assert_trees_all_close(out_bad, out, rtol=1e-6, atol=1e-7)
    if op == "linear_attention_reference":
        # The test-only reference masks the [T, S] product after forming it, so its gradient
        # w.r.t. q is 0 * NaN there; only the op proper is hardened for differentiation.
        return

    w = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, H, M)), jnp.float32)
    gq, gk, gv = _padded_grad_fn()(q, k, v, kl, w)
    gq_bad, gk_bad, gv_bad = _padded_grad_fn()(q, k_bad, v_bad, kl, w)
    chex.assert_tree_all_finite(gq_bad)
    chex.assert_trees_all_close(gq_bad, gq, rtol=1e-5, atol=1e-6)
    valid = _np_valid(kl, S)
    for g, g_bad in ((gk, gk_bad), (gv, gv_bad)):
        g, g_bad = np.asarray(g), np.asarray(g_bad)
        for b in range(B):
            chex.assert_tree_all_finite(g_bad[b, valid[b]])
            np.testing.assert_allclose(g_bad[b, valid[b]], g[b, valid[b]], rtol=1e-5, atol=1e-6)
    # Padded values get exactly zero gradient.
    assert np.all(np.asarray(gv_bad)[~valid] == 0)


# ---------------------------------------------------------------- softmax attention

SOFTMAX_IMPLEMENTATIONS = [None, "xla", "reference"]


def _softmax_case(name):
    """(q, k, v, kwargs) for one masking configuration; D == M so every implementation applies."""
    t = S if name.startswith("causal") else T
    q, k, v = _qkv(10, t=t, m=D, dtype=np.float32)
    rng = np.random.default_rng(11)
    kwargs = {
        "plain": {},
        "causal": {"causal": True},
        "key_lengths": {"key_lengths": jnp.array([S, 4], jnp.int32)},
        "mask_B1TS": {"mask": jnp.asarray(rng.random((B, 1, t, S)) < 0.7)},
        "mask_TS": {"mask": jnp.asarray(rng.random((t, S)) < 0.7)},
        "scale": {"scale": 0.37},
        "causal_key_lengths_mask_scale": {
            "causal": True,
            "key_lengths": jnp.array([5, S], jnp.int32),
            "mask": jnp.asarray(rng.random((B, H, t, S)) < 0.8),
            "scale": 1.3,
        },
    }[name]
    return q, k, v, kwargs


SOFTMAX_CASES = [
    "plain",
    "causal",
    "key_lengths",
    "mask_B1TS",
    "mask_TS",
    "scale",
    "causal_key_lengths_mask_scale",
]


@pytest.mark.parametrize("case", SOFTMAX_CASES)
@pytest.mark.parametrize("implementation", SOFTMAX_IMPLEMENTATIONS)
def test_softmax_attention_matches_numpy(implementation, case):
    q, k, v, kwargs = _softmax_case(case)
    out = ops.softmax_attention(q, k, v, implementation=implementation, **kwargs)
    assert out.dtype == jnp.float32
    chex.assert_shape(out, q.shape[:3] + (v.shape[-1],))
    # jax.nn.dot_product_attention works in float32: compare at 1e-5, not 1e-12.
    chex.assert_trees_all_close(out, _np_softmax_attention(q, k, v, **kwargs), rtol=1e-5, atol=1e-5)


def test_softmax_masks_really_mask():
    """Guards the test above: every masking option changes the plain result."""
    q, k, v, _ = _softmax_case("plain")
    plain = ops.softmax_attention(q, k, v)
    for case in ("key_lengths", "mask_B1TS", "scale"):
        _, _, _, kwargs = _softmax_case(case)
        assert not np.allclose(ops.softmax_attention(q, k, v, **kwargs), plain), case
    q, k, v, kwargs = _softmax_case("causal")
    assert not np.allclose(ops.softmax_attention(q, k, v, **kwargs), ops.softmax_attention(q, k, v))


def test_softmax_attention_weights_are_a_distribution():
    q, k, _, _ = _softmax_case("causal")
    kl = jnp.array([5, S], jnp.int32)  # every causal row keeps key 0: no fully masked row
    w = ops.softmax_attention_weights(q, k, causal=True, key_lengths=kl, scale=1.3)
    chex.assert_shape(w, (B, H, S, S))
    chex.assert_trees_all_close(w.sum(-1), jnp.ones((B, H, S)), atol=1e-6)
    assert np.all(np.asarray(w)[..., np.triu(np.ones((S, S), bool), 1)] == 0)  # causal
    assert np.all(np.asarray(w)[1, ..., 5:].sum(-1)[..., 5:] > 0)
    assert np.all(np.asarray(w)[0, ..., 5:] == 0)  # padding


def test_softmax_fully_masked_row_is_zero_in_every_implementation():
    """A row with no allowed key is 0 whichever implementation runs (the library's rule for
    every kind; tests/attention/test_masked_rows.py checks the others)."""
    q, k, v = _qkv(15, m=D, dtype=np.float32)
    kl = jnp.array([0, S], jnp.int32)
    for implementation in SOFTMAX_IMPLEMENTATIONS:
        out = ops.softmax_attention(q, k, v, key_lengths=kl, implementation=implementation)
        chex.assert_tree_all_finite(out)
        np.testing.assert_array_equal(out[0], 0.0)


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_softmax_attention_value_dim_differs(implementation):
    """D != M: dot_product_attention does not apply; None falls back to the reference."""
    q, k, v = _qkv(12, m=M, dtype=np.float32)
    kl = jnp.array([S, 6], jnp.int32)
    out = ops.softmax_attention(q, k, v, key_lengths=kl, implementation=implementation)
    chex.assert_shape(out, (B, T, H, M))
    chex.assert_trees_all_close(out, _np_softmax_attention(q, k, v, key_lengths=kl), rtol=1e-5, atol=1e-5)


def test_softmax_attention_float64_reference_is_exact(x64):
    q, k, v = _qkv(13, m=M)
    out = ops.softmax_attention(q, k, v, causal=False, scale=0.5, implementation="reference")
    assert out.dtype == jnp.float64
    chex.assert_trees_all_close(out, _np_softmax_attention(q, k, v, scale=0.5), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implementation", SOFTMAX_IMPLEMENTATIONS)
def test_softmax_attention_ignores_padded_keys(implementation):
    q, k, v = _qkv(14, m=D, dtype=np.float32)
    kl = jnp.array([7, 2], jnp.int32)
    pad_BS11 = jnp.asarray(~_np_valid(kl, S))[:, :, None, None]
    k_bad, v_bad = jnp.where(pad_BS11, 1e4, k), jnp.where(pad_BS11, -1e30, v)
    out = ops.softmax_attention(q, k, v, key_lengths=kl, implementation=implementation)
    out_bad = ops.softmax_attention(q, k_bad, v_bad, key_lengths=kl, implementation=implementation)
    chex.assert_tree_all_finite(out_bad)
    chex.assert_trees_all_close(out_bad, out, rtol=1e-6, atol=1e-6)
    assert not np.allclose(ops.softmax_attention(q, k_bad, v_bad, implementation=implementation), out)


def test_softmax_attention_under_jit():
    q, k, v, kwargs = _softmax_case("causal_key_lengths_mask_scale")
    fn = jax.jit(functools.partial(ops.softmax_attention, causal=True, scale=1.3, implementation="xla"))
    out = fn(q, k, v, key_lengths=kwargs["key_lengths"], mask=kwargs["mask"])
    chex.assert_trees_all_close(out, _np_softmax_attention(q, k, v, **kwargs), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- recurrent steps


@functools.lru_cache(maxsize=None)
def _favor_fm():
    """FAVOR+ with F = 10 != D = 4 (the last orthogonal block is partial). Drawn once: the QR runs
    op by op and every new shape compiles."""
    with enable_x64():  # every eager FAVOR draw in this file runs in x64: one set of compiles
        return ops.make_feature_map("favor", key=jax.random.key(5), head_dim=D, num_features=10)


@pytest.mark.parametrize("feature_map", ["elu", "favor"])
def test_linear_attention_step_loop_equals_causal(x64, feature_map):
    fm = _favor_fm() if feature_map == "favor" else ops.make_feature_map(feature_map)
    F = fm.num_features(D)
    q, k, v = _qkv(20, t=S)
    state = ops.init_linear_state(B, H, F, M, dtype=jnp.float64)
    outs = []
    for t in range(S):
        state, out_t = ops.linear_attention_step(state, q[:, t], k[:, t], v[:, t], feature_map=fm)
        chex.assert_shape(out_t, (B, H, M))
        outs.append(out_t)
    expected = ops.causal_linear_attention(q, k, v, feature_map=fm, implementation="reference")
    chex.assert_trees_all_close(jnp.stack(outs, axis=1), expected, rtol=1e-10, atol=1e-12)
    # The final state is the summary of all keys.
    chex.assert_trees_all_close(
        tuple(state), tuple(ops.linear_state_from_keys(k, v, feature_map=fm)), rtol=1e-12, atol=1e-12
    )


def test_linear_attention_step_under_jitted_scan(x64):
    q, k, v = _qkv(21, t=S)

    @jax.jit
    def run(q, k, v):
        def body(state, qkv_t):
            return ops.linear_attention_step(state, *qkv_t)

        state = ops.init_linear_state(B, H, D, M, dtype=q.dtype)
        _, out_SBHM = jax.lax.scan(body, state, tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
        return jnp.swapaxes(out_SBHM, 0, 1)

    expected = ops.causal_linear_attention(q, k, v, implementation="reference")
    chex.assert_trees_all_close(run(q, k, v), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("max_length,scale", [(S, None), (S + 3, 0.6)])
def test_softmax_attention_step_loop_equals_causal(max_length, scale):
    q, k, v = _qkv(22, t=S, m=M, dtype=np.float32)
    cache = ops.init_kv_cache(B, max_length, H, D, M)
    outs = []
    for t in range(S):
        cache, out_t = ops.softmax_attention_step(cache, q[:, t], k[:, t], v[:, t], scale=scale)
        chex.assert_shape(out_t, (B, H, M))
        outs.append(out_t)
    assert int(cache.length) == S
    expected = ops.softmax_attention(q, k, v, causal=True, scale=scale)
    chex.assert_trees_all_close(jnp.stack(outs, axis=1), expected, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(cache.k_BSHD[:, :S], k)


def test_softmax_attention_step_under_jitted_scan():
    q, k, v = _qkv(23, t=S, m=D, dtype=np.float32)

    @jax.jit
    def run(q, k, v):
        def body(cache, qkv_t):
            return ops.softmax_attention_step(cache, *qkv_t)

        cache = ops.init_kv_cache(B, S, H, D, D)
        _, out_SBHM = jax.lax.scan(body, cache, tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
        return jnp.swapaxes(out_SBHM, 0, 1)

    expected = ops.softmax_attention(q, k, v, causal=True, implementation="xla")
    chex.assert_trees_all_close(run(q, k, v), expected, rtol=1e-5, atol=1e-5)


def test_softmax_attention_step_bfloat16_cache():
    q, k, v = _qkv(24, t=S, m=M, dtype=jnp.bfloat16)
    cache = ops.init_kv_cache(B, S, H, D, M, dtype=jnp.bfloat16)
    step = jax.jit(ops.softmax_attention_step)
    outs = []
    for t in range(S):
        cache, out_t = step(cache, q[:, t], k[:, t], v[:, t])
        outs.append(out_t)
    assert cache.k_BSHD.dtype == cache.v_BSHM.dtype == jnp.bfloat16
    out = jnp.stack(outs, axis=1)
    assert out.dtype == jnp.bfloat16
    chex.assert_tree_all_finite(out)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    expected = _np_softmax_attention(q32, k32, v32, causal=True)
    chex.assert_trees_all_close(out.astype(jnp.float32), expected, rtol=2e-2, atol=2e-2)


def test_softmax_attention_step_full_cache():
    q, k, v = _qkv(25, t=3, s=3, m=D, dtype=np.float32)
    cache = ops.init_kv_cache(B, 2, H, D, D)
    for t in range(2):
        cache, _ = ops.softmax_attention_step(cache, q[:, t], k[:, t], v[:, t])
    with pytest.raises(ValueError, match="full"):
        ops.softmax_attention_step(cache, q[:, 2], k[:, 2], v[:, 2])
    # Under jit the overflow cannot raise; the documented NaN output flags it instead.
    _, out = jax.jit(ops.softmax_attention_step)(cache, q[:, 2], k[:, 2], v[:, 2])
    assert np.all(np.isnan(np.asarray(out)))


# ---------------------------------------------------------------- feature maps


def test_elu_plus_one_matches_elu_formula(x64):
    x = jnp.linspace(-30.0, 30.0, 601, dtype=jnp.float64)
    chex.assert_trees_all_close(ops.elu_plus_one(x), jax.nn.elu(x) + 1, rtol=1e-12, atol=1e-14)
    chex.assert_trees_all_close(ops.elu_plus_one(x), _np_elu_plus_one(np.asarray(x)), rtol=1e-15)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_elu_plus_one_positive_for_very_negative_inputs(dtype):
    x = jnp.asarray([-20.0, -10.0, -7.0], dtype)
    y = ops.elu_plus_one(x)
    assert y.dtype == dtype
    if dtype == jnp.float16:  # exp(-20) = 2e-9 is below float16's smallest subnormal
        x, y = x[1:], y[1:]
    assert np.all(np.asarray(y, np.float32) > 0)
    np.testing.assert_allclose(np.asarray(y, np.float64), np.exp(np.asarray(x, np.float64)), rtol=1e-2)


def test_elu_plus_one_bfloat16_extremes():
    y = ops.elu_plus_one(jnp.asarray([-80.0], jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(y, np.float64), np.exp(-80.0), rtol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_elu_plus_one_gradient_finite(dtype):
    x = jnp.asarray([100.0, 1e4, 3.0, 0.5, -0.5, -20.0, -100.0], dtype)
    g = jax.vmap(jax.grad(lambda x: ops.elu_plus_one(x)))(x)
    assert g.dtype == dtype
    chex.assert_tree_all_finite(g)
    x64 = np.asarray(x, np.float64)
    expected = np.where(x64 > 0, 1.0, np.exp(np.minimum(x64, 0.0)))
    np.testing.assert_allclose(np.asarray(g, np.float64), expected, rtol=1e-2, atol=1e-30)


@functools.lru_cache(maxsize=None)
def _big_projection(orthogonal):
    # Under jit: 1024 QR blocks op by op would be slow.
    draw = jax.jit(ops.favor_projection, static_argnums=(1, 2), static_argnames="orthogonal")
    return draw(jax.random.key(7), 4096, 4, orthogonal=orthogonal)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_favor_approximates_softmax_kernel(orthogonal):
    """F = 4096 positive random features, D = 4, |x| <= 0.7: phi(q).phi(k) ~ exp(q.k/sqrt(D))
    within a few per cent (the estimator's relative sd here is ~1%)."""
    fm = ops.make_feature_map("favor", projection=_big_projection(orthogonal))
    rng = np.random.default_rng(30)
    x = rng.standard_normal((2, 6, 4))
    x = 0.7 * x / np.linalg.norm(x, axis=-1, keepdims=True) * rng.uniform(0.2, 1, (2, 6, 1))
    q, k = jnp.asarray(x[0], jnp.float32), jnp.asarray(x[1], jnp.float32)
    phi_q, phi_k = fm(q), fm(k)
    chex.assert_shape([phi_q, phi_k], [(6, 4096)] * 2)
    assert np.all(np.asarray(phi_q) > 0)
    approx = np.asarray(phi_q @ phi_k.T, np.float64)
    exact = np.exp(x[0] @ x[1].T / math.sqrt(4))
    np.testing.assert_allclose(approx, exact, rtol=0.06)


@pytest.mark.parametrize("orthogonal", [True, False])
def test_favor_projection_rows_are_isotropic(orthogonal):
    """Each row must be marginally N(0, I) for the estimator to be unbiased: zero mean, unit
    variance per coordinate (4096 rows: sampling sd of the mean ~0.016)."""
    w = np.asarray(_big_projection(orthogonal), np.float64)
    np.testing.assert_allclose(w.var(0), 1.0, atol=0.1)
    np.testing.assert_allclose(w.mean(0), 0.0, atol=0.08)


def test_favor_query_map_differs_by_a_per_query_constant():
    fm = ops.make_feature_map("favor", projection=_big_projection(False))
    q = jnp.asarray(np.random.default_rng(31).standard_normal((5, 4)), jnp.float32)
    ratio = np.asarray(fm.query(q), np.float64) / np.asarray(fm(q), np.float64)
    np.testing.assert_allclose(ratio, np.broadcast_to(ratio[:, :1], ratio.shape), rtol=1e-4)
    assert not np.allclose(ratio, 1.0)


def test_favor_make_feature_map_with_key(x64):
    fm = _favor_fm()
    assert isinstance(fm, ops.FavorFeatureMap)
    assert fm.num_features(D) == 10
    chex.assert_shape(fm(jnp.ones((3, D))), (3, 10))
    same = ops.make_feature_map("favor", key=jax.random.key(5), head_dim=D, num_features=10)
    chex.assert_trees_all_equal(fm.projection_FD, same.projection_FD)  # explicit RNG: reproducible
    other = ops.make_feature_map("favor", key=jax.random.key(9), head_dim=D, num_features=10)
    assert not np.allclose(fm.projection_FD, other.projection_FD)
    assert "favor" in ops.registered_feature_maps()


@pytest.mark.parametrize("seed", [10, 11])
def test_favor_projection_orthogonal_blocks(x64, seed):
    # F = 10, D = 4: two full blocks and a partial one. (Same shapes as `_favor_fm`, in x64 like
    # it, so the op-by-op QR is compiled once for the file.)
    num_features, head_dim = 10, D
    w = np.asarray(ops.favor_projection(jax.random.key(seed), num_features, head_dim), np.float64)
    assert w.shape == (num_features, head_dim)
    norms = np.linalg.norm(w, axis=-1)
    assert np.all(norms > 0)
    for start in range(0, num_features, head_dim):
        block = w[start : start + head_dim]
        unit = block / np.linalg.norm(block, axis=-1, keepdims=True)
        np.testing.assert_allclose(unit @ unit.T, np.eye(len(block)), atol=1e-5)
    if num_features > head_dim:  # rows from different blocks are independent, not orthogonal
        unit = w / norms[:, None]
        cos = np.abs(unit[:head_dim] @ unit[head_dim:].T)
        assert cos.max() > 1e-3
    # Row norms follow the chi distribution of Gaussian rows, not all equal to 1.
    assert np.ptp(norms) > 1e-3
    plain = ops.favor_projection(jax.random.key(seed), num_features, head_dim, orthogonal=False)
    chex.assert_shape(plain, (num_features, head_dim))


def _unstabilised(fm):
    """The same FAVOR+ features with the key map (no stabiliser) for queries too."""
    return ops.CallableFeatureMap(fm.__call__, "favor_unstabilised")


def test_favor_query_stabiliser_cancels_exactly_without_eps(x64):
    fm = _favor_fm()
    q, k, v = _qkv(31, t=S, scale=2.0)
    op = jax.jit(ops.causal_linear_attention, static_argnames=("feature_map", "eps"))
    stab = op(q, k, v, feature_map=fm, eps=0.0)
    plain = op(q, k, v, feature_map=_unstabilised(fm), eps=0.0)
    chex.assert_trees_all_close(stab, plain, rtol=1e-10, atol=1e-12)
    assert not np.allclose(fm.query(q), fm(q))  # the stabiliser really rescales phi(q)


@pytest.mark.parametrize("causal", [True, False])
def test_favor_query_stabiliser_does_not_change_output(causal):
    """With the default eps and moderate inputs the stabiliser's factor cancels to 1e-5."""
    fm = _favor_fm()
    q, k, v = _qkv(32, t=S, dtype=np.float32, scale=0.5)
    op = (
        functools.partial(ops.causal_linear_attention, implementation="chunked", chunk_size=4)
        if causal
        else ops.linear_attention
    )
    op = jax.jit(op, static_argnames="feature_map")
    stab, plain = op(q, k, v, feature_map=fm), op(q, k, v, feature_map=_unstabilised(fm))
    rel = np.linalg.norm(np.asarray(stab - plain), axis=-1) / np.linalg.norm(np.asarray(plain), axis=-1)
    assert rel.max() < 1e-5, rel.max()
