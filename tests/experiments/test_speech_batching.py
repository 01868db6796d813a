"""Bucketed speech batches: a pure function of (seed, step), every utterance once per epoch,
similar lengths together, padding at the end only."""

import numpy as np
import pytest

from experiments.data.speech import batching


def _lengths(n=203, seed=0):
    return np.random.default_rng(seed).integers(20, 400, n)


def test_an_epoch_visits_every_kept_utterance_once_and_epochs_differ():
    lengths = _lengths()
    b = batching.BucketedBatches(lengths, 8, seed=3)
    assert b.steps_per_epoch == 203 // 8
    epoch0 = np.concatenate([b.rows(s) for s in range(b.steps_per_epoch)])
    epoch1 = np.concatenate([b.rows(s) for s in range(b.steps_per_epoch, 2 * b.steps_per_epoch)])
    assert len(set(epoch0.tolist())) == len(epoch0) == b.steps_per_epoch * 8
    assert len(set(epoch1.tolist())) == len(epoch1)
    assert not np.array_equal(epoch0, epoch1)


def test_batches_are_a_function_of_seed_and_step_in_any_order():
    lengths = _lengths()
    a = batching.BucketedBatches(lengths, 8, seed=3)
    b = batching.BucketedBatches(lengths, 8, seed=3)
    steps = [57, 3, 25, 26, 0, 57]
    for s in steps:  # b asked in another order, across epochs: same rows
        np.testing.assert_array_equal(a.rows(s), batching.BucketedBatches(lengths, 8, seed=3).rows(s))
    assert [b.rows(s).tolist() for s in steps] == [a.rows(s).tolist() for s in steps]
    other = batching.BucketedBatches(lengths, 8, seed=4)
    assert any(not np.array_equal(a.rows(s), other.rows(s)) for s in range(5))


def test_bucketing_puts_similar_lengths_together():
    lengths = _lengths(2000)
    b = batching.BucketedBatches(lengths, 16, seed=0)
    spread = np.mean([np.ptp(lengths[b.rows(s)]) for s in range(b.steps_per_epoch)])
    rng = np.random.default_rng(1)
    random_spread = np.mean([np.ptp(rng.choice(lengths, 16, replace=False)) for _ in range(200)])
    assert spread < random_spread / 5, (spread, random_spread)


def test_pad_batch_pads_at_the_end_to_the_multiples():
    rng = np.random.default_rng(0)
    features = [rng.normal(size=(t, 3)).astype(np.float32) for t in (5, 33, 17)]
    labels = [np.arange(1, n + 1, dtype=np.int32) for n in (2, 9, 4)]
    batch = batching.pad_batch(features, labels, time_multiple=16, label_multiple=8)
    assert batch.features_BTF.shape == (3, 48, 3) and batch.labels_BL.shape == (3, 16)
    np.testing.assert_array_equal(batch.frame_lengths_B, [5, 33, 17])
    np.testing.assert_array_equal(batch.label_lengths_B, [2, 9, 4])
    for i, (f, y) in enumerate(zip(features, labels)):
        np.testing.assert_array_equal(batch.features_BTF[i, : len(f)], f)
        assert not batch.features_BTF[i, len(f) :].any()
        np.testing.assert_array_equal(batch.labels_BL[i, : len(y)], y)
        assert not batch.labels_BL[i, len(y) :].any()
    assert batch.features_BTF.dtype == np.float32 and batch.labels_BL.dtype == np.int32


def test_evaluation_batches_cover_every_utterance_once_sorted_by_length():
    lengths = _lengths(37)
    parts = batching.evaluation_batches(lengths, 8)
    assert [len(p) for p in parts] == [8, 8, 8, 8, 5]
    order = np.concatenate(parts)
    assert sorted(order.tolist()) == list(range(37))
    assert np.all(np.diff(lengths[order]) >= 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lengths": np.array([3.0, 4.0]), "batch_size": 1}, "lengths must be integers"),
        ({"lengths": np.array([3, 4]), "batch_size": 3}, r"batch_size must be in 1\.\.2"),
        ({"lengths": np.array([3, 4]), "batch_size": 1, "seed": -1}, "seed must be a non-negative"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    kwargs = {"seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        batching.BucketedBatches(kwargs.pop("lengths"), kwargs.pop("batch_size"), **kwargs)
