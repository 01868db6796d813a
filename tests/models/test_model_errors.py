"""Misuse of the layers and models fails early, in one line naming the bad value: wrong shapes
and options, integer options given as bools or floats, token ids outside the vocabulary, another
model's recurrent state, sub-pixels outside an image model's classes, converter weights that are
integers or not finite, and a damaged .npz state dict."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import small_config
from commands import run_module
from fast_transformers_cases import case_config, load_case, split_case
from flax import nnx

from linear_transformers import (
    CausalLM,
    Decoder,
    Encoder,
    EncoderDecoder,
    ImageGenerator,
    MultiHeadAttention,
    TransformerConfig,
    generation,
    interop,
    ops,
    registered_attention_kinds,
)
from linear_transformers.attention import check_attention_options, make_attention_core
from linear_transformers.generation import generate
from linear_transformers.interop import encoder_from_fast_transformers, load_state_dict
from linear_transformers.seq2seq import greedy_decode

E, H = 16, 2


def _config(**overrides):
    return small_config(**{"num_heads": H, "model_dim": E, **overrides})


def _mha(**kwargs):
    return MultiHeadAttention(E, H, rngs=nnx.Rngs(0), **kwargs)


@pytest.fixture(scope="module")
def lm():
    model = CausalLM(_config(), 7, rngs=nnx.Rngs(0))
    model.eval()
    return model


INTEGER_OPTIONS = [
    ("linear", "chunk_size"),
    ("causal-linear", "chunk_size"),
    ("gla", "chunk_size"),
    ("gla", "gate_low_rank_dim"),
    ("retention", "chunk_size"),
    ("simple-gla", "chunk_size"),
    ("reformer", "chunk_size"),
    ("reformer", "num_rounds"),
    ("reformer", "num_buckets"),
    ("linformer", "projected_length"),
    ("linformer", "max_length"),
]


V = 11


def _config_of(kind="linear"):
    return small_config(kind, model_dim=8, feed_forward_dim=None)


def _lm(kind="linear"):
    model = CausalLM(_config_of(kind), V, rngs=nnx.Rngs(0))
    model.eval()
    return model


def _damaged_archives(tmp_path):
    _, state = split_case(load_case("encoder_linear"))
    good = tmp_path / "good.npz"
    np.savez(good, **state)
    data = good.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 3 : len(data) // 3 + 64] = bytes(
        b ^ 0xFF for b in flipped[len(data) // 3 : len(data) // 3 + 64]
    )
    damaged = {
        "truncated.npz": data[: len(data) // 2],
        "garbage.npz": os.urandom(300),
        "flipped.npz": bytes(flipped),
    }
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
    return [tmp_path / name for name in damaged]


B, T, S, H, D = 2, 5, 7, 2, 4


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
    for option in ("feature_map", "num_features", "implementation", "chunk_size", "eps"):
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
    with pytest.raises(ValueError, match=r"unknown implementation 'fast'"):
        _mha(kind="linear", attention_options={"implementation": "fast"})
    with pytest.raises(ValueError, match=r"chunk_size must be None or an integer >= 1"):
        _mha(kind="linear", attention_options={"chunk_size": 0})
    with pytest.raises(ValueError, match=r"unknown implementation 'flash'"):
        _mha(kind="softmax", attention_options={"implementation": "flash"})


def test_redraw_features_without_random_features():
    with pytest.raises(ValueError, match=r"feature map 'elu' has no random features"):
        _mha(kind="linear").core.redraw_features(jax.random.key(0))


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


def test_a_layer_input_of_another_shape_is_named_at_the_layer():
    """Not a reshape or a product's shape error from inside the layer."""
    causal, cross = _mha(kind="gla", causal=True), _mha(kind="linear", causal=False)
    x = jnp.ones((2, 3, E))
    named = "MultiHeadAttention \\('{}'\\): {} must be \\[{}\\]{}, got {}"
    cases = [
        (lambda: causal(x[0]), ("gla", "x", "batch, time, 16", "", r"shape \(3, 16\)")),
        (lambda: causal(x[..., :-1]), ("gla", "x", "batch, time, 16", "", r"shape \(2, 3, 15\)")),
        (lambda: causal.step(causal.init_state(2), x), ("gla", "x", "batch, 16", "", r"shape \(2, 3, 16\)")),
        (lambda: causal.prefill(causal.init_state(2), x[0]), ("gla", "x", "batch, time, 16", "", r"shape")),
        (lambda: causal(x.tolist()), ("gla", "x", "batch, time, 16", "", "a list")),
        (
            lambda: cross(x, jnp.ones((2, 5, E + 1))),
            ("linear", "context", "batch, time, 16", " with the queries' batch of 2", r"shape \(2, 5, 17\)"),
        ),
        (
            lambda: cross(x, jnp.ones((1, 5, E))),
            ("linear", "context", "batch, time, 16", " with the queries' batch of 2", r"shape \(1, 5, 16\)"),
        ),
        (lambda: cross.init_memory(x[0]), ("linear", "context", "batch, time, 16", "", r"shape \(3, 16\)")),
    ]
    for call, parts in cases:
        with pytest.raises(ValueError, match=named.format(*parts)):
            call()


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


