"""Connectionist temporal classification: the loss, greedy decoding, and error counting.

Legend: B batch, T time (frames), C classes (CTC outputs, blank included), L label length.

  loss_B = ctc_loss(logits_BTC, frame_lengths_B, labels_BL, label_lengths_B)    training
  tokens_BT, lengths_B = greedy_decode(logits_BTC, frame_lengths_B)            best path
  errors, total = error_counts(references, hypotheses)    phoneme error rate = errors / total

Padding is at the end of every row: frames at index >= frame_lengths[b] and labels at index >=
label_lengths[b] are ignored, whatever they hold. Pure jax/numpy (no Flax): usable with any model.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
import optax

from linear_transformers.ops.input_checks import check_lengths, is_concrete


def _check_logits(logits_BTC, blank: int, where: str):
    logits_BTC = jnp.asarray(logits_BTC)
    if logits_BTC.ndim != 3:
        raise ValueError(
            f"{where}: logits must be [batch, frames, classes], got shape {tuple(logits_BTC.shape)}."
        )
    if not jnp.issubdtype(logits_BTC.dtype, jnp.floating):
        raise ValueError(
            f"{where}: logits must be floating-point (float32, bfloat16, ...), got {logits_BTC.dtype}."
        )
    C = logits_BTC.shape[2]
    if isinstance(blank, bool) or not isinstance(blank, (int, np.integer)) or not 0 <= blank < C:
        raise ValueError(f"{where}: blank must be an int class id in [0, {C}) (the classes), got {blank!r}.")
    return logits_BTC


def ctc_loss(logits_BTC, frame_lengths_B, labels_BL, label_lengths_B, *, blank: int = 0):
    """Per-example CTC loss, -log p(labels | frames), as float32 [B] (`optax.ctc_loss`).

    Args:
      logits_BTC: unnormalised scores [B, T, C], any float dtype (computed in float32 at least).
      frame_lengths_B: int [B] in [0, T]; frames at index >= frame_lengths[b] are padding.
      labels_BL: int [B, L] class ids in [0, C) other than `blank`; padding past label_lengths
        may hold anything.
      label_lengths_B: int [B] in [0, L].
      blank: the blank class id.

    A label sequence no alignment of its frames can produce (too long: it needs as many frames as
    labels plus one per repeated neighbour) has probability 0; optax scores it with its log(0)
    stand-in, a loss around 1e5, finite, so one such row does not turn a batch mean into inf.
    """
    where = "ctc_loss"
    logits_BTC = _check_logits(logits_BTC, blank, where)
    B, T, C = logits_BTC.shape
    labels_BL = jnp.asarray(labels_BL)
    if labels_BL.ndim != 2 or labels_BL.shape[0] != B:
        raise ValueError(f"{where}: labels must be [batch={B}, L], got shape {tuple(labels_BL.shape)}.")
    if not jnp.issubdtype(labels_BL.dtype, jnp.integer):
        raise ValueError(f"{where}: labels must be integer class ids, got dtype {labels_BL.dtype}.")
    L = labels_BL.shape[1]
    frame_lengths_B = check_lengths(frame_lengths_B, B, T, name="frame_lengths", what="frames", where=where)
    label_lengths_B = check_lengths(label_lengths_B, B, L, name="label_lengths", what="labels", where=where)
    label_valid_BL = jnp.arange(L) < label_lengths_B[:, None]
    if is_concrete(labels_BL) and is_concrete(label_lengths_B) and labels_BL.size:
        valid = np.asarray(labels_BL)[np.asarray(label_valid_BL)]
        bad = valid[(valid < 0) | (valid >= C) | (valid == blank)]
        if bad.size:
            raise ValueError(
                f"{where}: labels (within label_lengths) must be class ids in [0, {C}) other than "
                f"the blank {blank}, got {sorted(set(bad.tolist()))}."
            )
    # Padded labels become -1 (no class): optax reads them when it looks for repeated neighbours.
    # Its loss does not depend on them now (tested), but this keeps it so whatever its internals.
    labels_BL = jnp.where(label_valid_BL, labels_BL, -1).astype(jnp.int32)
    logit_paddings_BT = (jnp.arange(T) >= frame_lengths_B[:, None]).astype(jnp.float32)
    label_paddings_BL = (~label_valid_BL).astype(jnp.float32)
    logits_BTC = logits_BTC.astype(jnp.promote_types(logits_BTC.dtype, jnp.float32))
    return optax.ctc_loss(logits_BTC, logit_paddings_BT, labels_BL, label_paddings_BL, blank_id=blank).astype(
        jnp.float32
    )


def greedy_decode(logits_BTC, frame_lengths_B, *, blank: int = 0):
    """Best-path decoding: the argmax class of each frame, repeats merged, blanks dropped.

    Returns (tokens int32 [B, T], lengths int32 [B]): row b holds its lengths[b] tokens first,
    then -1. Fixed shapes, so it runs under `jit`. Frames at index >= frame_lengths[b] are
    ignored (a repeat across that boundary cannot merge with anything).
    """
    where = "greedy_decode"
    logits_BTC = _check_logits(logits_BTC, blank, where)
    B, T, _ = logits_BTC.shape
    frame_lengths_B = check_lengths(frame_lengths_B, B, T, name="frame_lengths", what="frames", where=where)
    best_BT = jnp.argmax(logits_BTC, axis=-1).astype(jnp.int32)
    # A repeat is merged only with the frame right before it: a blank between two equal classes
    # keeps both (that is how CTC writes a doubled label).
    previous_BT = jnp.pad(best_BT[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    keep_BT = (jnp.arange(T) < frame_lengths_B[:, None]) & (best_BT != blank) & (best_BT != previous_BT)
    # Kept tokens go to their rank among the kept; the others to index T, which the scatter drops.
    slot_BT = jnp.where(keep_BT, jnp.cumsum(keep_BT, axis=1) - 1, T)
    rows_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    tokens_BT = jnp.full((B, T), -1, jnp.int32).at[rows_BT, slot_BT].set(best_BT, mode="drop")
    return tokens_BT, jnp.sum(keep_BT, axis=1, dtype=jnp.int32)


def _as_sequence(x, name: str) -> list[int]:
    array = np.asarray(x)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"edit_distance: {name} must be a 1-D sequence of ints, got {array.dtype} of shape {array.shape}."
        )
    return array.tolist()


def edit_distance(reference: Sequence[int], hypothesis: Sequence[int]) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions turning
    `reference` into `hypothesis` (a plain O(len * len) dynamic programme in Python)."""
    ref, hyp = _as_sequence(reference, "reference"), _as_sequence(hypothesis, "hypothesis")
    # row[j]: distance between the reference prefix read so far and hyp[:j].
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        diagonal, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (r != h))
    return row[-1]


def error_counts(references: Sequence[Sequence[int]], hypotheses: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(summed edit distances, summed reference lengths) over pairs of unpadded sequences; the
    error rate of the set is their ratio (not the mean of per-utterance rates)."""
    references, hypotheses = list(references), list(hypotheses)
    if len(references) != len(hypotheses):
        raise ValueError(
            f"error_counts: got {len(references)} references but {len(hypotheses)} hypotheses; "
            "pass one hypothesis per reference."
        )
    errors = sum(edit_distance(r, h) for r, h in zip(references, hypotheses))
    return errors, sum(len(r) for r in references)
