"""The blocked KV-cache step and prefill against their dense references.

`softmax_attention_step` and `softmax_attention_prefill` read the cache in blocks up to the
filled slots with an online softmax; `..._reference` attend over every slot with one mask. The
caches here hold random keys, values and segments in every slot, filled or not, so reading a
slot that should not be seen changes the result.

Legend: B batch, T time, S cache slots, H heads, D key/query features, M value features.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import unoptimised_jit as jit

from linear_transformers import ops
from linear_transformers.ops import kv_cache

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

B, H, D, M = 2, 2, 4, 6  # M != D throughout
BLOCK = 4


def _randn(rng, *shape):
    return rng.standard_normal(shape)


def _random_cache(seed, capacity, length, dtype=jnp.float64):
    """A cache of `length` filled slots whose every slot (and segment) is random, with
    decoding continuing run 1 in example 0 and run 0 in example 1."""
    rng = np.random.default_rng(seed)
    return ops.KVCache(
        k_BSHD=jnp.asarray(_randn(rng, B, capacity, H, D), dtype),
        v_BSHM=jnp.asarray(_randn(rng, B, capacity, H, M), dtype),
        length=jnp.asarray(length, jnp.int32),
        segment_BS=jnp.asarray(rng.integers(0, 2, (B, capacity)), jnp.int32),
        segment_B=jnp.asarray([1, 0], jnp.int32),
    )


def _qkv(seed, *lead, dtype=jnp.float64):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(_randn(rng, *lead, H, f), dtype) for f in (D, D, M))


def _blocked_step(block_size=BLOCK):
    return jit(functools.partial(ops.softmax_attention_step, block_size=block_size), static_argnames="scale")


_reference_step = jit(kv_cache.softmax_attention_step_reference, static_argnames="scale")


def _blocked_prefill(block_size=BLOCK):
    return jit(
        functools.partial(ops.softmax_attention_prefill, block_size=block_size), static_argnames="scale"
    )


_reference_prefill = jit(kv_cache.softmax_attention_prefill_reference, static_argnames="scale")


def _close(got, expected, rtol=1e-10, atol=1e-12):
    chex.assert_trees_all_close(got, expected, rtol=rtol, atol=atol)


# Capacity 10: the last block overlaps the one before; 12: a multiple of the block; 3: less
# than a block. Lengths before the step at and around every block boundary, up to full.
@pytest.mark.parametrize(
    "capacity,lengths",
    [(10, (0, 1, 3, 4, 5, 7, 8, 9)), (12, (0, 3, 4, 5, 8, 11)), (3, (0, 1, 2))],
)
@pytest.mark.parametrize("scale", [None, 3.0])  # 3.0: peaked weights, the running max matters
def test_step_equals_the_reference_at_block_boundaries(x64, capacity, lengths, scale):
    step = _blocked_step()
    for length in lengths:
        cache = _random_cache(length, capacity, length)
        q, k, v = _qkv(100 + length, B)
        new_cache, out = step(cache, q, k, v, scale=scale)
        ref_cache, expected = _reference_step(cache, q, k, v, scale=scale)
        assert out.dtype == jnp.float64
        _close(out, expected)
        _close(new_cache, ref_cache, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [1, 3, 5, 10, 11, 128])
def test_step_equals_the_reference_for_any_block_size(x64, block_size):
    """Blocks of one slot, blocks that do not divide the capacity 10, one block of it all, and
    a block larger than the cache."""
    step = _blocked_step(block_size)
    for length in (0, 4, 9):
        cache = _random_cache(length, 10, length)
        q, k, v = _qkv(200 + length, B)
        _close(step(cache, q, k, v)[1], _reference_step(cache, q, k, v)[1])


def test_step_never_reads_blocks_past_the_filled_ones(x64):
    """NaN in every slot of the blocks after the last filled one: they are skipped, not read
    and masked (a masked NaN value would still poison the weighted sum)."""
    length = 5  # the step fills slot 5, in block [4, 8)
    cache = _random_cache(0, 16, length)
    cache = cache._replace(
        k_BSHD=cache.k_BSHD.at[:, 2 * BLOCK :].set(jnp.nan),
        v_BSHM=cache.v_BSHM.at[:, 2 * BLOCK :].set(jnp.nan),
    )
    q, k, v = _qkv(1, B)
    _, out = _blocked_step()(cache, q, k, v)
    chex.assert_tree_all_finite(out)
    finite_cache = cache._replace(
        k_BSHD=jnp.nan_to_num(cache.k_BSHD, nan=0.0), v_BSHM=jnp.nan_to_num(cache.v_BSHM, nan=0.0)
    )
    _close(out, _reference_step(finite_cache, q, k, v)[1])


# (length before, block length T) with capacity 10: from empty, across one and two block
# boundaries, ending exactly at a boundary, and filling the cache.
@pytest.mark.parametrize("length,T", [(0, 1), (0, 10), (3, 1), (3, 2), (4, 5), (5, 5), (2, 8), (7, 3)])
@pytest.mark.parametrize("packed", [False, True])
def test_prefill_equals_the_reference(x64, length, T, packed):
    """Packed: random ids in {0, 1, 2}, so segments start anywhere and padding (0) is
    scattered through the block; a padding query's output is exactly 0."""
    cache = _random_cache(10 + length, 10, length)
    q, k, v = _qkv(300 + T, B, T)
    ids = jnp.asarray(np.random.default_rng(T).integers(0, 3, (B, T)), jnp.int32) if packed else None
    new_cache, out = _blocked_prefill()(cache, q, k, v, segment_ids=ids, scale=2.0)
    ref_cache, expected = _reference_prefill(cache, q, k, v, segment_ids=ids, scale=2.0)
    _close(out, expected)
    _close(new_cache, ref_cache, rtol=0, atol=0)
    if packed:
        padding_BT = np.asarray(ids) == 0
        assert np.all(np.asarray(out)[padding_BT] == 0)


