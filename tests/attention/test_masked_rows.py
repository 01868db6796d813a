"""A query that sees no key gives 0, in every attention kind and impl, with finite gradients.

Rows left without a key: key_lengths 0, a [T, S] mask row of False (softmax), a padding query
(segment id 0) of packed sequences, a query whose segment is absent from the keys
(cross-attention with key_segment_ids). Kinds whose forms cannot have such rows (a causal
query always sees itself) are covered by the rows they can have.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_transformers import ops
from linear_transformers.attention import make_attention_core
from linear_transformers.ops import LINEAR_IMPLEMENTATIONS

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

B, T, H, D, E = 2, 8, 2, 4, 8
KEY_LENGTHS = np.array([0, 5])  # example 0: every key masked
SEGMENTS = np.array([[1, 1, 1, 0, 0, 2, 2, 0], [0, 0, 1, 1, 1, 1, 1, 1]])  # 0: padding queries
PADDING = SEGMENTS == 0


def _qkvx(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32) for _ in range(3))
    # Values far from 0, so an average of them cannot pass for the rule's 0.
    return q, k, v + 3.0, jnp.asarray(rng.normal(size=(B, T, E)), jnp.float32)


def _core(kind, causal, **options):
    return make_attention_core(
        kind,
        causal=causal,
        num_heads=H,
        head_dim=D,
        value_dim=D,
        rngs=nnx.Rngs(0),
        in_features=E,
        options=options,
    )


def _assert_rows_zero_and_rest_not(out, rows):
    out = np.asarray(out)
    np.testing.assert_array_equal(out[rows], 0.0)
    assert np.all(np.abs(out[~rows]).max(axis=-1) > 0), "a row with keys came out 0"


def _assert_finite_grads(fn, *args):
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=tuple(range(len(args)))))(*args)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))


def _kl_rows():
    rows = np.zeros((B, T), bool)
    rows[0] = True
    return rows


CASES = (
    [("softmax", c, {"implementation": i}) for c in (False, True) for i in (None, "xla", "reference")]
    + [("softmax", c, {"sow_weights": True}) for c in (False, True)]
    + [("linear", c, {"implementation": i}) for c in (False, True) for i in LINEAR_IMPLEMENTATIONS]
    + [
        (k, True, {"implementation": i})
        for k in ("causal-linear", "gla", "simple-gla", "retention")
        for i in LINEAR_IMPLEMENTATIONS
    ]
    + [("linformer", False, {"max_length": T, "projected_length": 4})]
    + [("reformer", c, {"chunk_size": 4, "num_buckets": 4, "num_rounds": 2}) for c in (False, True)]
)


def _call(core, q, k, v, x, **kw):
    if core.takes_inputs:
        kw["x"] = x
    return core(q, q if core.shares_query_key else k, v, **kw)


def _compiled_call(core, options, q, k, v, x, **kw):
    """`_call` as one compiled program; eager, inside `nnx.capture`, where the core sows its
    weights (state jax.jit cannot carry out of the call)."""
    if options.get("sow_weights"):
        out, _ = nnx.capture(lambda core: _call(core, q, k, v, x, **kw), nnx.Intermediate)(core)
        return out
    return jax.jit(lambda q, k, v, kw: _call(core, q, k, v, x, **kw))(q, k, v, kw)


@pytest.mark.parametrize("kind,causal,options", CASES)
def test_key_lengths_zero_gives_zero_rows(kind, causal, options):
    core = _core(kind, causal, **options)
    q, k, v, x = _qkvx()
    kl = jnp.asarray(KEY_LENGTHS)
    out = _compiled_call(core, options, q, k, v, x, key_lengths=kl)
    rows = _kl_rows()
    if kind == "reformer":  # Padding queries (t >= 5) may have only padding in reach: not checked.
        np.testing.assert_array_equal(np.asarray(out)[0], 0.0)
        assert np.all(np.abs(np.asarray(out)[1, :5]).max(axis=-1) > 0)
    else:
        _assert_rows_zero_and_rest_not(out, rows)
    if options.get("sow_weights"):  # Sown weights are state: not traced here (same weights as
        return  # the reference path, whose gradients are checked).
    _assert_finite_grads(lambda q, k, v: _call(core, q, k, v, x, key_lengths=kl), q, k, v)


@pytest.mark.parametrize("kind,causal,options", [c for c in CASES if c[0] not in ("linformer", "reformer")])
def test_padding_queries_of_packed_sequences_give_zero(kind, causal, options):
    core = _core(kind, causal, **options)
    q, k, v, x = _qkvx(1)
    ids = jnp.asarray(SEGMENTS)
    out = _compiled_call(core, options, q, k, v, x, segment_ids=ids)
    _assert_rows_zero_and_rest_not(out, PADDING)
    if options.get("sow_weights"):
        return
    _assert_finite_grads(lambda q, k, v: _call(core, q, k, v, x, segment_ids=ids), q, k, v)


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_softmax_mask_rows_and_absent_segments_give_zero(implementation):
    q, k, v, _ = _qkvx(2)
    mask = np.array(jax.random.bernoulli(jax.random.key(0), 0.5, (B, H, T, T)))
    mask[:, :, 2] = False
    mask[1, 0, 5] = False
    rows_BHT = ~mask.any(-1)
    out = ops.softmax_attention(q, k, v, mask=jnp.asarray(mask), implementation=implementation)
    _assert_rows_zero_and_rest_not(jnp.swapaxes(out, 1, 2), rows_BHT)
    _assert_finite_grads(lambda q, k, v: ops.softmax_attention(q, k, v, mask=jnp.asarray(mask)), q, k, v)
    # Cross-attention over a packed memory: query segment 3 has no key.
    query_ids = jnp.asarray([[1, 1, 3, 3, 2, 2, 0, 0]] * B)
    key_ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0]] * B)
    out = ops.softmax_attention(
        q, k, v, segment_ids=query_ids, key_segment_ids=key_ids, implementation=implementation
    )
    _assert_rows_zero_and_rest_not(out, np.isin(np.asarray(query_ids), [0, 3]))


def test_softmax_causal_mask_and_key_lengths_rows():
    q, k, v, _ = _qkvx(3)
    mask = np.ones((T, T), bool)
    mask[4, :5] = False  # with causal, row 4 sees only keys <= 4: none left
    out = ops.softmax_attention(q, k, v, causal=True, mask=jnp.asarray(mask), key_lengths=jnp.asarray([T, 0]))
    rows = np.zeros((B, T), bool)
    rows[0, 4] = rows[1] = True
    _assert_rows_zero_and_rest_not(out, rows)
    ref = ops.softmax_attention_reference(
        q, k, v, causal=True, mask=jnp.asarray(mask), key_lengths=jnp.asarray([T, 0])
    )
    np.testing.assert_allclose(out, ref, atol=1e-5)
    # A mask row whose only allowed keys are padding: no key left either.
    mask = np.ones((T, T), bool)
    mask[3, :6] = False
    for implementation in (None, "reference"):
        out = ops.softmax_attention(
            q, k, v, mask=jnp.asarray(mask), key_lengths=jnp.asarray([6, T]), implementation=implementation
        )
        rows = np.zeros((B, T), bool)
        rows[0, 3] = True
        _assert_rows_zero_and_rest_not(out, rows)


@pytest.mark.parametrize(
    "kind,options",
    [("softmax", {}), ("linear", {}), ("linformer", {"max_length": T, "projected_length": 4})],
)
def test_attend_memory_with_no_memory_keys_gives_zero(kind, options):
    core = _core(kind, False, **options)
    q, k, v, _ = _qkvx(4)
    memory = core.init_memory(k, v, jnp.asarray(KEY_LENGTHS))
    _assert_rows_zero_and_rest_not(core.attend_memory(memory, q), _kl_rows())
    np.testing.assert_array_equal(np.asarray(core.attend_memory(memory, q[:, 0]))[0], 0.0)


@pytest.mark.parametrize(
    "kind,options",
    [("softmax", {})]
    + [
        (k, {"implementation": i})
        for k in ("causal-linear", "gla", "retention")
        for i in LINEAR_IMPLEMENTATIONS
    ],
)
def test_prefill_padding_queries_give_zero(kind, options):
    core = _core(kind, True, **options)
    q, k, v, x = _qkvx(5)
    kw = {"x": x} if core.takes_inputs else {}
    state = core.init_state(B, max_length=2 * T)
    state, out = core.prefill(state, q, k, v, segment_ids=jnp.asarray(SEGMENTS), **kw)
    _assert_rows_zero_and_rest_not(out, PADDING)
    # The next block continues the last segment and still sees none of the padding.
    _, out2 = core.prefill(state, q, k, v, segment_ids=jnp.asarray(SEGMENTS), **kw)
    _assert_rows_zero_and_rest_not(out2, PADDING)


def test_lsh_reference_agrees_on_empty_rows():
    q, _, v, _ = _qkvx(6)
    rotations = ops.lsh_rotations(jax.random.key(1), 2, D, 4)
    kl = jnp.asarray(KEY_LENGTHS)
    fast = ops.lsh_attention(q, v, rotations, chunk_size=4, key_lengths=kl)
    ref = ops.lsh_attention_reference(q, v, rotations, chunk_size=4, key_lengths=kl)
    np.testing.assert_array_equal(np.asarray(fast)[0], 0.0)
    np.testing.assert_allclose(fast, ref, atol=1e-5)