def test_config_from_builder_kwargs_unknown_argument():
    with pytest.raises(
        ValueError, match=r"config_from_builder_kwargs: unknown arguments \['bogus'\].*n_layers"
    ):
        interop.config_from_builder_kwargs(n_layers=2, bogus=3)


def test_config_from_builder_kwargs_rejects_names_outside_the_authors_set():
    # feature_map goes to attention_options; unknown authors' names are not silently dropped.
    with pytest.raises(ValueError, match=r"unknown arguments \['num_features'\]"):
        interop.config_from_builder_kwargs(feature_map="elu", num_features=8)


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


@pytest.mark.parametrize("kind,option", INTEGER_OPTIONS)
def test_integer_options_take_numpy_integers_and_refuse_bools_and_floats_by_name(kind, option):
    options = check_attention_options(kind, {option: np.int64(64)})
    assert getattr(options, option) == 64 and type(getattr(options, option)) is int
    for bad in (True, 64.5, 64.0):
        with pytest.raises(ValueError, match=rf"{option} must be .*got {bad!r} \({type(bad).__name__}\)"):
            check_attention_options(kind, {option: bad})


def test_a_numpy_chunk_size_runs_the_layer_and_the_op(float32_products):
    core = make_attention_core(
        "causal-linear",
        causal=True,
        num_heads=2,
        head_dim=4,
        value_dim=4,
        rngs=nnx.Rngs(0),
        options={"chunk_size": np.int64(4)},
    )
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
    np.testing.assert_allclose(
        core(q, q, q), ops.causal_linear_attention(q, q, q, implementation="reference"), rtol=1e-5, atol=1e-5
    )
    ops.causal_linear_attention(q, q, q, chunk_size=np.int32(4))
    with pytest.raises(ValueError, match=r"chunk_size must be None or an integer >= 1, got True \(bool\)"):
        ops.causal_linear_attention(q, q, q, chunk_size=True)


def test_transformer_config_sizes_take_numpy_integers_and_refuse_bools_and_floats():
    config = TransformerConfig(
        num_layers=np.int64(1),
        num_heads=np.int32(2),
        model_dim=np.int64(8),
        attention="linear",
        attention_options={"chunk_size": np.int64(4)},
    )
    assert type(config.num_layers) is int and type(config.model_dim) is int
    for field, bad in (("num_layers", True), ("num_heads", 2.5), ("model_dim", 8.0), ("query_dim", False)):
        with pytest.raises(
            ValueError, match=rf"TransformerConfig.{field} must be (None or )?an integer, got {bad!r}"
        ):
            TransformerConfig(**{"num_layers": 1, "num_heads": 2, "model_dim": 8, field: bad})


