"""Greedy decoding by recompute (experiments/tasks/greedy_recompute.py) against a plain
Python loop that runs the model on each prefix cut to its length: the same predictions, for LSH
decoders (whose outputs depend on later positions) and a causal linear one."""

import jax
import numpy as np
import pytest
from cases import small_config
from flax import nnx

from experiments.tasks import greedy_recompute
from linear_transformers import CausalLM, EncoderDecoder

B, T, V = 2, 8, 7


def _config(attention, **options):
    return small_config(attention, options, feed_forward_dim=None)


KINDS = [("reformer", {"num_buckets": 4, "num_rounds": 2, "chunk_size": 2}), ("linear", {})]


def _prompt_and_generated(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    generated = np.zeros((B, T), bool)
    generated[:, 3 : T - 1] = True  # the model writes inputs 4..T-1; 0..3 are the prompt
    return tokens, generated


def _reference(logits_of_prefix, tokens, generated):
    buffer = tokens.copy()
    predicted = np.zeros_like(tokens)
    for t in range(T):
        predicted[:, t] = np.argmax(np.asarray(logits_of_prefix(buffer[:, : t + 1]))[:, t], -1)
        if t + 1 < T:
            buffer[:, t + 1] = np.where(generated[:, t], predicted[:, t], buffer[:, t + 1])
    return predicted


@pytest.mark.parametrize("kind, options", KINDS, ids=[k for k, _ in KINDS])
def test_decoder_only_greedy_equals_decoding_each_prefix_alone(kind, options):
    model = CausalLM(_config(kind, **options), V, rngs=nnx.Rngs(0))
    model.eval()
    tokens, generated = _prompt_and_generated()
    got = np.asarray(greedy_recompute.decoder_only(model, tokens, generated))
    want = _reference(jax.jit(lambda x: model(x)), tokens, generated)
    np.testing.assert_array_equal(got, want)
    # The prompt stays given: predictions at prompt positions read the true tokens.
    teacher_forced = np.argmax(np.asarray(model(tokens)), -1)
    np.testing.assert_array_equal(got[:, :4], teacher_forced[:, :4])


def test_encoder_decoder_greedy_equals_decoding_each_prefix_alone():
    kind, options = KINDS[0]
    model = EncoderDecoder(_config("linear"), _config(kind, **options), V, rngs=nnx.Rngs(0))
    model.eval()
    source = np.random.default_rng(3).integers(0, V, (B, 9)).astype(np.int32)
    lengths = np.array([9, 6], np.int32)
    tokens, generated = _prompt_and_generated(1)
    got = np.asarray(greedy_recompute.encoder_decoder(model, source, lengths, tokens, generated))
    want = _reference(jax.jit(lambda x: model(source, x, source_lengths=lengths)), tokens, generated)
    np.testing.assert_array_equal(got, want)
