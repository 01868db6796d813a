"""Softmax attention a chunk of queries at a time (`ops.softmax_chunked`) against the reference:
values and gradients in float64 for every mask the form takes, and its memory.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops
from linear_transformers.ops import softmax_chunked

B, T, H, D, M = 2, 37, 3, 8, 5


def _inputs(seed, *, t=T, s=T):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((B, n, H, D))) for n in (t, s))
    v = jnp.asarray(rng.standard_normal((B, s, H, M)))
    w = jnp.asarray(rng.standard_normal((B, t, H, M)))
    return q, k, v, w


def _case(name, t=T, s=T):
    rng = np.random.default_rng(7)
    ids = np.zeros((B, t), np.int32)
    ids[0, :10], ids[0, 10:30], ids[1, :5], ids[1, 5:] = 1, 2, 3, 4  # example 0 ends in padding
    return {
        "plain": {},
        "causal": {"causal": True},
        "key_lengths": {"key_lengths": jnp.array([s, 11], jnp.int32)},
        "a row with no key": {"key_lengths": jnp.array([0, s], jnp.int32)},
        "mask": {"mask": jnp.asarray(rng.random((B, H, t, s)) < 0.6), "scale": 0.7},
        "mask_B11S": {"mask": jnp.asarray(rng.random((B, 1, 1, s)) < 0.6)},
        "mask_TS": {"mask": jnp.asarray(rng.random((t, s)) < 0.6)},
        "segments": {"segment_ids": jnp.asarray(ids)},
        "causal segments lengths": {
            "causal": True,
            "segment_ids": jnp.asarray(ids),
            "key_lengths": jnp.array([s, 20], jnp.int32),
        },
    }[name]


CASES = [
    "plain",
    "causal",
    "key_lengths",
    "a row with no key",
    "mask",
    "mask_B11S",
    "mask_TS",
    "segments",
    "causal segments lengths",
]


def _loss(impl, kwargs, w, **extra):
    def loss(q, k, v):
        return jnp.sum(ops.softmax_attention(q, k, v, implementation=impl, **kwargs, **extra) * w)

    return loss


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_equal_the_reference(x64, case):
    q, k, v, w = _inputs(0)
    kwargs = _case(case)
    got = ops.softmax_attention(q, k, v, implementation="chunked", **kwargs)
    expected = ops.softmax_attention(q, k, v, implementation="reference", **kwargs)
    chex.assert_trees_all_close(got, expected, rtol=1e-12, atol=1e-12)
    grads = jax.grad(_loss("chunked", kwargs, w), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(
        grads, jax.grad(_loss("reference", kwargs, w), argnums=(0, 1, 2))(q, k, v), rtol=1e-10, atol=1e-12
    )
    chex.assert_tree_all_finite(grads)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 36, 37, 64])
def test_any_chunk_size_gives_the_same(x64, chunk_size):
    """Chunks that do not divide T (the last padded), one chunk, one query per chunk."""
    q, k, v, w = _inputs(1)
    kwargs = _case("causal segments lengths")
    ids = kwargs["segment_ids"]
    chunked = dict(kwargs, key_segment_ids=ids, chunk_size=chunk_size)

    def loss(q, k, v):
        return jnp.sum(softmax_chunked.chunked_softmax_attention(q, k, v, **chunked) * w)

    expected = ops.softmax_attention(q, k, v, implementation="reference", **kwargs)
    chex.assert_trees_all_close(
        softmax_chunked.chunked_softmax_attention(q, k, v, **chunked), expected, rtol=1e-12, atol=1e-12
    )
    chex.assert_trees_all_close(
        jax.grad(loss, argnums=(0, 1, 2))(q, k, v),
        jax.grad(_loss("reference", kwargs, w), argnums=(0, 1, 2))(q, k, v),
        rtol=1e-10,
        atol=1e-12,
    )


def test_cross_attention_over_a_packed_memory(x64):
    """T != S, the keys' own segment ids, and a traced scale whose gradient flows."""
    q, k, v, w = _inputs(2, t=9, s=23)
    query_ids = jnp.asarray([[1] * 4 + [2] * 5, [3] * 9], jnp.int32)
    key_ids = jnp.asarray([[1] * 10 + [2] * 13, [0] * 3 + [3] * 20], jnp.int32)

    def loss(impl, scale):
        out = ops.softmax_attention(
            q, k, v, segment_ids=query_ids, key_segment_ids=key_ids, scale=scale, implementation=impl
        )
        return jnp.sum(out * w)

    chex.assert_trees_all_close(loss("chunked", 0.4), loss("reference", 0.4), rtol=1e-12)
    chex.assert_trees_all_close(
        jax.grad(loss, argnums=1)("chunked", 0.4), jax.grad(loss, argnums=1)("reference", 0.4), rtol=1e-10
    )