def test_token_ids_outside_the_vocabulary_are_refused_where_concrete():
    model = _lm()
    bad = jnp.asarray([[1, 2, V]])
    with pytest.raises(
        ValueError, match=rf"CausalLM: tokens must be ids in \[0, {V}\) .*got values in \[1, {V}\]"
    ):
        model(bad)
    with pytest.raises(ValueError, match=r"CausalLM.prefill: tokens must be ids in \[0, 11\)"):
        model.prefill(model.init_state(1), bad)
    with pytest.raises(ValueError, match=r"CausalLM.step: tokens must be ids in \[0, 11\) .*\[-1, -1\]"):
        model.step(model.init_state(1), jnp.asarray([-1]))
    with pytest.raises(ValueError, match=r"CausalLM: tokens must be integer ids .*float32"):
        model(jnp.ones((1, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"generate: prompt tokens must be ids in \[0, 11\)"):
        generate(model, bad, 2, key=jax.random.key(0))
    # Traced ids cannot be read: no check, no cost.
    assert jax.jit(lambda t: model(t))(jnp.asarray([[1, 2, 3]])).shape == (1, 3, V)

    seq2seq = EncoderDecoder(_config_of(), _config_of(), V, rngs=nnx.Rngs(0))
    seq2seq.eval()
    good = jnp.asarray([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"EncoderDecoder.encode: source tokens must be ids in \[0, 11\)"):
        seq2seq(bad, good)
    with pytest.raises(ValueError, match=r"EncoderDecoder.decode: target tokens must be ids in \[0, 11\)"):
        seq2seq(good, bad)
    with pytest.raises(ValueError, match=r"greedy_decode: prefix tokens must be ids in \[0, 11\)"):
        greedy_decode(seq2seq, good, 2, start_token=0, prefix=bad)
    with pytest.raises(ValueError, match=r"greedy_decode: start_token must be ids in \[0, 11\) .*\[11, 11\]"):
        greedy_decode(seq2seq, good, 2, start_token=V)

    images = ImageGenerator(_config_of(), num_classes=4, num_mixtures=2, max_length=6, rngs=nnx.Rngs(0))
    images.eval()
    with pytest.raises(ValueError, match=r"ImageGenerator.step: input tokens must be ids in \[0, 5\)"):
        images.step(images.init_state(1), jnp.asarray([7]))
    with pytest.raises(ValueError, match=r"ImageGenerator.prefill: input tokens must be integer ids"):
        images.prefill(images.init_state(1), jnp.ones((1, 2)))


@pytest.mark.parametrize(
    "kind,other,expected,got",
    [
        ("linear", "softmax", "LinearState", "KVCache"),
        ("softmax", "linear", "KVCache", "LinearState"),
        ("linear", "gla", "LinearState", "GatedState"),
        ("gla", "softmax", "GatedState", "KVCache"),
    ],
)
def test_another_kinds_state_is_named_not_failed_on_deep_inside(kind, other, expected, got):
    model, state = _lm(kind), _lm(other).init_state(2, max_length=4)
    for call in (
        lambda: model.step(state, jnp.zeros((2,), jnp.int32)),
        lambda: model.prefill(state, jnp.zeros((2, 3), jnp.int32)),
    ):
        with pytest.raises(ValueError, match=rf"the state is {got}\(.*layers keep {expected}\(.*init_state"):
            call()


def test_another_models_state_is_named():
    model = _lm()
    deeper = CausalLM(
        TransformerConfig(num_layers=2, num_heads=2, model_dim=8, attention="linear", dropout=0.0),
        V,
        rngs=nnx.Rngs(0),
    )
    deeper.eval()
    with pytest.raises(ValueError, match=r"stack the states of this stack's 1 layers .*arrays lead with 2\."):
        model.step(deeper.init_state(1), jnp.zeros((1,), jnp.int32))
    seq2seq = EncoderDecoder(_config_of(), _config_of(), V, rngs=nnx.Rngs(0))
    seq2seq.eval()
    memory = seq2seq.encode(jnp.asarray([[1, 2]]))
    with pytest.raises(ValueError, match=r"CausalLM.step: the state must be a LMState .*got Seq2SeqState\("):
        model.step(seq2seq.init_state(1, memory=memory, max_length=4), jnp.zeros((1,), jnp.int32))
    with pytest.raises(
        ValueError, match=r"EncoderDecoder.prefill: the state must be a Seq2SeqState .*LMState"
    ):
        seq2seq.prefill(model.init_state(1), jnp.zeros((1, 2), jnp.int32))


def test_the_converter_refuses_integer_or_nonfinite_weights_by_key():
    meta, state = split_case(load_case("encoder_linear"))
    key = "layers.0.linear1.bias"
    encoder_from_fast_transformers(state, case_config(meta))
    with pytest.raises(ValueError, match=rf"'{key}' holds int64 values; weights must be floating point"):
        encoder_from_fast_transformers({**state, key: np.arange(state[key].size)}, case_config(meta))
    nan = state[key].copy()
    nan[[1, 3]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match=rf"'{key}' is not finite: 2 of {nan.size} values are NaN or inf"):
        encoder_from_fast_transformers({**state, key: nan}, case_config(meta))


def test_a_damaged_npz_is_one_clear_error_naming_the_file(tmp_path):
    for path in _damaged_archives(tmp_path):
        with pytest.raises(ValueError) as error:
            load_state_dict(path)
        message = str(error.value)
        assert f"{str(path)!r} is not a readable .npz state dict" in message
        assert "allow_pickle" not in message and "\n" not in message
    path = tmp_path / "truncated.npz"
    rc, last, err = run_module("experiments.sample", f"--fast_transformers_checkpoint={path}")
    assert rc == 1, err[-3000:]
    assert last.startswith(f"sample: error: {str(path)!r} is not a readable .npz state dict"), last
    assert "Traceback" not in err and "allow_pickle" not in err


def test_image_generator_refuses_sub_pixels_outside_its_classes():
    from flax import nnx

    from linear_transformers import ImageGenerator, TransformerConfig

    config = TransformerConfig(
        num_layers=1, num_heads=2, model_dim=8, feed_forward_dim=16, dropout=0.0, attention="linear"
    )
    model = ImageGenerator(config, num_classes=17, num_mixtures=2, max_length=6, rngs=nnx.Rngs(0))
    x = np.zeros((2, 6), np.int32)
    assert np.isfinite(float(model.nll(x)))
    for bad, where in ((300, "nll"), (-1, "log_prob"), (17, "__call__")):
        x_bad = x.copy()
        x_bad[1, 3] = bad
        run = {"nll": model.nll, "log_prob": model.log_prob, "__call__": model}[where]
        low, high = min(bad, 0), max(bad, 0)
        with pytest.raises(
            ValueError, match=re.escape(f"sub-pixels must be in [0, 17), got values in [{low}, {high}]")
        ):
            run(x_bad)


@pytest.mark.parametrize(
    "argument, value, expected",
    [
        (
            "segment_ids",
            jnp.ones((2, 31), jnp.int32),
            r"segment_ids must be .* shape \(2, 32\).*shape \(2, 31\)",
        ),
        ("segment_ids", jnp.ones((32,), jnp.int32), r"segment_ids must be .* shape \(2, 32\).*shape \(32,\)"),
        (
            "positions",
            jnp.zeros((2, 5), jnp.int32),
            r"positions must be .* \(2, 32\) or \(32,\).*shape \(2, 5\)",
        ),
        ("key_lengths", jnp.array([3]), r"key_lengths must be .* shape \(2,\).*shape \(1,\)"),
    ],
)
def test_a_causal_lm_names_a_sequence_argument_that_does_not_fit_the_tokens(argument, value, expected):
    lm = CausalLM(_config_of(), V, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"^CausalLM: {expected}"):
        lm(jnp.zeros((2, 32), jnp.int32), **{argument: value})


def test_a_state_made_for_another_batch_is_named_by_every_model():
    lm, images = (
        _lm(),
        ImageGenerator(_config_of(), num_classes=4, num_mixtures=2, max_length=6, rngs=nnx.Rngs(0)),
    )
    seq2seq = EncoderDecoder(_config_of(), _config_of(), V, rngs=nnx.Rngs(0))
    seq2seq.eval()
    tokens = jnp.zeros((2, 3), jnp.int32)
    seq2seq_state = seq2seq.init_state(3, memory=seq2seq.encode(jnp.zeros((3, 4), jnp.int32)))
    calls = {
        "CausalLM.step": lambda: lm.step(lm.init_state(3), tokens[:, 0]),
        "CausalLM.prefill": lambda: lm.prefill(lm.init_state(3), tokens),
        "ImageGenerator.step": lambda: images.step(images.init_state(3), tokens[:, 0]),
        "ImageGenerator.prefill": lambda: images.prefill(images.init_state(3), tokens),
        "EncoderDecoder.step": lambda: seq2seq.step(seq2seq_state, tokens[:, 0]),
        "EncoderDecoder.prefill": lambda: seq2seq.prefill(seq2seq_state, tokens),
    }
    for where, call in calls.items():
        with pytest.raises(
            ValueError, match=rf"^{where}: the state holds a batch of 3 .* the tokens a batch of 2"
        ):
            call()


def test_an_encoder_decoder_names_lengths_that_do_not_fit_the_tokens():
    model = EncoderDecoder(_config_of(), _config_of(), V, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"^EncoderDecoder.encode: source_lengths must be .* \(2,\).*\(1,\)"):
        model(tokens, tokens, source_lengths=jnp.array([3]))
    with pytest.raises(ValueError, match=r"^EncoderDecoder.decode: target_lengths must be .* \(2,\).*\(3,\)"):
        model(tokens, tokens, target_lengths=jnp.array([1, 2, 3]))


@pytest.mark.parametrize("kind", ["retention", "simple-gla", "gla"])
def test_a_gated_kind_refuses_random_features_in_its_config_with_advice_a_config_can_follow(kind):
    with pytest.raises(
        ValueError, match=r"feature_map 'favor' draws random features, which only the 'linear'"
    ):
        TransformerConfig(attention=kind, attention_options={"feature_map": "favor"})
    TransformerConfig(attention="linear", attention_options={"feature_map": "favor"})
