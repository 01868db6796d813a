"""Packed variable-length batches: `pack_sequences`, and every module computing each segment of
a packed row as if it were alone (parallel, prefill, then decoding).

Legend: B batch (rows), T time, E model width, V vocabulary.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import small_config
from flax import nnx

from linear_transformers import (
    CausalLM,
    Decoder,
    Encoder,
    layer_stack,
    pack_sequences,
    segment_positions,
)
from linear_transformers.packing import continue_positions, next_positions

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

V, E = 13, 16
CAUSAL_KINDS = ["softmax", "linear", "retention", "simple-gla", "gla"]


# Compiled once per model structure and shape, and reused: op-by-op dispatch is slow on CPU.
_call = nnx.jit(
    lambda model, x, segment_ids, positions: model(x, segment_ids=segment_ids, positions=positions)
)
_prefill = nnx.jit(
    lambda model, state, tokens, segment_ids: model.prefill(state, tokens, segment_ids=segment_ids)
)
_step = nnx.jit(lambda model, state, token: model.step(state, token))
_decode = nnx.jit(
    lambda model, x, memory, ids, memory_ids: model(x, memory, segment_ids=ids, memory_segment_ids=memory_ids)
)


def _config(attention, **kw):
    return small_config(attention, num_layers=2, model_dim=E, feed_forward_dim=None, **kw)


def _sequences(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, V, size=n).astype(np.int32) for n in lengths]


def test_pack_sequences_is_first_fit_and_loses_or_splits_nothing():
    sequences = _sequences([5, 7, 3, 6, 2, 8])
    tokens, ids, positions = pack_sequences(sequences, 10)
    # First fit in order: [5, 3, 2], [7], [6], [8]... 7 does not fit after 5 (room 5), 3 does.
    assert tokens.shape == (4, 10) and tokens.dtype == np.int32
    np.testing.assert_array_equal(ids[0], [1] * 5 + [2] * 3 + [3] * 2)
    np.testing.assert_array_equal(ids[1], [1] * 7 + [0] * 3)
    found = []
    for row in range(tokens.shape[0]):
        for segment in range(1, ids[row].max() + 1):
            where = ids[row] == segment
            np.testing.assert_array_equal(positions[row][where], np.arange(where.sum()))
            found.append(tokens[row][where])
    assert sorted(map(tuple, found)) == sorted(map(tuple, sequences))
    assert (tokens[ids == 0] == 0).all() and (positions[ids == 0] == 0).all()


@pytest.mark.parametrize(
    "sequences,length,message",
    [
        ([np.arange(1, 12)], 10, r"sequence 0 has 11 tokens; every sequence needs 1 to length=10"),
        ([np.ones(3), np.zeros(0)], 10, r"sequence 1 has 0 tokens"),
        ([np.ones((2, 2))], 10, r"sequence 0 must be 1-D tokens"),
        ([np.ones(3)], 0, r"length must be an integer >= 1, got 0"),
        ([], 4, r"no sequences to pack"),
    ],
)
def test_pack_sequences_refuses_what_it_cannot_pack(sequences, length, message):
    with pytest.raises(ValueError, match=message):
        pack_sequences(sequences, length)


def test_positions_restart_per_segment_and_continue_across_blocks():
    ids = jnp.asarray([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3]])
    np.testing.assert_array_equal(segment_positions(ids), [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
    start = jnp.asarray([4, 2])
    positions = continue_positions(start, ids, 6)
    np.testing.assert_array_equal(positions, [[4, 5, 0, 1, 2, 0], [2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(next_positions(positions, ids, start), [3, 8])  # padding skipped
    np.testing.assert_array_equal(next_positions(positions, jnp.zeros_like(ids), start), start)


def _alone_vs_packed(model, sequences, length):
    """-> the packed batch (tokens, ids, positions) and the model's output on it."""
    tokens, ids, positions = (jnp.asarray(x) for x in pack_sequences(sequences, length))
    packed = np.asarray(_call(model, tokens, ids, positions))
    index = 0
    for row in range(tokens.shape[0]):
        for segment in range(1, int(ids[row].max()) + 1):
            alone = np.asarray(_call(model, jnp.asarray(sequences[index])[None], None, None))[0]
            np.testing.assert_allclose(packed[row][ids[row] == segment], alone, rtol=2e-5, atol=2e-5)
            index += 1
    assert index == len(sequences)
    return (tokens, ids, positions), packed


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_a_packed_causal_lm_scores_each_sequence_as_if_alone(kind):
    model = CausalLM(_config(kind), V, rngs=nnx.Rngs(0))
    (tokens, ids, positions), packed = _alone_vs_packed(model, _sequences([4, 6, 3, 5], seed=1), 10)
    # Positions default to restarting in each segment (the rows above: two segments each, one
    # with padding after them).
    np.testing.assert_allclose(_call(model, tokens, ids, None), packed)


