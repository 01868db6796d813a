"""The copy task (paper section 4.1, as in the authors' experiments): copy random symbols after
a separator.

Legend: B batch, L max_length, W widest sequence (the most symbols one example holds).

An example is n random symbols in 1..num_symbols, n uniform in [L // 4, (L - 1) // 2). Token 0
is the separator, the start token and the padding. Two layouts of the same examples:

  decoder-only (the paper's): tokens [0, s1..sn, 0, s1..sn, 0, ...] of length L; the model reads
    tokens[:-1] and predicts tokens[1:]; the loss covers the second copy only.
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
    symbols_BW: np.ndarray  # int32, the n symbols of each example then zeros
    lengths_B: np.ndarray  # int32 n


class LanguageModelBatch(NamedTuple):
    inputs_BT: np.ndarray  # tokens[:-1], T = L - 1
    targets_BT: np.ndarray  # tokens[1:]
    mask_BT: np.ndarray  # float32, 1 where the target is a symbol of the copy


class Seq2SeqBatch(NamedTuple):
    source_BW: np.ndarray
    source_lengths_B: np.ndarray
    target_in_BW: np.ndarray
    target_out_BW: np.ndarray
    mask_BW: np.ndarray  # float32, 1 on the n symbols to copy


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
    symbols_BW = rng.integers(1, num_symbols + 1, size=(batch, width)).astype(np.int32)
    symbols_BW[np.arange(width)[None, :] >= lengths_B[:, None]] = 0
    return CopyExamples(symbols_BW, lengths_B)


def decoder_only_layout(examples: CopyExamples, max_length: int) -> LanguageModelBatch:
    """[0, s, 0, s, 0...] of length L, shifted into inputs and targets, loss on the copy."""
    symbols_BW, n_B = examples
    B, W = symbols_BW.shape
    tokens_BL = np.zeros((B, max_length), np.int32)
    tokens_BL[:, 1 : W + 1] = symbols_BW
    copy_start_B = n_B + 2  # index of the copy's first symbol in tokens
    cols_L = np.arange(max_length)[None, :]
    offset_BL = cols_L - copy_start_B[:, None]
    in_copy_BL = (offset_BL >= 0) & (offset_BL < n_B[:, None])
    tokens_BL[in_copy_BL] = np.take_along_axis(symbols_BW, np.clip(offset_BL, 0, W - 1), 1)[in_copy_BL]
    mask_BT = in_copy_BL[:, 1:].astype(np.float32)
    return LanguageModelBatch(tokens_BL[:, :-1], tokens_BL[:, 1:], mask_BT)


def encoder_decoder_layout(examples: CopyExamples) -> Seq2SeqBatch:
    """Source s (padded, with lengths); decoder input [0, s[:-1]]; targets s; loss on s."""
    symbols_BW, n_B = examples
    target_in_BW = np.zeros_like(symbols_BW)
    target_in_BW[:, 1:] = symbols_BW[:, :-1]
    mask_BW = (np.arange(symbols_BW.shape[1])[None, :] < n_B[:, None]).astype(np.float32)
    return Seq2SeqBatch(symbols_BW, n_B, target_in_BW, symbols_BW, mask_BW)


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
