"""Reformer LSH attention: the sorted/chunked op against its dense definition (values and
gradients), full softmax as the one-bucket limit, padding, dtypes, and the "reformer" layer."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_transformers import MultiHeadAttention, TransformerConfig, ops
from linear_transformers.attention import HashRotations

B, N, H, D, M = 2, 37, 3, 8, 5

# Compiled: op-by-op dispatch of the sort/gather pipeline is slow on CPU.
_lsh = jax.jit(ops.lsh_attention, static_argnames=("chunk_size", "causal"))
_lsh_reference = jax.jit(ops.lsh_attention_reference, static_argnames=("chunk_size", "causal"))


def _qv(dtype=np.float64, n=N, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, n, H, D)).astype(dtype), rng.standard_normal((B, n, H, M)).astype(dtype))


def _valid(key_lengths, n=N):
    if key_lengths is None:
        return np.ones((B, n), bool)
    return np.arange(n)[None] < np.asarray(key_lengths)[:, None]


CASES = [  # rounds, buckets, chunk, causal, key_lengths
    (1, 4, 8, False, None),
    (3, 8, 4, True, None),
    (4, 2, 5, False, (37, 20)),
    (2, 8, 16, True, (30, 11)),
    (8, 16, 4, False, None),
    (2, 4, 20, False, None),  # two chunks: chunk 0 has no previous chunk
    (3, 4, 64, True, None),  # one chunk longer than the sequence
]


@pytest.mark.parametrize("rounds,buckets,chunk,causal,key_lengths", CASES)
def test_sorted_chunked_op_equals_dense_definition(x64, rounds, buckets, chunk, causal, key_lengths):
    q, v = _qv()
    rot = ops.lsh_rotations(jax.random.key(rounds), rounds, D, buckets).astype(jnp.float64)
    kw = dict(chunk_size=chunk, causal=causal, key_lengths=key_lengths)
    fast = _lsh(q, v, rot, **kw)
    ref = _lsh_reference(q, v, rot, **kw)
    chex.assert_shape(fast, (B, N, H, M))
    valid = _valid(key_lengths)
    np.testing.assert_allclose(np.asarray(fast)[valid], np.asarray(ref)[valid], atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_dense_definition(x64, causal):
    q, v = _qv(n=19)
    rot = ops.lsh_rotations(jax.random.key(3), 3, D, 4).astype(jnp.float64)
    lengths = np.array([19, 12])
    w = np.random.default_rng(5).standard_normal((B, 19, H, M)) * _valid(lengths, 19)[..., None, None]

    def loss(fn):
        return lambda q, v: jnp.sum(w * fn(q, v, rot, chunk_size=4, causal=causal, key_lengths=lengths))

    g_fast = jax.jit(jax.grad(loss(ops.lsh_attention), argnums=(0, 1)))(q, v)
    g_ref = jax.jit(jax.grad(loss(ops.lsh_attention_reference), argnums=(0, 1)))(q, v)
    for a, b in zip(g_fast, g_ref):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("rounds", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_one_bucket_and_one_chunk_is_full_softmax(x64, rounds, causal):
    """All keys in one bucket and one chunk: softmax over every key but oneself (oneself only
    when nothing else is allowed: the first position of a causal sequence), however many rounds."""
    q, v = _qv()
    rot = ops.lsh_rotations(jax.random.key(0), rounds, D, 1)
    out = _lsh(q, v, rot, chunk_size=N, causal=causal)
    k_unit = q / np.linalg.norm(q, axis=-1, keepdims=True)
    allowed = ~np.eye(N, dtype=bool)
    if causal:
        allowed &= np.tri(N, dtype=bool)
        allowed[0, 0] = True
    full = ops.softmax_attention_reference(q, k_unit, v, mask=allowed)
    np.testing.assert_allclose(out, full, atol=1e-12)


def test_padding_content_cannot_reach_valid_outputs():
    q, v = _qv(np.float32)
    lengths = np.array([25, 9])
    rot = ops.lsh_rotations(jax.random.key(1), 4, D, 4)
    q2, v2 = q.copy(), v.copy()
    pad = ~_valid(lengths)
    q2[pad] = 100.0 * np.random.default_rng(9).standard_normal(q2[pad].shape)
    v2[pad] = -50.0
    a = _lsh(q, v, rot, chunk_size=4, key_lengths=lengths)
    b = _lsh(q2, v2, rot, chunk_size=4, key_lengths=lengths)
    np.testing.assert_allclose(np.asarray(a)[~pad], np.asarray(b)[~pad], atol=1e-6)


def test_causal_lsh_outputs_depend_on_later_positions_unless_they_are_padding():
    """What makes causal LSH a poor autoregressive model: outputs at t <= 20 move when only
    positions after 20 change (they take other places in the hash-sorted order), by O(1) here;
    with the later positions marked as padding they are the outputs of the cut sequence."""
    q, v = _qv(np.float32)
    rot = ops.lsh_rotations(jax.random.key(1), 2, D, 8)
    cut = 21
    q2 = q.copy()
    q2[:, cut:] = np.random.default_rng(5).standard_normal(q2[:, cut:].shape)
    a = np.asarray(_lsh(q, v, rot, chunk_size=4, causal=True))[:, :cut]
    b = np.asarray(_lsh(q2, v, rot, chunk_size=4, causal=True))[:, :cut]
    assert np.max(np.abs(a - b)) > 0.1, np.max(np.abs(a - b))
    # Causal linear attention, for contrast: no dependence at all.
    lin = [
        np.asarray(ops.causal_linear_attention(x, x, v, implementation="reference"))[:, :cut] for x in (q, q2)
    ]
    np.testing.assert_array_equal(lin[0], lin[1])
    lengths = np.full((B,), cut)
    padded = [
        np.asarray(_lsh(x, v, rot, chunk_size=4, causal=True, key_lengths=lengths))[:, :cut] for x in (q, q2)
    ]
    cut_only = np.asarray(_lsh(q[:, :cut], v[:, :cut], rot, chunk_size=4, causal=True))
    np.testing.assert_allclose(padded[0], cut_only, atol=1e-6)
    np.testing.assert_allclose(padded[1], cut_only, atol=1e-6)


def test_bfloat16_inputs_accumulate_in_float32():
    q, v = _qv(np.float32)
    rot = ops.lsh_rotations(jax.random.key(2), 2, D, 4)
    out32 = _lsh(q, v, rot, chunk_size=8, causal=True)
    out16 = _lsh(jnp.asarray(q, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), rot, chunk_size=8, causal=True)
    assert out16.dtype == jnp.bfloat16
    # bf16 rounding can move a position to another bucket; most outputs still agree closely.
    close = np.abs(np.asarray(out16, np.float32) - np.asarray(out32)) < 0.05
    assert close.mean() > 0.9


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_rounds=0, num_buckets=4, chunk_size=4), "num_rounds"),
        (dict(num_rounds=1, num_buckets=3, chunk_size=4), "num_buckets must be 1 or an even"),
        (dict(num_rounds=1, num_buckets=4, chunk_size=0), "chunk_size"),
    ],
)
def test_bad_lsh_options_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.check_lsh_options(**kwargs)


def test_rotations_must_match_the_head_dimension():
    q, v = _qv(np.float32)
    with pytest.raises(ValueError, match="rotations must be"):
        ops.lsh_attention(q, v, jnp.zeros((2, D + 1, 2)), chunk_size=4)


# --- the "reformer" attention kind ---------------------------------------------------------

E = 24


def _reformer(causal=True, **options):
    options = {"chunk_size": 4, "num_buckets": 4, "num_rounds": 2, **options}
    return MultiHeadAttention(
        E, 3, kind="reformer", causal=causal, attention_options=options, rngs=nnx.Rngs(0)
    )


_call = nnx.jit(lambda m, x, lengths=None: m(x, key_lengths=lengths))


@pytest.mark.parametrize("causal", [False, True])
def test_reformer_layer_shapes_gradients_and_shared_qk(causal):
    mha = _reformer(causal)
    assert mha.key is None  # keys are the normalised queries: no key projection to train
    x = np.random.default_rng(0).standard_normal((2, 21, E)).astype(np.float32)
    y = _call(mha, x, np.array([21, 13]))
    chex.assert_shape(y, (2, 21, E))
    chex.assert_tree_all_finite(y)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(mha)
    chex.assert_tree_all_finite(grads)
    assert float(jnp.sum(jnp.abs(grads["query"]["kernel"][...]))) > 0
    assert not any(isinstance(v, nnx.Param) and "rotations" in str(p) for p, v in nnx.iter_graph(grads))


def test_reformer_layer_honours_padding_and_is_deterministic():
    mha = _reformer(False)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 17, E)).astype(np.float32)
    x2 = x.copy()
    x2[1, 8:] = rng.standard_normal(x2[1, 8:].shape)
    lengths = np.array([17, 8])
    a, b = _call(mha, x, lengths), _call(mha, x2, lengths)
    np.testing.assert_allclose(a[1, :8], b[1, :8], atol=1e-5)
    np.testing.assert_array_equal(a, _call(mha, x, lengths))  # fixed rotations
    rotations = nnx.state(mha, HashRotations)
    assert len(jax.tree.leaves(rotations)) == 1
    mha.core.redraw_hashes(jax.random.key(7))
    assert not np.allclose(_call(mha, x, lengths), a)


def test_reformer_rejects_what_it_cannot_do():
    mha = _reformer(True)
    x = np.zeros((1, 8, E), np.float32)
    with pytest.raises(ValueError, match="no recurrent form"):
        mha.init_state(1, max_length=8)
    with pytest.raises(ValueError, match="self-attention only"):
        _reformer(False)(x, x)
    with pytest.raises(ValueError, match="arbitrary"):
        mha(x, mask=np.ones((8, 8), bool))
    with pytest.raises(ValueError, match="fixed memory"):
        _reformer(False).init_memory(x)
    with pytest.raises(ValueError, match="num_buckets"):
        _reformer(num_buckets=5)
    with pytest.raises(ValueError, match="shares queries"):
        TransformerConfig(model_dim=E, num_heads=3, attention="linear", cross_attention="reformer")
    with pytest.raises(ValueError, match="does not accept options"):
        _reformer(feature_map="elu")


def test_reformer_stack_defaults_to_softmax_cross_attention():
    config = TransformerConfig(
        model_dim=E, num_heads=3, attention="reformer", attention_options={"chunk_size": 4}
    )
    assert config.cross_kind == "softmax" and dict(config.cross_options) == {}