def test_prefill_equals_the_reference_eagerly(x64):
    """Op by op, with the cache length concrete: the same blocks are visited."""
    cache = _random_cache(7, 10, 3)
    q, k, v = _qkv(7, B, 6)
    ids = jnp.asarray([[1, 1, 0, 2, 2, 2], [0, 1, 1, 1, 0, 0]], jnp.int32)
    _, out = ops.softmax_attention_prefill(cache, q, k, v, segment_ids=ids, block_size=BLOCK)
    _, expected = kv_cache.softmax_attention_prefill_reference(cache, q, k, v, segment_ids=ids)
    _close(out, expected)


def test_bfloat16_steps_accumulate_in_float32():
    """A bf16 cache and inputs: the output is bf16 and within one bf16 rounding (2**-7
    relative) of the dense reference's, as both accumulate in float32 over 8 blocks."""
    capacity, block = 64, 8
    q, k, v = _qkv(8, B, capacity, dtype=jnp.bfloat16)
    step = _blocked_step(block)
    cache = ref_cache = ops.init_kv_cache(B, capacity, H, D, M, dtype=jnp.bfloat16)
    outs, expected = [], []
    for t in range(capacity):
        cache, out = step(cache, q[:, t], k[:, t], v[:, t])
        ref_cache, ref = _reference_step(ref_cache, q[:, t], k[:, t], v[:, t])
        outs.append(out)
        expected.append(ref)
    assert cache.k_BSHD.dtype == jnp.bfloat16 and outs[0].dtype == jnp.bfloat16
    got, want = (jnp.stack(x, axis=1).astype(jnp.float32) for x in (outs, expected))
    chex.assert_tree_all_finite(got)
    _close(got, want, rtol=2**-7, atol=1e-6)
    causal = ops.softmax_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    _close(got, causal, rtol=2e-2, atol=2e-2)


def _generate(step, prefill, q, k, v, prompt, capacity):
    """A prompt of `prompt` tokens by one prefill (none if 0), then one step per token in a
    lax.scan: the outputs [B, T, H, M] and the final cache."""
    cache = ops.init_kv_cache(B, capacity, H, D, M, dtype=q.dtype)
    outs = []
    if prompt:
        cache, out = prefill(cache, q[:, :prompt], k[:, :prompt], v[:, :prompt])
        outs.append(out)

    def body(cache, qkv_t):
        return step(cache, *qkv_t)

    rest = tuple(jnp.swapaxes(x[:, prompt:], 0, 1) for x in (q, k, v))
    cache, out_TBHM = jax.lax.scan(body, cache, rest)
    return jnp.concatenate([*outs, jnp.swapaxes(out_TBHM, 0, 1)], axis=1), cache


