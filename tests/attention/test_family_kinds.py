"""The gated kinds ("retention", "simple-gla", "gla"): their decays, and their parallel form,
steps and prefills computing the same thing; options checked where they are given.

Legend: B batch, T time, E layer input width, H heads, D key features per head, M value
features per head.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_transformers import MultiHeadAttention, TransformerConfig, attention, ops
from linear_transformers.attention import check_attention_options

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

B, T, E, H = 2, 11, 16, 2
GATED = ["retention", "simple-gla", "gla"]
# Compiled once per module structure and shape, and reused: op-by-op dispatch is slow on CPU.
_call = nnx.jit(lambda m, x: m(x))
_step = nnx.jit(lambda m, state, x: m.step(state, x))
_prefill = nnx.jit(lambda m, state, x, key_lengths: m.prefill(state, x, key_lengths=key_lengths))


def _mha(kind, seed=0, **options):
    return MultiHeadAttention(E, H, kind=kind, causal=True, attention_options=options, rngs=nnx.Rngs(seed))


def _x(seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (B, T, E), dtype)


def test_retention_decays_are_retnets():
    np.testing.assert_allclose(
        np.exp(attention.retention_log_decay(4)), 1 - 2.0 ** (-5 - np.arange(4)), rtol=1e-6
    )


@pytest.mark.parametrize("kind", ["simple-gla", "gla"])
def test_input_decays_are_log_sigmoids_over_the_normaliser(kind):
    core = _mha(kind, gate_logit_normalizer=4.0).core
    g = np.asarray(core.log_decay(_x()))
    assert g.shape == ((B, T, H) if kind == "simple-gla" else (B, T, H, E // H))
    assert (g <= 0).all() and (g >= -np.log(2.0) * 50).all()
    projection = core.decay_projection if kind == "simple-gla" else None
    if projection is not None:
        logits = np.asarray(projection(_x()))
        np.testing.assert_allclose(g, np.log(1 / (1 + np.exp(-logits))) / 4.0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", GATED)
def test_parallel_steps_and_prefills_agree(kind):
    """float32: the op's forms agree to float64 rounding (test_gated_linear_attention.py); here
    the layer around them, gates and norm included."""
    mha = _mha(kind)
    x = _x(2)
    parallel = _call(mha, x)
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
    np.testing.assert_array_equal(state.position, T)


@pytest.mark.parametrize("kind", GATED)
def test_prefill_with_key_lengths_leaves_the_state_of_the_real_tokens(kind):
    mha = _mha(kind)
    x = _x(3)
    lengths = jnp.asarray([T, 6])
    state, _ = _prefill(mha, mha.init_state(B), x, lengths)
    short, _ = _prefill(mha, mha.init_state(1), x[1:, :6], None)
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[1:], state), short, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", GATED)
def test_gradients_reach_every_parameter_the_decays_included(kind):
    mha = _mha(kind)
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(mha, _x(4))
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0, path


@pytest.mark.parametrize("kind", GATED)
def test_bfloat16_layers_keep_float32_states_and_agree_with_float32(kind):
    config = dict(num_layers=1, num_heads=H, model_dim=E, attention=kind, dropout=0.0)
    f32 = MultiHeadAttention(E, H, kind=kind, causal=True, rngs=nnx.Rngs(5))
    bf16 = MultiHeadAttention(E, H, kind=kind, causal=True, dtype=jnp.bfloat16, rngs=nnx.Rngs(5))
    x = _x(6)
    y16 = _call(bf16, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), _call(f32, x), rtol=0.1, atol=0.1)
    state = bf16.init_state(B)
    assert state.linear.s_BHFM.dtype == jnp.float32
    TransformerConfig(**config)  # the kind builds from a config too


@pytest.mark.parametrize(
    "kind,options,message",
    [
        ("retention", {"norm": "batch"}, r"norm must be one of \('rms', 'group', None\), got 'batch'"),
        ("simple-gla", {"gate_logit_normalizer": 0.0}, r"gate_logit_normalizer must be > 0, got 0.0"),
        ("gla", {"gate_low_rank_dim": 0}, r"gate_low_rank_dim must be an integer >= 1, got 0"),
        ("gla", {"implementation": "fast"}, r"unknown implementation 'fast'"),
        ("gla", {"feature_map": "nope"}, r"unknown feature map 'nope'"),
        ("retention", {"rotate": True}, r"does not accept options \['rotate'\]"),
    ],
)
def test_bad_options_are_named(kind, options, message):
    with pytest.raises(ValueError, match=message):
        check_attention_options(kind, options)


@pytest.mark.parametrize("kind", GATED)
def test_gated_kinds_are_causal_self_attention(kind):
    with pytest.raises(ValueError, match=rf"'{kind}' is causal by definition"):
        MultiHeadAttention(E, H, kind=kind, causal=False, rngs=nnx.Rngs(0))
    # A decoder with a gated self-attention cross-attends with non-causal linear attention.
    config = TransformerConfig(num_layers=1, num_heads=H, model_dim=E, attention=kind)
    assert config.cross_kind == "linear"


def test_the_family_is_registered_with_recurrent_and_sequence_parallel_forms():
    for kind in GATED:
        cls = attention.attention_class(kind)
        assert cls.has_recurrent_form and cls.has_sequence_parallel_form and cls.supports_segments
    assert set(GATED) <= set(attention.sequence_parallel_kinds())
    assert ops.LINEAR_IMPLEMENTATIONS == ("reference", "associative_scan", "chunked", "scan", "pallas")
