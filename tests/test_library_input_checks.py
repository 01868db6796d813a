"""The library refuses what it would otherwise misread, in one line naming the bad value: integer
options given as bools or floats, token ids outside the vocabulary, another model's recurrent
state, converter weights that are integers or not finite, and a damaged .npz state dict."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_cli_errors import run_module
from test_fast_transformers_interop import _config, _load, _split

from linear_transformers import CausalLM, EncoderDecoder, ImageGenerator, TransformerConfig, ops
from linear_transformers.attention import check_attention_options, make_attention_core
from linear_transformers.generation import generate
from linear_transformers.interop import encoder_from_fast_transformers, load_state_dict
from linear_transformers.seq2seq import greedy_decode

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

# --- integer options ---------------------------------------------------------------------------

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


@pytest.mark.parametrize("kind,option", INTEGER_OPTIONS)
def test_integer_options_take_numpy_integers_and_refuse_bools_and_floats_by_name(kind, option):
    options = check_attention_options(kind, {option: np.int64(64)})
    assert getattr(options, option) == 64 and type(getattr(options, option)) is int
    for bad in (True, 64.5, 64.0):
        with pytest.raises(ValueError, match=rf"{option} must be .*got {bad!r} \({type(bad).__name__}\)"):
            check_attention_options(kind, {option: bad})


def test_a_numpy_chunk_size_runs_the_layer_and_the_op():
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
        core(q, q, q), ops.causal_linear_attention(q, q, q, impl="quadratic"), rtol=1e-5, atol=1e-5
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


# --- token ids ---------------------------------------------------------------------------------

V = 11


def _config_of(kind="linear"):
    return TransformerConfig(num_layers=1, num_heads=2, model_dim=8, attention=kind, dropout=0.0)


def _lm(kind="linear"):
    model = CausalLM(_config_of(kind), V, rngs=nnx.Rngs(0))
    model.eval()
    return model


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


# --- another model's state ---------------------------------------------------------------------


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


# --- the converter -----------------------------------------------------------------------------


def test_the_converter_refuses_integer_or_nonfinite_weights_by_key():
    meta, state = _split(_load("encoder_linear"))
    key = "layers.0.linear1.bias"
    encoder_from_fast_transformers(state, _config(meta))
    with pytest.raises(ValueError, match=rf"'{key}' holds int64 values; weights must be floating point"):
        encoder_from_fast_transformers({**state, key: np.arange(state[key].size)}, _config(meta))
    nan = state[key].copy()
    nan[[1, 3]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match=rf"'{key}' is not finite: 2 of {nan.size} values are NaN or inf"):
        encoder_from_fast_transformers({**state, key: nan}, _config(meta))


def _damaged_archives(tmp_path):
    _, state = _split(_load("encoder_linear"))
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
