"""The copy task (paper section 4.1, as in the authors' experiments): copy random symbols after
a separator.

Legend: B batch, T time (a decoder-only sequence of max_length tokens, or the target), S the
symbols of the widest example (the encoder's source).

An example is n random symbols in 1..num_symbols, n uniform in [max_length // 4,
(max_length - 1) // 2). Token 0 is the separator, the start token and the padding. Two layouts
of the same examples:

  decoder-only (the paper's): tokens [0, s1..sn, 0, s1..sn, 0, ...] of length max_length; the
    model reads tokens[:-1] and predicts tokens[1:]; the loss covers the second copy only.
  encoder-decoder (the replication's): source [s1..sn, 0...] with source_lengths n; the decoder
    reads [0, s1..s(n-1), ...] and predicts [s1..sn, ...]; the loss covers the n symbols.

Batches are a pure function of (seed, step), so a resumed run sees the batches an uninterrupted
one would have.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

SEPARATOR = 0


class CopyExamples(NamedTuple):
    symbols_BS: np.ndarray  # int32, the n symbols of each example then zeros
    lengths_B: np.ndarray  # int32 n


class LanguageModelBatch(NamedTuple):
    inputs_BT: np.ndarray  # tokens[:-1]
    targets_BT: np.ndarray  # tokens[1:]
    mask_BT: np.ndarray  # float32, 1 where the target is a symbol of the copy


class Seq2SeqBatch(NamedTuple):
    source_BS: np.ndarray
    source_lengths_B: np.ndarray
    target_in_BT: np.ndarray
    target_out_BT: np.ndarray
    mask_BT: np.ndarray  # float32, 1 on the n symbols to copy


def length_range(max_length: int) -> tuple[int, int]:
    """[low, high) of the number of symbols per example for sequences of `max_length`."""
    low, high = max_length // 4, (max_length - 1) // 2
    if low < 1 or high <= low:
        raise ValueError(
            f"copy task: max_length={max_length} is too short; it needs >= 5 so "
            f"that n in [max_length // 4, (max_length - 1) // 2) is not empty."
        )
    return low, high


def random_examples(rng: np.random.Generator, batch: int, max_length: int, num_symbols: int) -> CopyExamples:
    """`batch` examples of random length and symbols."""
    if num_symbols < 1:
        raise ValueError(f"copy task: num_symbols must be >= 1, got {num_symbols}.")
    low, high = length_range(max_length)
    lengths_B = rng.integers(low, high, size=batch).astype(np.int32)
    width = high - 1
    symbols_BS = rng.integers(1, num_symbols + 1, size=(batch, width)).astype(np.int32)
    symbols_BS[np.arange(width)[None, :] >= lengths_B[:, None]] = 0
    return CopyExamples(symbols_BS, lengths_B)


def decoder_only_layout(examples: CopyExamples, max_length: int) -> LanguageModelBatch:
    """[0, s, 0, s, 0...] of length max_length, shifted into inputs and targets, loss on the copy."""
    symbols_BS, n_B = examples
    B, S = symbols_BS.shape
    tokens_BT = np.zeros((B, max_length), np.int32)
    tokens_BT[:, 1 : S + 1] = symbols_BS
    copy_start_B = n_B + 2  # index of the copy's first symbol in tokens
    cols_T = np.arange(max_length)[None, :]
    offset_BT = cols_T - copy_start_B[:, None]
    in_copy_BT = (offset_BT >= 0) & (offset_BT < n_B[:, None])
    tokens_BT[in_copy_BT] = np.take_along_axis(symbols_BS, np.clip(offset_BT, 0, S - 1), 1)[in_copy_BT]
    mask_BT = in_copy_BT[:, 1:].astype(np.float32)
    return LanguageModelBatch(tokens_BT[:, :-1], tokens_BT[:, 1:], mask_BT)


def encoder_decoder_layout(examples: CopyExamples) -> Seq2SeqBatch:
    """Source s (padded, with lengths); decoder input [0, s[:-1]]; targets s; loss on s."""
    symbols_BS, n_B = examples
    target_in_BT = np.zeros_like(symbols_BS)
    target_in_BT[:, 1:] = symbols_BS[:, :-1]
    mask_BT = (np.arange(symbols_BS.shape[1])[None, :] < n_B[:, None]).astype(np.float32)
    return Seq2SeqBatch(symbols_BS, n_B, target_in_BT, symbols_BS, mask_BT)


class CopyBatches:
    """Batch of step s = f(seed, s), in the layout of `architecture` ("decoder" or
    "encoder_decoder")."""

    ARCHITECTURES = ("decoder", "encoder_decoder")

    def __init__(self, *, batch_size: int, max_length: int, num_symbols: int, architecture: str, seed: int):
        if architecture not in self.ARCHITECTURES:
            raise ValueError(
                f"copy task: architecture must be one of {self.ARCHITECTURES}, got {architecture!r}."
            )
        length_range(max_length)
        self.batch_size, self.max_length, self.num_symbols = batch_size, max_length, num_symbols
        self.architecture, self.seed = architecture, seed

    def batch(self, step: int):
        rng = np.random.default_rng([self.seed, step])
        examples = random_examples(rng, self.batch_size, self.max_length, self.num_symbols)
        if self.architecture == "decoder":
            return decoder_only_layout(examples, self.max_length)
        return encoder_decoder_layout(examples)
