"""MultiHeadAttention at layer level: parallel, recurrent and cross-attention forms agree; padding,
causality, FAVOR+ random features, sown attention weights, attention dropout, and the Linen bridge.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge

from linear_transformers import FeatureProjection, MultiHeadAttention, generation

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

E, H = 16, 2
B, T, S = 2, 6, 8
FAVOR = {"feature_map": "favor", "num_features": 16}

# (kind, attention_options); "causal-linear" only exists in causal form.
CAUSAL_KINDS = {
    "softmax": ("softmax", {}),
    "linear": ("linear", {}),
    "causal-linear": ("causal-linear", {}),
    "favor": ("linear", FAVOR),
    "relu": ("linear", {"feature_map": "relu"}),
    "linear-chunk3": ("linear", {"chunk_size": 3}),
}
NONCAUSAL_KINDS = {k: v for k, v in CAUSAL_KINDS.items() if k not in ("causal-linear", "linear-chunk3")}


def _mha(name, *, causal, seed=0, table=CAUSAL_KINDS, **kwargs):
    kind, options = table[name]
    return MultiHeadAttention(
        E, H, kind=kind, causal=causal, attention_options=options, rngs=nnx.Rngs(seed), **kwargs
    )


def _x(shape, seed=1, scale=1.0):
    # NumPy inputs: no per-shape compilation of a random-number kernel.
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# Compiled once per module structure (eager op-by-op dispatch is slow on CPU).
_call = nnx.jit(lambda m, x, ctx=None, lengths=None: m(x, ctx, key_lengths=lengths))
_step = nnx.jit(lambda m, state, x: m.step(state, x))
_attend = nnx.jit(lambda m, memory, x: m.attend_memory(memory, x))
_capture = nnx.jit(lambda m, *args, **kwargs: nnx.capture(m, nnx.Intermediate)(*args, **kwargs))


def _step_loop(mha, x_BTE, max_length=None):
    """init_state, then one `step` call per time step."""
    B, T, _ = x_BTE.shape
    state = mha.init_state(B, max_length=max_length or T)
    ys = []
    for t in range(T):
        state, y_BE = _step(mha, state, x_BTE[:, t])
        ys.append(y_BE)
    return np.stack(ys, axis=1)


# --- parallel shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, causal", [(name, True) for name in CAUSAL_KINDS] + [(name, False) for name in NONCAUSAL_KINDS]
)
def test_parallel_self_attention_shape_under_jit(name, causal):
    mha = _mha(name, causal=causal)
    x = _x((B, T, E))
    y = _call(mha, x)
    chex.assert_shape(y, (B, T, E))
    chex.assert_tree_all_finite(y)
    assert float(np.std(y)) > 1e-3


@pytest.mark.parametrize("name", list(NONCAUSAL_KINDS))
def test_parallel_cross_attention_shape_under_jit(name):
    kind, options = NONCAUSAL_KINDS[name]
    mha = MultiHeadAttention(
        E,
        H,
        kind=kind,
        kv_features=12,
        out_features=10,
        value_dim=5,
        attention_options=options,
        rngs=nnx.Rngs(0),
    )
    x, ctx = _x((B, T, E)), _x((B, S, 12), seed=2)
    y = _call(mha, x, ctx, jnp.array([S, 4]))
    chex.assert_shape(y, (B, T, 10))
    chex.assert_tree_all_finite(y)


# --- recurrent form equals the parallel causal call ---------------------------------------------


@pytest.mark.parametrize("name", list(CAUSAL_KINDS))
def test_step_loop_matches_parallel_causal(name):
    mha = _mha(name, causal=True)
    x = _x((B, T, E))
    y_par = _call(mha, x)
    y_rec = _step_loop(mha, x)
    chex.assert_shape(y_rec, y_par.shape)
    np.testing.assert_allclose(y_rec, y_par, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CAUSAL_KINDS))
def test_scan_steps_matches_parallel_causal(name):
    mha = _mha(name, causal=True)
    x = _x((B, T, E))
    # A softmax cache larger than the sequence: unused slots must stay invisible.
    state, y_rec = generation.scan_steps(mha, mha.init_state(B, max_length=T + 3), x)
    chex.assert_shape(y_rec, (B, T, E))
    np.testing.assert_allclose(y_rec, _call(mha, x), atol=1e-5, rtol=1e-5)
    if name == "softmax":
        assert int(state.length) == T


def test_make_step_fn_matches_parallel_causal():
    mha = _mha("linear", causal=True)
    x = _x((B, T, E))
    step_fn, params = generation.make_step_fn(mha)
    state, ys = mha.init_state(B), []
    for t in range(T):
        state, y = step_fn(params, state, x[:, t])
        ys.append(y)
    np.testing.assert_allclose(np.stack(ys, 1), _call(mha, x), atol=1e-5, rtol=1e-5)


def test_recurrent_prefix_depends_only_on_past():
    # The first steps of a longer sequence equal the steps of its prefix (no lookahead in state).
    mha = _mha("softmax", causal=True)
    x = _x((B, T, E))
    np.testing.assert_allclose(_step_loop(mha, x, 2 * T)[:, :4], _step_loop(mha, x[:, :4], 2 * T), atol=1e-6)


# --- cross-attention over a fixed memory ---------------------------------------------------------


@pytest.mark.parametrize("name", list(NONCAUSAL_KINDS))
def test_attend_memory_matches_parallel_cross_attention(name):
    kind, options = NONCAUSAL_KINDS[name]
    mha = MultiHeadAttention(E, H, kind=kind, kv_features=12, attention_options=options, rngs=nnx.Rngs(0))
    x, ctx = _x((B, T, E)), _x((B, S, 12), seed=2)
    lengths = jnp.array([S, 3])
    y_par = _call(mha, x, ctx, lengths)
    memory = mha.init_memory(ctx, lengths)
    y_mem = np.stack([_attend(mha, memory, x[:, t]) for t in range(T)], axis=1)
    np.testing.assert_allclose(y_mem, y_par, atol=1e-5, rtol=1e-5)
    # key_lengths matters (the test above is not vacuous).
    assert not np.allclose(_call(mha, x, ctx), y_par, atol=1e-3)


# --- padding --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["softmax", "linear", "favor"])
def test_padded_context_rows_change_nothing(name):
    mha = _mha(name, causal=False, table=NONCAUSAL_KINDS)
    x, ctx = _x((B, T, E)), _x((B, S, E), seed=2)
    lengths = jnp.array([5, 2])
    valid = (np.arange(S)[None, :] < np.asarray(lengths)[:, None])[..., None]
    ctx_changed = np.where(valid, ctx, _x(ctx.shape, seed=3, scale=10.0))
    y = _call(mha, x, ctx, lengths)
    np.testing.assert_allclose(_call(mha, x, ctx_changed, lengths), y, atol=1e-5, rtol=1e-5)
    # Without padding the change is visible, so the comparison above can fail.
    full = jnp.array([S, S])
    assert not np.allclose(_call(mha, x, ctx_changed, full), _call(mha, x, ctx, full), atol=1e-3)
    # Padding equals truncation: element 1 sees only its first 2 context rows.
    np.testing.assert_allclose(y[1:], _call(mha, x[1:], ctx[1:, :2]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_padded_self_attention_valid_positions_unchanged(name):
    mha = _mha(name, causal=False, table=NONCAUSAL_KINDS)
    x = _x((B, T, E))
    lengths = jnp.array([T, 3])
    valid = (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[..., None]
    x_changed = np.where(valid, x, _x(x.shape, seed=4, scale=10.0))
    y1, y2 = _call(mha, x, None, lengths), _call(mha, x_changed, None, lengths)
    np.testing.assert_allclose(np.where(valid, y1, 0), np.where(valid, y2, 0), atol=1e-5, rtol=1e-5)


# --- causality by gradients -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["softmax", "linear", "causal-linear", "favor", "linear-chunk3"])
def test_causal_output_has_no_gradient_from_future_inputs(name):
    mha = _mha(name, causal=True)
    x = _x((1, T, E))
    graphdef, state = nnx.split(mha)

    @jax.jit
    def jacobian(state, x):
        return jax.jacrev(lambda x: nnx.merge(graphdef, state)(x)[0])(x)[:, :, 0]

    jac = jacobian(state, x)  # [T_out, E_out, T_in, E_in]
    grad_norm_ts = np.sum(np.abs(np.asarray(jac)), axis=(1, 3))  # [T_out, T_in]
    future = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(grad_norm_ts[future] == 0.0), grad_norm_ts
    # The past does matter: every output depends on its own input and on the first input.
    assert np.all(np.diag(grad_norm_ts) > 0)
    assert np.all(grad_norm_ts[1:, 0] > 0)


@pytest.mark.parametrize("name", list(CAUSAL_KINDS))
def test_causal_output_unchanged_by_future_inputs_exactly(name):
    # Exact, not up to rounding: a prefix state computed as cumsum(x) - x would let future
    # values in at the last bit (linear-chunk3 has two chunks at T=6).
    mha = _mha(name, causal=True)
    x = _x((B, T, E))
    t = 3
    x_changed = x.copy()
    x_changed[:, t + 1 :] = _x((B, T - t - 1, E), seed=7, scale=100.0)
    y, y_changed = np.asarray(_call(mha, x)), np.asarray(_call(mha, x_changed))
    np.testing.assert_array_equal(y_changed[:, : t + 1], y[:, : t + 1])
    assert not np.allclose(y_changed[:, t + 1 :], y[:, t + 1 :], atol=1e-3)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_noncausal_output_has_gradient_from_future_inputs(name):
    mha = _mha(name, causal=False, table=NONCAUSAL_KINDS)
    x = _x((1, T, E))
    g = nnx.jit(lambda m, x: jax.grad(lambda x: m(x)[0, 0].sum())(x))(mha, x)
    assert np.all(np.abs(np.asarray(g)[0, 1:]).sum(-1) > 0)


# --- FAVOR+ random features -----------------------------------------------------------------------


def test_favor_projection_is_fixed_state_not_a_param():
    mha = _mha("favor", causal=True)
    proj = mha.core.feature_projection
    assert isinstance(proj, FeatureProjection)
    assert not isinstance(proj, nnx.Param)
    chex.assert_shape(proj[...], (16, E // H))
    params = nnx.state(mha, nnx.Param)
    param_paths = [path for path, _ in nnx.to_flat_state(params)]
    assert param_paths, "the projections are parameters"
    assert not any("feature_projection" in map(str, path) for path in param_paths)
    fp_paths = [path for path, _ in nnx.to_flat_state(nnx.state(mha, FeatureProjection))]
    assert fp_paths == [("core", "feature_projection")]
    # Gradients w.r.t. parameters leave the projection out.
    x = _x((B, T, E))
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(mha, x)
    assert not any("feature_projection" in map(str, path) for path, _ in nnx.to_flat_state(grads))


def test_favor_projection_is_same_on_repeated_calls_and_redraw_changes_it():
    mha = _mha("favor", causal=False, table=NONCAUSAL_KINDS)
    x = _x((B, T, E))
    before = np.array(mha.core.feature_projection[...])
    y1 = mha(x)
    y2 = mha(x)
    y3 = _call(mha, x)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_allclose(y3, y1, atol=1e-6)
    np.testing.assert_array_equal(mha.core.feature_projection[...], before)

    mha.core.redraw_features(jax.random.key(123))
    after = mha.core.feature_projection[...]
    chex.assert_shape(after, before.shape)
    assert isinstance(mha.core.feature_projection, FeatureProjection)
    assert not np.allclose(after, before)
    assert not np.allclose(mha(x), y1, atol=1e-6)
    assert not np.allclose(_call(mha, x), y3, atol=1e-6)  # a compiled call sees the new matrix
    # Redrawing with the same key is deterministic.
    mha.core.redraw_features(jax.random.key(123))
    np.testing.assert_array_equal(mha.core.feature_projection[...], after)


def test_favor_projection_depends_on_rngs_seed():
    a = _mha("favor", causal=True, seed=0).core.feature_projection[...]
    b = _mha("favor", causal=True, seed=1).core.feature_projection[...]
    assert not np.allclose(a, b)


# --- attention weights ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_sown_attention_weights(causal):
    mha = MultiHeadAttention(
        E, H, kind="softmax", causal=causal, attention_options={"sow_weights": True}, rngs=nnx.Rngs(0)
    )
    plain = MultiHeadAttention(E, H, kind="softmax", causal=causal, rngs=nnx.Rngs(0))
    x = _x((B, T, E))
    y, inter = nnx.capture(mha, nnx.Intermediate)(x)  # eager, as a user would
    y_jit, inter_jit = _capture(mha, x)  # and compiled
    chex.assert_trees_all_close((y_jit, inter_jit), (y, inter), atol=1e-6)
    assert not nnx.state(mha, nnx.Intermediate), "capture leaves nothing behind"
    (w,) = inter["core"]["attention_weights"].get_value()
    chex.assert_shape(w, (B, H, T, T))
    w = np.asarray(w)
    np.testing.assert_allclose(np.sum(w, axis=-1), 1.0, atol=1e-5)
    assert np.all(w >= 0)
    above = np.triu(np.ones((T, T), bool), k=1)
    if causal:
        assert np.all(w[..., above] == 0)
    else:
        assert np.all(w[..., above] > 0)
    # Recording the weights does not change the output (explicit path == fast path).
    np.testing.assert_allclose(y, _call(plain, x), atol=1e-5, rtol=1e-5)
    # The weights are the ones used: output before the out projection is w @ v.
    p = nnx.state(mha, nnx.Param)
    v = x @ np.asarray(p["value"]["kernel"][...]) + np.asarray(p["value"]["bias"][...])
    heads = np.einsum("bhts,bshm->bthm", w, v.reshape(B, T, H, -1)).reshape(B, T, -1)
    out = heads @ np.asarray(p["out"]["kernel"][...]) + np.asarray(p["out"]["bias"][...])
    np.testing.assert_allclose(out, y, atol=1e-5, rtol=1e-5)


def test_sown_cross_attention_weights_respect_key_lengths():
    mha = MultiHeadAttention(E, H, kind="softmax", attention_options={"sow_weights": True}, rngs=nnx.Rngs(0))
    x, ctx = _x((B, T, E)), _x((B, S, E), seed=2)
    _, inter = _capture(mha, x, ctx, key_lengths=jnp.array([S, 2]))
    (w,) = inter["core"]["attention_weights"].get_value()
    chex.assert_shape(w, (B, H, T, S))
    w = np.asarray(w)
    np.testing.assert_allclose(np.sum(w, -1), 1.0, atol=1e-5)
    assert np.all(w[1, ..., 2:] == 0)
    assert np.all(w[0] > 0)


# --- attention dropout ----------------------------------------------------------------------------


def test_attention_dropout_active_in_train_mode_only():
    mha = MultiHeadAttention(E, H, kind="softmax", causal=True, attention_dropout=0.5, rngs=nnx.Rngs(0))
    ref = MultiHeadAttention(E, H, kind="softmax", causal=True, rngs=nnx.Rngs(7))
    nnx.update(ref, nnx.state(mha, nnx.Param))
    x = _x((B, T, E))
    y_ref = _call(ref, x)

    mha.train()
    y1, y2 = _call(mha, x), _call(mha, x)
    chex.assert_tree_all_finite((y1, y2))
    assert not np.allclose(y1, y_ref, atol=1e-4)
    assert not np.allclose(y1, y2, atol=1e-4), "a new dropout mask per call"

    mha.eval()
    np.testing.assert_allclose(_call(mha, x), y_ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(_call(mha, x), _call(mha, x))


# --- Linen bridge ---------------------------------------------------------------------------------


class _LinenNet(nn.Module):
    kind: str

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(E, name="embed")(x)
        h = bridge.to_linen(MultiHeadAttention, E, H, kind=self.kind, causal=True, name="attn")(h)
        return nn.Dense(3, name="head")(h)


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_linen_bridge_matches_nnx_module(kind):
    x = _x((B, T, 6))
    net = _LinenNet(kind)
    # NNX Dropout layers (softmax's attention dropout, rate 0) draw from a 'dropout' stream.
    variables = jax.jit(net.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    y = jax.jit(net.apply)(variables, x)
    chex.assert_shape(y, (B, T, 3))
    chex.assert_tree_all_finite(y)
    attn_params = variables["params"]["attn"]
    assert set(attn_params) == {"query", "key", "value", "out"}

    # The same computation by hand with an NNX module holding the Linen parameters.
    mha = MultiHeadAttention(E, H, kind=kind, causal=True, rngs=nnx.Rngs(42))
    nnx.update(mha, nnx.State(attn_params))
    p = variables["params"]
    h = x @ p["embed"]["kernel"] + p["embed"]["bias"]
    expected = _call(mha, h) @ p["head"]["kernel"] + p["head"]["bias"]
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=1e-5)