# 37 = 4 blocks of 8 and a part; prompts end before, at and after a block boundary.
@pytest.mark.parametrize("prompt", [0, 8, 11])
def test_generation_under_jit_equals_the_reference(x64, prompt):
    capacity, block = 37, 8
    q, k, v = _qkv(9, B, capacity)
    blocked = functools.partial(ops.softmax_attention_step, block_size=block)
    blocked_prefill = functools.partial(ops.softmax_attention_prefill, block_size=block)
    generate = jit(_generate, static_argnums=(0, 1, 5, 6))
    out, cache = generate(blocked, blocked_prefill, q, k, v, prompt, capacity)
    expected, ref_cache = generate(
        kv_cache.softmax_attention_step_reference,
        kv_cache.softmax_attention_prefill_reference,
        q,
        k,
        v,
        prompt,
        capacity,
    )
    assert int(cache.length) == capacity
    _close(out, expected)
    _close(cache, ref_cache, rtol=0, atol=0)
    _close(out, ops.softmax_attention_reference(q, k, v, causal=True))


@pytest.mark.parametrize("length,T", [(0, 6), (5, 6)])
def test_prefill_and_step_gradients_equal_the_reference(x64, length, T):
    """W.r.t. the block's q, k, v and the cache contents, prefill then one step, across block
    boundaries: the skipped blocks and the running max carry no spurious gradient."""
    capacity = 14
    cache = _random_cache(20, capacity, length)
    q, k, v = _qkv(21, B, T + 1)
    w = jnp.asarray(np.random.default_rng(22).standard_normal((B, T + 1, H, M)))

    def loss(step, prefill, q, k, v, k_cache, v_cache):
        c = cache._replace(k_BSHD=k_cache, v_BSHM=v_cache)
        c, out = prefill(c, q[:, :T], k[:, :T], v[:, :T], scale=1.5)
        _, out_t = step(c, q[:, T], k[:, T], v[:, T], scale=1.5)
        return jnp.sum(jnp.concatenate([out, out_t[:, None]], axis=1) * w)

    grad = jit(jax.grad(loss, argnums=(2, 3, 4, 5, 6)), static_argnums=(0, 1))
    blocked = functools.partial(ops.softmax_attention_step, block_size=BLOCK)
    blocked_prefill = functools.partial(ops.softmax_attention_prefill, block_size=BLOCK)
    got = grad(blocked, blocked_prefill, q, k, v, cache.k_BSHD, cache.v_BSHM)
    expected = grad(
        kv_cache.softmax_attention_step_reference,
        kv_cache.softmax_attention_prefill_reference,
        q,
        k,
        v,
        cache.k_BSHD,
        cache.v_BSHM,
    )
    chex.assert_tree_all_finite(got)
    _close(got, expected, rtol=1e-8, atol=1e-10)
    for g in got[:3]:
        assert float(jnp.max(jnp.abs(g))) > 1e-3


def test_overflow_is_nan_under_jit_and_an_error_eagerly():
    capacity = 6  # two blocks, the second overlapping the first
    cache = ops.init_kv_cache(B, capacity, H, D, M)._replace(length=jnp.asarray(capacity, jnp.int32))
    q, k, v = _qkv(30, B, dtype=jnp.float32)
    _, out = _blocked_step()(cache, q, k, v)
    assert np.all(np.isnan(np.asarray(out)))
    with pytest.raises(ValueError, match="softmax_attention_step: the KV cache is full"):
        ops.softmax_attention_step(cache, q, k, v, block_size=BLOCK)
    cache = cache._replace(length=jnp.asarray(capacity - 2, jnp.int32))
    qb, kb, vb = _qkv(31, B, 3, dtype=jnp.float32)
    _, out = _blocked_prefill()(cache, qb, kb, vb)
    assert np.all(np.isnan(np.asarray(out[:, 2:])))
    with pytest.raises(ValueError, match="softmax_attention_prefill: 3 more steps do not fit"):
        ops.softmax_attention_prefill(cache, qb, kb, vb, block_size=BLOCK)


@pytest.mark.parametrize("block_size", [0, -4, 2.5, 64.0, True, "64", None])
def test_block_size_must_be_a_positive_int(block_size):
    cache = ops.init_kv_cache(B, 8, H, D, M)
    q, k, v = _qkv(40, B, dtype=jnp.float32)
    with pytest.raises(ValueError, match=rf"softmax_attention_step: block_size .*got {block_size!r}"):
        ops.softmax_attention_step(cache, q, k, v, block_size=block_size)
    qb, kb, vb = _qkv(41, B, 2, dtype=jnp.float32)
    with pytest.raises(ValueError, match=rf"softmax_attention_prefill: block_size .*got {block_size!r}"):
        ops.softmax_attention_prefill(cache, qb, kb, vb, block_size=block_size)
