"""The CPU's fast layouts against the plain formulas: blocked softmax attention
(ops/softmax_blocked.py) and non-causal linear attention with heads merged into the batch
(ops/linear.py), values and gradients.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops
from linear_transformers.ops import softmax_blocked
from linear_transformers.ops.feature_maps import FavorFeatureMap, favor_projection

# B and H above 1 and unequal, so that mixing up the batch and the heads shows; D != M.
B, H, D, M = 2, 3, 4, 5


def _qkv(seed, t, s, *, m=M, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, n, H, D)) for n in (t, s))
    v = rng.standard_normal((B, s, H, m))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _value_and_grads(fn, q, k, v, seed=99):
    """fn(q, k, v) and the gradients of <fn(q, k, v), g> for a random cotangent g."""
    out, vjp = jax.vjp(fn, q, k, v)
    g = jnp.asarray(np.random.default_rng(seed).standard_normal(out.shape), out.dtype)
    return out, vjp(g)


def _assert_agree(fast, slow, q, k, v, tol):
    out, grads = _value_and_grads(fast, q, k, v)
    ref, ref_grads = _value_and_grads(slow, q, k, v)
    chex.assert_tree_all_finite((out, grads))
    chex.assert_trees_all_close(out, ref, rtol=tol, atol=tol)
    chex.assert_trees_all_close(grads, ref_grads, rtol=tol, atol=tol)


# ---------------------------------------------------------------- blocked softmax attention

T = 7  # not a multiple of the blocks below: the last block is shorter


def _softmax_kwargs(case, t, s):
    rng = np.random.default_rng(5)
    return {
        "plain": {},
        "causal": {"causal": True},
        "key_lengths": {"key_lengths": jnp.array([s - 2, 0], jnp.int32)},
        "mask_TS": {"mask": jnp.asarray(rng.random((t, s)) > 0.3)},
        # query 0 of batch 1 sees no key: its row is 0, gradients finite
        "mask_BHTS": {"mask": jnp.asarray(rng.random((B, H, t, s)) > 0.4).at[1, :, 0].set(False)},
        "mask_B11S": {"mask": jnp.asarray(rng.random((B, 1, 1, s)) > 0.3)},
        "scale": {"scale": 0.37},
        "causal_everything": {
            "causal": True,
            "key_lengths": jnp.array([s, 3], jnp.int32),
            "mask": jnp.asarray(rng.random((B, 1, t, s)) > 0.2),
            "scale": 1.3,
        },
        "segments": {"segment_ids": jnp.array([[1, 1, 2, 2, 2, 3, 0], [1, 2, 2, 2, 2, 0, 0]], jnp.int32)},
        "causal_segments": {
            "causal": True,
            "segment_ids": jnp.array([[1, 1, 1, 2, 2, 2, 2], [4, 4, 5, 5, 5, 5, 0]], jnp.int32),
        },
    }[case]


SOFTMAX_CASES = [
    "plain",
    "causal",
    "key_lengths",
    "mask_TS",
    "mask_BHTS",
    "mask_B11S",
    "scale",
    "causal_everything",
    "segments",
    "causal_segments",
]


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("case", SOFTMAX_CASES)
def test_blocked_softmax_matches_reference_values_and_grads(x64, case, block_size):
    s = T if "causal" in case or "segments" in case else 6
    q, k, v = _qkv(0, T, s)
    kwargs = _softmax_kwargs(case, T, s)

    def fast(q, k, v):
        blocked = softmax_blocked.blocked_softmax_attention
        if "segments" in case:  # segments reach the blocked form as a mask, via the op
            return ops.softmax_attention(q, k, v, implementation="blocked", **kwargs)
        return blocked(q, k, v, block_size=block_size, **kwargs)

    def slow(q, k, v):
        return ops.softmax_attention_reference(q, k, v, **kwargs)

    _assert_agree(fast, slow, q, k, v, tol=1e-10)


def test_blocked_softmax_default_blocks_match_reference(x64):
    """Default block sizes, several blocks (T = 600 > 256), causal with padding."""
    q, k, v = _qkv(1, 600, 600, m=2)
    kwargs = {"causal": True, "key_lengths": jnp.array([600, 301], jnp.int32)}
    assert softmax_blocked.default_block_size(600) < 600

    def fast(q, k, v):
        return softmax_blocked.blocked_softmax_attention(q, k, v, **kwargs)

    def slow(q, k, v):
        return ops.softmax_attention_reference(q, k, v, **kwargs)

    _assert_agree(fast, slow, q, k, v, tol=1e-10)


def test_blocked_softmax_scale_gradient(x64):
    """A traced scale (a learnt temperature) gets the reference's gradient."""
    q, k, v = _qkv(2, T, T)

    def loss(scale, impl):
        out = ops.softmax_attention(q, k, v, causal=True, scale=scale, implementation=impl)
        return jnp.sum(out * jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))

    fast, slow = (jax.grad(loss)(jnp.asarray(0.7), impl) for impl in ("blocked", "reference"))
    chex.assert_trees_all_close(fast, slow, rtol=1e-10)
    assert abs(float(fast)) > 1e-3