def test_a_non_finite_value_reaches_only_the_queries_that_see_it(x64):
    """The marking is done a chunk at a time too; the same outputs are NaN as in the dense form."""
    q, k, v, _ = _inputs(3)
    kwargs = _case("causal segments lengths")
    bad = v.at[1, 20, 1, 2].set(jnp.inf).at[0, 3, 0, 0].set(jnp.nan)
    got = ops.softmax_attention(q, k, bad, implementation="chunked", **kwargs)
    expected = ops.softmax_attention(q, k, bad, implementation="blocked", **kwargs)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert 0 < int(jnp.isnan(got).sum()) < got.size // 4
    finite = ~np.isnan(np.asarray(expected))
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(expected)[finite], rtol=1e-12, atol=1e-12)


def test_bfloat16_inputs_give_the_dtype_of_v_and_float32_accuracy():
    q, k, v, _ = (x.astype(jnp.bfloat16) for x in _inputs(4))
    got = ops.softmax_attention(q, k, v, causal=True, implementation="chunked")
    assert got.dtype == jnp.bfloat16
    expected = ops.softmax_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), causal=True, implementation="reference"
    )
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=2e-2)


def test_nothing_the_size_of_the_logits_is_kept():
    """Forward+backward from T = S = 2048 to 4096 (B = 1, H = 2: 96 MiB more float32 logits)
    with chunks of 16 queries: XLA's working memory grows by under an eighth of that, where the
    dense reference's grows by several times it. The growth, not the total: a platform's fixed
    buffers (a GPU's matmul workspaces) do not grow with the sequence."""

    def temporaries(impl, t, **kw):
        q = k = v = g = jnp.zeros((1, t, 2, 32), jnp.float32)

        def f(q, k, v, g):
            return jax.vjp(lambda q, k, v: impl(q, k, v, causal=True, **kw), q, k, v)[1](g)

        return jax.jit(f).lower(q, k, v, g).compile().memory_analysis().temp_size_in_bytes

    def growth(impl, **kw):
        return temporaries(impl, 4096, **kw) - temporaries(impl, 2048, **kw)

    logits_growth = 2 * (4096**2 - 2048**2) * 4
    assert growth(softmax_chunked.chunked_softmax_attention, chunk_size=16) < logits_growth / 8
    assert growth(ops.softmax_attention_reference) > logits_growth


def test_default_chunk_size_bounds_a_chunks_logits():
    assert softmax_chunked.default_chunk_size(8, 8, 16384, 16384) == 64  # 256 MiB
    assert softmax_chunked.default_chunk_size(1, 1, 100, 100) == 100  # never more than T
    assert softmax_chunked.default_chunk_size(64, 64, 2**20, 2**20) == softmax_chunked.MIN_CHUNK
    for args in [(8, 8, 16384, 16384), (3, 5, 1000, 70000), (1, 1, 7, 7)]:
        c = softmax_chunked.default_chunk_size(*args)
        assert c == args[2] or c % softmax_chunked.MIN_CHUNK == 0
        assert (
            c <= softmax_chunked.MIN_CHUNK
            or args[0] * args[1] * c * args[3] * 4 <= softmax_chunked.CHUNK_LOGITS_BYTES
        )
