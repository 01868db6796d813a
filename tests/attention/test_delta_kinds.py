"""The delta-rule kinds ("deltanet", "gated-deltanet", "kda"): their decays and beta, and their
parallel form, steps and prefills computing the same thing, the short convolution's state
included; packed sequences equal to separate ones; options checked where they are given.

Legend: B batch, T time, E layer input width, H heads, D key features per head.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_transformers import MultiHeadAttention, TransformerConfig, attention
from linear_transformers.attention import check_attention_options

# float32 agreement between forms, with float32 matrix products on every platform.
pytestmark = pytest.mark.usefixtures("float32_products")

B, T, E, H = 2, 11, 16, 2
KINDS = ["deltanet", "gated-deltanet", "kda"]
_call = nnx.jit(lambda m, x, ids: m(x, segment_ids=ids))
_step = nnx.jit(lambda m, state, x: m.step(state, x))
_prefill = nnx.jit(lambda m, state, x, key_lengths: m.prefill(state, x, key_lengths=key_lengths))


def _mha(kind, seed=0, **options):
    return MultiHeadAttention(E, H, kind=kind, causal=True, attention_options=options, rngs=nnx.Rngs(seed))


def _x(seed=1, dtype=jnp.float32, batch=B):
    return jax.random.normal(jax.random.key(seed), (batch, T, E), dtype)


def test_decays_are_mamba2s_and_beta_a_sigmoid():
    x = _x()
    for kind, shape in (("gated-deltanet", (B, T, H)), ("kda", (B, T, H, E // H))):
        core = _mha(kind).core
        g = np.asarray(core.log_decay(x))
        assert g.shape == shape and (g < 0).all()
        if kind == "gated-deltanet":
            logits = np.asarray(core.decay_projection(x)) + np.asarray(core.dt_bias[...])
            want = -np.exp(np.asarray(core.A_log[...])) * np.log1p(np.exp(logits))
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    assert _mha("deltanet").core.log_decay(x) is None
    beta = np.asarray(_mha("deltanet").core.beta(x))
    assert beta.shape == (B, T, H) and (beta > 0).all() and (beta < 1).all()
    doubled = _mha("deltanet", allow_neg_eigval=True).core.beta(x)
    np.testing.assert_allclose(doubled, 2 * beta, rtol=1e-6)


@pytest.mark.parametrize(
    "kind,options", [(k, {}) for k in KINDS] + [("deltanet", {"conv_size": None, "output_gate": True})]
)
def test_parallel_steps_and_prefills_agree(kind, options):
    mha = _mha(kind, **options)
    x = _x(2)
    parallel = _call(mha, x, None)
    state, steps = mha.init_state(B), []
    for t in range(T):
        state, y_t = _step(mha, state, x[:, t])
        steps.append(y_t)
    chex.assert_trees_all_close(jnp.stack(steps, 1), parallel, rtol=2e-5, atol=2e-5)
    blocks, state2 = [], mha.init_state(B)
    for lo, hi in ((0, 3), (3, 4), (4, T)):
        state2, y = _prefill(mha, state2, x[:, lo:hi], None)
        blocks.append(y)
    chex.assert_trees_all_close(jnp.concatenate(blocks, 1), parallel, rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(state2, state, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_equal_separate_ones_and_padding_leaves_the_state(kind):
    """Row 0 packs a sequence of 5 and one of 4 before 2 padding steps: each as if alone (the
    convolution's window stops at the second one's start)."""
    mha = _mha(kind)
    x = _x(3)
    ids = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 2, [3] * T])
    packed = _call(mha, x, ids)
    chex.assert_trees_all_close(packed[0, :5], _call(mha, x[:1, :5], None)[0], rtol=2e-5, atol=2e-5)
    chex.assert_trees_all_close(packed[0, 5:9], _call(mha, x[:1, 5:9], None)[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(packed[0, 9:], 0)
    state, _ = _prefill(mha, mha.init_state(B), x, jnp.asarray([T, 6]))
    short, _ = _prefill(mha, mha.init_state(1), x[1:, :6], None)
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[1:], state), short, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind):
    mha = _mha(kind)
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(mha, _x(4))
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0, path


def test_bfloat16_layers_keep_float32_states_and_a_model_builds():
    bf16 = MultiHeadAttention(E, H, kind="kda", causal=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(5))
    assert bf16(_x(6).astype(jnp.bfloat16)).dtype == jnp.bfloat16
    state = bf16.init_state(B)
    assert state.linear.s_BHFM.dtype == jnp.float32 and all(s.dtype == jnp.float32 for s in state.conv)
    config = TransformerConfig(num_layers=1, num_heads=H, model_dim=E, attention="gated-deltanet")
    assert config.cross_kind == "linear"


@pytest.mark.parametrize(
    "kind,options,message",
    [
        ("deltanet", {"implementation": "associative_scan"}, r"unknown implementation 'associative_scan'"),
        ("kda", {"conv_size": 0}, r"conv_size must be None or an integer >= 1, got 0"),
        ("gated-deltanet", {"output_gate": 1}, r"output_gate must be True or False, got 1"),
        ("deltanet", {"norm_eps": 0.0}, r"norm_eps must be > 0, got 0.0"),
        ("deltanet", {"feature_map": "elu"}, r"does not accept options \['feature_map'\]"),
    ],
)
def test_bad_options_are_named(kind, options, message):
    with pytest.raises(ValueError, match=message):
        check_attention_options(kind, options)


@pytest.mark.parametrize("kind", KINDS)
def test_the_kinds_are_causal_self_attention_with_a_recurrent_form(kind):
    with pytest.raises(ValueError, match=rf"'{kind}' is causal by definition"):
        MultiHeadAttention(E, H, kind=kind, causal=False, rngs=nnx.Rngs(0))
    cls = attention.attention_class(kind)
    assert cls.has_recurrent_form and cls.supports_segments and cls.has_sequence_parallel_form