@pytest.mark.parametrize("kind", ["softmax", "linear"])
def test_a_packed_encoder_attends_within_each_segment(kind):
    encoder = Encoder(_config(kind), causal=False, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 9, E))
    ids = jnp.asarray([[1] * 4 + [2] * 5, [3] * 7 + [0] * 2])
    packed = _call(encoder, x, ids, None)
    for row, lo, hi in ((0, 0, 4), (0, 4, 9), (1, 0, 7)):
        np.testing.assert_allclose(
            packed[row, lo:hi], _call(encoder, x[row : row + 1, lo:hi], None, None)[0], rtol=2e-5, atol=2e-5
        )


def test_a_packed_decoder_cross_attends_to_its_own_memory_segment():
    decoder = Decoder(_config("softmax"), rngs=nnx.Rngs(3))
    x, memory = (jax.random.normal(jax.random.key(s), (1, n, E)) for s, n in ((4, 7), (5, 8)))
    ids, memory_ids = jnp.asarray([[1] * 3 + [2] * 4]), jnp.asarray([[1] * 5 + [2] * 3])
    packed = _decode(decoder, x, memory, ids, memory_ids)
    alone = [
        _decode(decoder, x[:, :3], memory[:, :5], None, None),
        _decode(decoder, x[:, 3:], memory[:, 5:], None, None),
    ]
    np.testing.assert_allclose(packed[0, :3], alone[0][0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(packed[0, 3:], alone[1][0], rtol=2e-5, atol=2e-5)
    linear = Decoder(_config("linear"), rngs=nnx.Rngs(3))
    with pytest.raises(ValueError, match="cannot cross-attend over a packed memory"):
        linear(x, memory, segment_ids=ids, memory_segment_ids=memory_ids)
    with pytest.raises(ValueError, match="needs context_segment_ids"):
        layer_stack.layer(decoder.layers, 0).cross_attention(x, memory, segment_ids=ids)


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_decoding_after_a_packed_prompt_continues_its_last_sequence(kind):
    """prefill([doc 1 | doc 2 | padding]) then steps give doc 2 alone's next-token logits: the
    state (or KV cache) holds only the last segment, and positions go on from it."""
    model = CausalLM(_config(kind), V, rngs=nnx.Rngs(6))
    model.eval()
    first, second, following = _sequences([4, 5, 3], seed=7)
    tokens = np.concatenate([first, second, [0, 0]])[None]
    ids = np.asarray([[1] * 4 + [2] * 5 + [0] * 2])
    state = model.init_state(1, max_length=16)
    state, _ = _prefill(model, state, jnp.asarray(tokens), jnp.asarray(ids))
    np.testing.assert_array_equal(state.position, [5])
    logits = []
    for token in following:
        state, logits_t = _step(model, state, jnp.asarray([token]))
        logits.append(logits_t[0])
    alone = _call(model, jnp.asarray(np.concatenate([second, following]))[None], None, None)[0, len(second) :]
    np.testing.assert_allclose(jnp.stack(logits), alone, rtol=2e-5, atol=2e-5)


def test_kinds_without_segments_say_so():
    model = CausalLM(_config("reformer", attention_options={"chunk_size": 4}), V, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'reformer' takes no segment_ids .* kinds that do: \["):
        model(jnp.ones((1, 8), jnp.int32), segment_ids=jnp.ones((1, 8), jnp.int32))
