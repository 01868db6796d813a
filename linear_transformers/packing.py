"""Packed variable-length batches: several sequences per row, told apart by segment ids.

Legend: B batch (rows), T time (the row length).

  tokens_BT, segment_ids_BT, positions_BT = pack_sequences(sequences, length)
  logits = model(tokens_BT, segment_ids=segment_ids_BT, positions=positions_BT)

Segment ids number the sequences of a row 1, 2, ... (0 is padding); positions restart at 0 in
every segment. Every attention kind, causal or not, computes each segment as if it were alone
(softmax masks other segments, the linear forms drop their state where the id changes), so a
packed batch gives the results of the padded one without computing on padding.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def pack_sequences(sequences: Sequence, length: int, *, pad_id: int = 0):
    """Pack 1-D sequences into rows of `length` tokens, first-fit in the given order.

    Each sequence goes whole into the first row with room for it (a new row when none has):
    no sequence is split, dropped or reordered within its row. Returns numpy arrays
    (tokens [B, length] in the sequences' dtype, padded with `pad_id`; segment_ids [B, length]
    int32, 1, 2, ... per row and 0 at padding; positions [B, length] int32, 0, 1, ... within
    each sequence and 0 at padding). A sequence longer than `length`, or an empty one, is a
    ValueError naming it.
    """
    if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 1:
        raise ValueError(f"pack_sequences: length must be an integer >= 1, got {length!r}.")
    arrays = [np.asarray(s) for s in sequences]
    if not arrays:
        raise ValueError("pack_sequences: no sequences to pack.")
    for i, a in enumerate(arrays):
        if a.ndim != 1:
            raise ValueError(f"pack_sequences: sequence {i} must be 1-D tokens, got shape {a.shape}.")
        if not 1 <= a.shape[0] <= length:
            raise ValueError(
                f"pack_sequences: sequence {i} has {a.shape[0]} tokens; every sequence needs 1 to "
                f"length={length} (a longer one would be split across rows)."
            )
    dtype = np.result_type(*arrays)
    rows: list[list[int]] = []  # the indices of the sequences in each row
    room: list[int] = []
    for i, a in enumerate(arrays):
        n = a.shape[0]
        row = next((r for r, free in enumerate(room) if free >= n), None)
        if row is None:
            rows.append([])
            room.append(length)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= n
    tokens = np.full((len(rows), length), pad_id, dtype)
    segment_ids = np.zeros((len(rows), length), np.int32)
    positions = np.zeros((len(rows), length), np.int32)
    for r, members in enumerate(rows):
        start = 0
        for segment, i in enumerate(members, start=1):
            n = arrays[i].shape[0]
            tokens[r, start : start + n] = arrays[i]
            segment_ids[r, start : start + n] = segment
            positions[r, start : start + n] = np.arange(n)
            start += n
    return tokens, segment_ids, positions


def segment_positions(segment_ids_BT):
    """Positions that restart at 0 where the segment id changes (0 at padding too): [B, T] int32.

    What a model uses when it is given segment ids without positions.
    """
    ids = jnp.asarray(segment_ids_BT)
    index = jnp.arange(ids.shape[1], dtype=jnp.int32)
    begins = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    segment_start = jax.lax.cummax(jnp.where(begins, index[None], 0), axis=1)
    return jnp.where(ids != 0, index[None] - segment_start, 0).astype(jnp.int32)


def continue_positions(position_B, segment_ids_BT, length: int):
    """The positions of a block of `length` tokens read after tokens whose next position is
    `position_B` [B]: counting on, or (with segment ids) counting on in the block's first
    segment and from 0 in each later one. [B, T] int32."""
    position_B = jnp.asarray(position_B, jnp.int32)
    if segment_ids_BT is None:
        return position_B[:, None] + jnp.arange(length, dtype=jnp.int32)[None]
    ids = jnp.asarray(segment_ids_BT)
    changes = jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    first_segment = jnp.cumsum(changes, axis=1) == 0
    positions = segment_positions(ids)
    return jnp.where(first_segment, positions + position_B[:, None], positions)


def next_positions(positions_BT, segment_ids_BT, position_B):
    """The position that follows a block: one past its last token (with segment ids, its last
    token that is not padding; `position_B` for a row of padding only). [B] int32."""
    positions_BT = jnp.asarray(positions_BT, jnp.int32)
    if segment_ids_BT is None:
        return positions_BT[:, -1] + 1
    present_BT = jnp.asarray(segment_ids_BT) != 0
    last_B = positions_BT.shape[1] - 1 - jnp.argmax(jnp.flip(present_BT, axis=1), axis=1)
    after_B = jnp.take_along_axis(positions_BT, last_B[:, None], axis=1)[:, 0] + 1
    return jnp.where(jnp.any(present_BT, axis=1), after_B, jnp.asarray(position_B, jnp.int32))
