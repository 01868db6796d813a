"""Padded batches of utterances, bucketed by length, as a pure function of (seed, step).

Utterances differ in length by a factor of ten, so a batch of random ones is mostly padding.
Each epoch visits a seeded permutation of the utterances; windows of `sort_window` batches of
it are sorted by length and cut into batches, and the batches are visited in a seeded order. A
batch then holds utterances of similar lengths, and a resumed run sees exactly the batches of
the uninterrupted one (no loader state to save). Time is padded to a multiple of `time_multiple`
frames, so the compiled step sees few distinct shapes.

Legend: B batch, T frames, F features per frame, L phonemes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


class SpeechBatch(NamedTuple):
    """Utterances padded at the end: frames past `frame_lengths_B` and labels past
    `label_lengths_B` are zero and never read."""

    features_BTF: np.ndarray  # float32
    frame_lengths_B: np.ndarray  # int32
    labels_BL: np.ndarray  # int32 phoneme ids (0, the blank, as padding)
    label_lengths_B: np.ndarray  # int32


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)


def pad_batch(
    features: list[np.ndarray], labels: list[np.ndarray], *, time_multiple: int = 1, label_multiple: int = 1
) -> SpeechBatch:
    """One `SpeechBatch` of utterances (features float32 [T_i, F], labels int [L_i]), time
    padded to a multiple of `time_multiple` frames and labels to one of `label_multiple`."""
    if not features or len(features) != len(labels):
        raise ValueError(
            f"need as many label sequences as utterances (>= 1), got {len(features)} and {len(labels)}."
        )
    frame_lengths_B = np.array([len(f) for f in features], np.int32)
    label_lengths_B = np.array([len(y) for y in labels], np.int32)
    F = features[0].shape[1]
    features_BTF = np.zeros((len(features), _round_up(frame_lengths_B.max(), time_multiple), F), np.float32)
    labels_BL = np.zeros((len(labels), _round_up(max(label_lengths_B.max(), 1), label_multiple)), np.int32)
    for i, (f_TF, y_L) in enumerate(zip(features, labels)):
        features_BTF[i, : len(f_TF)] = f_TF
        labels_BL[i, : len(y_L)] = y_L
    return SpeechBatch(features_BTF, frame_lengths_B, labels_BL, label_lengths_B)


class BucketedBatches:
    """Which utterances the training batch of each step holds: `rows(step)`.

    Epoch `e = step // steps_per_epoch` takes `np.random.default_rng([seed, e]).permutation(N)`,
    keeps its first `steps_per_epoch * batch_size` (every batch full; the N % batch_size left
    over differ from epoch to epoch), sorts each run of `sort_window * batch_size` of them by
    length, cuts batches, and visits the epoch's batches in a seeded order.
    """

    def __init__(self, lengths: np.ndarray, batch_size: int, *, seed: int, sort_window: int = 32):
        self.lengths = np.asarray(lengths)
        if self.lengths.ndim != 1 or not np.issubdtype(self.lengths.dtype, np.integer):
            raise ValueError(f"lengths must be integers [N], got {self.lengths.dtype} {self.lengths.shape}.")
        if not 0 < batch_size <= len(self.lengths):
            raise ValueError(
                f"batch_size must be in 1..{len(self.lengths)} (the number of utterances), got {batch_size}."
            )
        if int(seed) != seed or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
        if sort_window < 1:
            raise ValueError(f"sort_window must be >= 1 batch, got {sort_window}.")
        self.batch_size, self.seed, self.sort_window = int(batch_size), int(seed), int(sort_window)
        self.steps_per_epoch = len(self.lengths) // self.batch_size
        self._epoch, self._plan = -1, None

    def epoch_plan(self, epoch: int) -> np.ndarray:
        """int [steps_per_epoch, batch_size]: the utterances of each step of `epoch`, in order."""
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, int(epoch)])
            order = rng.permutation(len(self.lengths))[: self.steps_per_epoch * self.batch_size]
            window = self.sort_window * self.batch_size
            for start in range(0, len(order), window):
                part = order[start : start + window]
                order[start : start + window] = part[np.argsort(self.lengths[part], kind="stable")]
            plan = order.reshape(self.steps_per_epoch, self.batch_size)[rng.permutation(self.steps_per_epoch)]
            plan.flags.writeable = False
            self._epoch, self._plan = epoch, plan
        return self._plan

    def rows(self, step: int) -> np.ndarray:
        """The utterances (indices into `lengths`) of the training batch of global `step`."""
        if int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}.")
        epoch, i = divmod(int(step), self.steps_per_epoch)
        return self.epoch_plan(epoch)[i]


def evaluation_batches(lengths: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Every utterance once, sorted by length (little padding), cut into runs of
    `batch_size` (the last may be shorter): the same batches at every evaluation."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
