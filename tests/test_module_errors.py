"""Misuse of the modules fails early with a ValueError that says what is wrong."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from linear_transformers import (
    CausalLM,
    Decoder,
    Encoder,
    MultiHeadAttention,
    TransformerConfig,
    generation,
    registered_attention_kinds,
)

E, H = 16, 2


def _config(**overrides):
    kwargs = dict(num_layers=1, num_heads=H, model_dim=E, feed_forward_dim=32, dropout=0.0)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _mha(**kwargs):
    return MultiHeadAttention(E, H, rngs=nnx.Rngs(0), **kwargs)


# --- attention kinds and options -----------------------------------------------------------------


def test_unknown_attention_kind_lists_registered_kinds():
    kinds = registered_attention_kinds()
    assert {"softmax", "linear", "causal-linear"} <= set(kinds)
    with pytest.raises(ValueError, match=r"unknown attention kind 'nope'") as info:
        _mha(kind="nope")
    for kind in kinds:
        assert repr(kind) in str(info.value)
    with pytest.raises(ValueError, match=r"unknown attention kind 'nope'.*registered kinds"):
        _config(attention="nope")
    with pytest.raises(ValueError, match=r"unknown attention kind 'nope'"):
        _config(attention="linear", cross_attention="nope")


def test_unknown_option_lists_the_kinds_options():
    with pytest.raises(ValueError, match=r"'linear' does not accept options \['bogus'\]") as info:
        _mha(kind="linear", attention_options={"bogus": 1})
    for option in ("feature_map", "num_features", "impl", "chunk_size", "eps"):
        assert option in str(info.value)
    with pytest.raises(
        ValueError, match=r"'softmax' does not accept options \['feature_map'\].*softmax_temp"
    ):
        _config(attention="softmax", attention_options={"feature_map": "elu"})


@pytest.mark.parametrize("kind", ["linear", "causal-linear"])
def test_attention_dropout_rejected_for_linear_kinds(kind):
    with pytest.raises(ValueError, match=rf"'{kind}' does not accept options \['attention_dropout'\]"):
        _mha(kind=kind, causal=True, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"does not accept options \['attention_dropout'\]"):
        _config(attention=kind, attention_dropout=0.1)
    # A softmax temperature means nothing to linear attention either.
    with pytest.raises(ValueError, match=r"does not accept options \['softmax_temp'\]"):
        _config(attention=kind, softmax_temp=0.5)
    # Softmax accepts both.
    _config(attention="softmax", attention_dropout=0.1, softmax_temp=0.5)


def test_attention_dropout_out_of_range_for_softmax():
    with pytest.raises(ValueError, match=r"attention_dropout must be in \[0, 1\)"):
        _mha(kind="softmax", attention_dropout=1.0)


def test_num_features_with_elu_feature_map():
    with pytest.raises(ValueError, match=r"num_features.*feature map 'elu' does not take it"):
        _mha(kind="linear", attention_options={"feature_map": "elu", "num_features": 8})
    with pytest.raises(ValueError, match=r"num_features"):
        _mha(kind="linear", attention_options={"num_features": 8})  # elu is the default
    _mha(kind="linear", attention_options={"feature_map": "favor", "num_features": 8})


def test_unknown_feature_map_and_bad_linear_options():
    with pytest.raises(ValueError, match=r"unknown feature map 'tanh'"):
        _mha(kind="linear", attention_options={"feature_map": "tanh"})
    with pytest.raises(ValueError, match=r"unknown impl 'fast'"):
        _mha(kind="linear", attention_options={"impl": "fast"})
    with pytest.raises(ValueError, match=r"chunk_size must be None or an integer >= 1"):
        _mha(kind="linear", attention_options={"chunk_size": 0})
    with pytest.raises(ValueError, match=r"unknown implementation 'flash'"):
        _mha(kind="softmax", attention_options={"implementation": "flash"})


def test_redraw_features_without_random_features():
    with pytest.raises(ValueError, match=r"feature map 'elu' has no random features"):
        _mha(kind="linear").core.redraw_features(jax.random.key(0))


# --- widths ---------------------------------------------------------------------------------------


def test_model_dim_not_divisible_by_num_heads():
    with pytest.raises(ValueError, match=r"model_dim=10 is not divisible by num_heads=3"):
        TransformerConfig(model_dim=10, num_heads=3)
    with pytest.raises(ValueError, match=r"in_features=10 is not divisible by num_heads=3"):
        MultiHeadAttention(10, 3, rngs=nnx.Rngs(0))
    # An explicit per-head width lifts the requirement.
    TransformerConfig(model_dim=10, num_heads=3, query_dim=4)
    MultiHeadAttention(10, 3, query_dim=4, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "model_dim"])
def test_nonpositive_sizes(field):
    with pytest.raises(ValueError, match=rf"TransformerConfig.{field} must be >= 1"):
        TransformerConfig(**{field: 0})


def test_mha_num_heads_below_one():
    with pytest.raises(ValueError, match=r"num_heads must be >= 1"):
        MultiHeadAttention(E, 0, rngs=nnx.Rngs(0))


def test_unknown_activation():
    with pytest.raises(ValueError, match=r"activation 'swish' is unknown.*gelu.*relu"):
        _config(activation="swish")


@pytest.mark.parametrize("field, value", [("dropout", 1.0), ("dropout", -0.1), ("attention_dropout", 1.5)])
def test_dropout_out_of_range(field, value):
    overrides = {field: value}
    if field == "attention_dropout":
        overrides["attention"] = "softmax"
    with pytest.raises(ValueError, match=rf"TransformerConfig.{field} must be in \[0, 1\)"):
        _config(**overrides)


# --- masks and causality ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind, causal", [("linear", False), ("linear", True), ("causal-linear", True)])
def test_explicit_mask_rejected_by_linear_attention(kind, causal):
    mha = _mha(kind=kind, causal=causal)
    x = jnp.ones((1, 4, E))
    mask = jnp.tril(jnp.ones((4, 4), bool))
    with pytest.raises(ValueError, match=r"cannot honour an arbitrary \[T, S\] mask.*key_lengths"):
        mha(x, mask=mask)
    encoder = Encoder(_config(attention=kind), causal=causal, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"cannot honour an arbitrary"):
        encoder(x, mask=mask)


def test_causal_linear_used_non_causally():
    with pytest.raises(ValueError, match=r"'causal-linear' is causal by definition.*kind='linear'"):
        Encoder(_config(attention="causal-linear"), causal=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'causal-linear' is causal by definition"):
        _mha(kind="causal-linear", causal=False)
    with pytest.raises(ValueError, match=r"'causal-linear' is causal by definition"):
        Decoder(_config(attention="causal-linear", cross_attention="causal-linear"), rngs=nnx.Rngs(0))
    # The causal uses are fine.
    Encoder(_config(attention="causal-linear"), causal=True, rngs=nnx.Rngs(0))
    Decoder(_config(attention="causal-linear"), rngs=nnx.Rngs(0))


def test_causal_layer_rejects_a_context():
    with pytest.raises(ValueError, match=r"causal attention is self-attention; got a context"):
        _mha(kind="linear", causal=True)(jnp.ones((1, 3, E)), jnp.ones((1, 3, E)))


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_step_on_non_causal_layer(kind):
    noncausal = _mha(kind=kind, causal=False)
    with pytest.raises(ValueError, match=r"init_state is the recurrent form of causal.*causal=True"):
        noncausal.init_state(2, max_length=5)
    state = _mha(kind=kind, causal=True).init_state(2, max_length=5)
    with pytest.raises(ValueError, match=r"step is the recurrent form of causal.*non-causal"):
        noncausal.step(state, jnp.ones((2, E)))
    with pytest.raises(ValueError, match=r"non-causal"):
        Encoder(_config(attention=kind), causal=False, rngs=nnx.Rngs(0)).init_state(2, max_length=5)


def test_softmax_init_state_without_max_length():
    with pytest.raises(ValueError, match=r"needs max_length"):
        _mha(kind="softmax", causal=True).init_state(2)
    lm = CausalLM(_config(attention="softmax"), 7, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"needs max_length"):
        lm.init_state(2)
    # Linear attention's state does not grow, so it needs none.
    _mha(kind="linear", causal=True).init_state(2)


def test_softmax_kv_cache_overflow():
    mha = _mha(kind="softmax", causal=True)
    state = mha.init_state(1, max_length=2)
    full = state._replace(length=jnp.array(2, jnp.int32))  # as after two steps
    with pytest.raises(ValueError, match=r"KV cache is full \(2 steps\).*larger max_length"):
        mha.step(full, jnp.ones((1, E)))  # eager: the filled length is known


# --- config and generation ---------------------------------------------------------------------------


def test_from_kwargs_unknown_argument():
    with pytest.raises(ValueError, match=r"from_kwargs: unknown arguments \['bogus'\].*n_layers"):
        TransformerConfig.from_kwargs(n_layers=2, bogus=3)


def test_from_kwargs_rejects_names_outside_the_authors_set():
    # feature_map goes to attention_options; unknown authors' names are not silently dropped.
    with pytest.raises(ValueError, match=r"unknown arguments \['num_features'\]"):
        TransformerConfig.from_kwargs(feature_map="elu", num_features=8)


@pytest.fixture(scope="module")
def lm():
    model = CausalLM(_config(), 7, rngs=nnx.Rngs(0))
    model.eval()
    return model


@pytest.mark.parametrize("prompt", [jnp.zeros((2, 0), jnp.int32), jnp.zeros((3,), jnp.int32)])
def test_generate_rejects_empty_or_unbatched_prompt(lm, prompt):
    with pytest.raises(ValueError, match=r"generate: prompt must be \[batch, length >= 1\]"):
        generation.generate(lm, prompt, 3, key=jax.random.key(0))


def test_generate_rejects_negative_steps_and_temperature(lm):
    prompt = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"num_steps must be >= 0"):
        generation.generate(lm, prompt, -1, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"temperature must be >= 0"):
        generation.generate(lm, prompt, 2, key=jax.random.key(0), temperature=-1.0)


def test_causal_lm_vocab_size():
    with pytest.raises(ValueError, match=r"vocab_size must be >= 1"):
        CausalLM(_config(), 0, rngs=nnx.Rngs(0))