def test_blocked_softmax_no_key_rows_are_zero_with_finite_grads():
    q, k, v = _qkv(3, T, 6, dtype=jnp.float32)
    kl = jnp.array([0, 6], jnp.int32)
    out, grads = _value_and_grads(
        lambda q, k, v: softmax_blocked.blocked_softmax_attention(q, k, v, key_lengths=kl, block_size=3),
        q,
        k,
        v,
    )
    np.testing.assert_array_equal(out[0], 0.0)
    chex.assert_tree_all_finite(grads)
    np.testing.assert_array_equal(grads[0][0], 0.0)  # dq of the rows that see nothing


def test_blocked_softmax_bfloat16_accumulates_in_float32():
    q, k, v = _qkv(4, 64, 64, dtype=jnp.bfloat16)
    out = softmax_blocked.blocked_softmax_attention(q, k, v, causal=True, block_size=16)
    assert out.dtype == jnp.bfloat16
    ref = ops.softmax_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    # one bfloat16 rounding of the output (2^-8 relative), nothing accumulated in bfloat16
    chex.assert_trees_all_close(out.astype(jnp.float32), ref, rtol=1e-2, atol=1e-2)


def test_blocked_softmax_empty_keys_or_queries():
    for t, s in ((0, 4), (4, 0)):
        q, k, v = _qkv(5, t, s, dtype=jnp.float32)
        out = softmax_blocked.blocked_softmax_attention(q, k, v)
        chex.assert_shape(out, (B, t, H, M))
        np.testing.assert_array_equal(out, 0.0)


def test_softmax_default_on_cpu_is_blocked():
    """implementation=None picks the blocked form on the CPU (the dispatch the benchmark's
    numbers rest on); elsewhere jax.nn.dot_product_attention."""
    q, k, v = _qkv(6, T, T, m=D, dtype=jnp.float32)
    default = jax.jit(lambda q, k, v: ops.softmax_attention(q, k, v, causal=True))
    blocked = jax.jit(lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, implementation="blocked"))
    xla = jax.jit(lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, implementation="xla"))
    expected = blocked if jax.default_backend() == "cpu" else xla
    assert "custom_vjp" in str(jax.make_jaxpr(default)(q, k, v)) or jax.default_backend() != "cpu"
    np.testing.assert_array_equal(default(q, k, v), expected(q, k, v))


def test_blocked_softmax_non_finite_values_reach_only_later_queries():
    """The op's rule (ops/_nonfinite.py) holds with the blocked form under it."""
    q, k, v = _qkv(7, T, T, dtype=jnp.float32)
    v = v.at[0, 4, 1, 2].set(jnp.inf)
    out = ops.softmax_attention(q, k, v, causal=True, implementation="blocked")
    assert np.all(np.isfinite(out[0, :4])) and np.all(np.isfinite(out[1]))
    assert np.all(np.isnan(out[0, 4:, 1, 2]))
    assert np.all(np.isfinite(out[0, 4:, 0]))


# ---------------------------------------------------------------- non-causal linear attention


@pytest.mark.parametrize("key_lengths", [None, [6, 2]])
@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor"])
def test_linear_attention_matches_reference_values_and_grads(x64, feature_map, key_lengths):
    q, k, v = _qkv(10, T, 6)
    if feature_map == "favor":  # F = 6 features from D = 4
        feature_map = FavorFeatureMap(favor_projection(jax.random.key(0), 6, D).astype(jnp.float64))
    lengths = None if key_lengths is None else jnp.array(key_lengths, jnp.int32)

    def fast(q, k, v):
        return ops.linear_attention(q, k, v, feature_map=feature_map, key_lengths=lengths)

    def slow(q, k, v):
        return ops.linear_attention_reference(q, k, v, feature_map=feature_map, key_lengths=lengths)

    _assert_agree(fast, slow, q, k, v, tol=1e-10)


def test_linear_state_layout_matches_explicit_sums(x64):
    """The summary (s, z) is still [B, H, F, M] and [B, H, F], whatever layout computes it."""
    _, k, v = _qkv(11, T, 6)
    state = ops.linear_state_from_keys(k, v)
    phi_k = jax.nn.elu(k) + 1
    chex.assert_trees_all_close(state.s_BHFM, jnp.einsum("bshf,bshm->bhfm", phi_k, v), rtol=1e-12)
    chex.assert_trees_all_close(state.z_BHF, phi_k.sum(1), rtol=1e-12)


def test_linear_attention_bfloat16_accumulates_in_float32():
    q, k, v = _qkv(12, 64, 64, dtype=jnp.bfloat16)
    out = ops.linear_attention(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = ops.linear_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)))
    chex.assert_trees_all_close(out.astype(jnp.float32), ref, rtol=1e-2, atol=1e-2)
