"""EncoderDecoder: the recurrent decoder (memory reduced once, self-attention as an RNN) equals
the parallel decoder, and greedy decoding in one compiled loop equals parallel argmax decoding."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_transformers import EncoderDecoder, TransformerConfig, greedy_decode

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

V, E = 7, 16
SETUPS = {  # name -> (encoder kind, options), (decoder kind, options)
    "softmax": (("softmax", {}), ("softmax", {})),
    "linear": (("linear", {}), ("linear", {})),
    "favor": (("linear", {"feature_map": "favor"}), ("linear", {"feature_map": "favor"})),
    "linformer-encoder": (("linformer", {"max_length": 9, "projected_length": 4}), ("linear", {})),
    "reformer-encoder": (("reformer", {"chunk_size": 4, "num_buckets": 2}), ("softmax", {})),
}


def _model(name, cross=None):
    (ek, eo), (dk, do) = SETUPS[name]
    cfg = dict(num_layers=2, num_heads=2, model_dim=E, dropout=0.1)
    decoder_extra = (
        {} if cross is None else {"cross_attention": cross[0], "cross_attention_options": cross[1]}
    )
    model = EncoderDecoder(
        TransformerConfig(attention=ek, attention_options=eo, **cfg),
        TransformerConfig(attention=dk, attention_options=do, **cfg, **decoder_extra),
        V,
        rngs=nnx.Rngs(0),
    )
    model.eval()
    return model


def _data(seed=0):
    rng = np.random.default_rng(seed)
    source = rng.integers(1, V, (3, 9)).astype(np.int32)
    lengths = np.array([9, 5, 2], np.int32)
    target = rng.integers(0, V, (3, 6)).astype(np.int32)
    return source, lengths, target


@pytest.mark.parametrize("name", list(SETUPS) + ["linformer-cross"])
def test_recurrent_decoder_equals_parallel_decoder(name):
    cross = None
    if name == "linformer-cross":
        name, cross = "linear", ("linformer", {"max_length": 9, "projected_length": 3})
    model = _model(name, cross)
    source, lengths, target = _data()
    parallel = nnx.jit(lambda m, s, t, n: m(s, t, source_lengths=n))(model, source, target, lengths)
    chex.assert_shape(parallel, (3, 6, V))
    memory = model.encode(source, source_lengths=lengths)
    state = model.init_state(memory.shape[0], memory=memory, memory_lengths=lengths, max_length=6)
    step = nnx.jit(lambda m, state, tok: m.step(state, tok))
    logits = []
    for t in range(6):
        state, logits_BV = step(model, state, target[:, t])
        logits.append(logits_BV)
    np.testing.assert_allclose(np.stack(logits, 1), parallel, atol=2e-4)


@pytest.mark.parametrize("name", ["softmax", "linear", "linformer-encoder"])
def test_greedy_decode_equals_parallel_argmax(name):
    model = _model(name)
    source, lengths, _ = _data(1)
    tokens = greedy_decode(model, source, 6, start_token=0, source_lengths=lengths)
    chex.assert_shape(tokens, (3, 6))
    # Feeding the decoded tokens back in parallel must reproduce each choice.
    target_in = np.concatenate([np.zeros((3, 1), np.int32), np.asarray(tokens)[:, :-1]], 1)
    logits = model(source, target_in, source_lengths=lengths)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))


def test_padding_of_the_source_cannot_change_the_decoding():
    model = _model("linear")
    source, lengths, _ = _data(2)
    other = source.copy()
    other[1, 5:] = 3
    other[2, 2:] = 1
    np.testing.assert_array_equal(
        greedy_decode(model, source, 5, start_token=0, source_lengths=lengths),
        greedy_decode(model, other, 5, start_token=0, source_lengths=lengths),
    )


def test_what_cannot_decode_is_refused():
    cfg = dict(num_layers=1, num_heads=2, model_dim=E)
    reformer_decoder = EncoderDecoder(
        TransformerConfig(attention="softmax", **cfg),
        TransformerConfig(attention="reformer", attention_options={"chunk_size": 4}, **cfg),
        V,
        rngs=nnx.Rngs(0),
    )
    reformer_decoder.eval()
    source, lengths, target = _data()
    assert reformer_decoder(source, target, source_lengths=lengths).shape == (3, 6, V)
    with pytest.raises(ValueError, match="'reformer' has no recurrent form"):
        greedy_decode(reformer_decoder, source, 4, start_token=0, source_lengths=lengths)
    training = _model("linear")
    training.train()
    with pytest.raises(ValueError, match="dropout active"):
        greedy_decode(training, source, 4, start_token=0)
    with pytest.raises(ValueError, match="model_dim 16 and decoder model_dim 32"):
        EncoderDecoder(
            TransformerConfig(**cfg),
            TransformerConfig(num_layers=1, num_heads=2, model_dim=32),
            V,
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(ValueError, match="num_steps must be >= 1"):
        greedy_decode(_model("linear"), source, 0, start_token=0)
