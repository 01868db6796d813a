"""The copy task (paper section 4.1, as in the authors' experiments): copy random symbols after
a separator.

Legend: B batch, T time (a decoder-only sequence of max_length tokens, or the target), S the
symbols of the widest example (the encoder's source).

An example is n random symbols in 1..num_symbols, n uniform in [max_length // 4,
(max_length - 1) // 2) (the paper's), or in [min_symbols, (max_length - 1) // 2) for a wider
range. Token 0 is the separator, the start token and the padding. The layouts of the examples:

  decoder-only (the paper's): tokens [0, s1..sn, 0, s1..sn, 0, ...] of length max_length; the
    model reads tokens[:-1] and predicts tokens[1:]; the loss covers the second copy only.
  packed decoder-only: the same unit [0, s, 0, s] shifted into inputs and targets (2n + 1 tokens
    each), several examples per row of max_length - 1 tokens, first-fit (`pack_sequences`),
    with segment ids (1, 2, ... per row, 0 at padding) and positions restarting per example
    (`PackedBatch`); the model computes every example as if it were alone.
  encoder-decoder (the replication's): source [s1..sn, 0...] with source_lengths n; the decoder
    reads [0, s1..s(n-1), ...] and predicts [s1..sn, ...]; the loss covers the n symbols.

The examples of a step (`CopyBatches`): `examples_per_step` candidates (default batch_size),
of which those that first-fit packs into batch_size rows of max_length - 1 tokens, up to the
first that fits in none (all of them when there are at most batch_size). Packed, they fill
batch_size rows; padded, each has a row of its own (examples_per_step rows, the rows of
candidates that did not fit left empty, loss weight 0): both layouts hold the same examples,
so their losses are equal and only the padding differs.

Batches are a pure function of (seed, step), so a resumed run sees the batches an uninterrupted
one would have.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from linear_transformers.packing import pack_sequences

SEPARATOR = 0


class CopyExamples(NamedTuple):
    symbols_BS: np.ndarray  # int32, the n symbols of each example then zeros
    lengths_B: np.ndarray  # int32 n


class LanguageModelBatch(NamedTuple):
    inputs_BT: np.ndarray  # tokens[:-1]
    targets_BT: np.ndarray  # tokens[1:]
    mask_BT: np.ndarray  # float32, 1 where the target is a symbol of the copy


class PackedBatch(NamedTuple):
    inputs_BT: np.ndarray  # several examples' [0, s, 0, s[:-1]] per row, then zeros
    targets_BT: np.ndarray  # their [s, 0, s], then zeros
    mask_BT: np.ndarray  # float32, 1 where the target is a symbol of a copy
    segment_ids_BT: np.ndarray  # int32, 1, 2, ... per example of a row, 0 at padding
    positions_BT: np.ndarray  # int32, 0, 1, ... within each example, 0 at padding


class Seq2SeqBatch(NamedTuple):
    source_BS: np.ndarray
    source_lengths_B: np.ndarray
    target_in_BT: np.ndarray
    target_out_BT: np.ndarray
    mask_BT: np.ndarray  # float32, 1 on the n symbols to copy


def length_range(max_length: int, min_symbols: int = 0) -> tuple[int, int]:
    """[low, high) of the number of symbols per example for sequences of `max_length`: low is
    `min_symbols`, or the paper's max_length // 4 when it is 0."""
    low, high = max_length // 4, (max_length - 1) // 2
    if low < 1 or high <= low:
        raise ValueError(
            f"copy task: max_length={max_length} is too short; it needs >= 5 so "
            f"that n in [max_length // 4, (max_length - 1) // 2) is not empty."
        )
    if min_symbols:
        if not 1 <= min_symbols < high:
            raise ValueError(
                f"copy task: min_symbols={min_symbols} must be 0 (max_length // 4) or in "
                f"[1, {high}) for max_length={max_length} (n in [min_symbols, (max_length - 1) // 2))."
            )
        low = min_symbols
    return low, high


def random_examples(
    rng: np.random.Generator, batch: int, max_length: int, num_symbols: int, min_symbols: int = 0
) -> CopyExamples:
    """`batch` examples of random length (`length_range`) and symbols."""
    if num_symbols < 1:
        raise ValueError(f"copy task: num_symbols must be >= 1, got {num_symbols}.")
    low, high = length_range(max_length, min_symbols)
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


def unit_tokens(n_B: np.ndarray) -> np.ndarray:
    """The input (and target) tokens of each decoder-only example: 2n + 1."""
    return 2 * np.asarray(n_B) + 1


def first_fit_count(tokens_E: np.ndarray, rows: int, length: int) -> int:
    """How many of the leading sequences (of tokens_E tokens) first-fit places in `rows` rows of
    `length` tokens, up to the first that fits in none (`pack_sequences`'s order and rule)."""
    room_R = np.full(rows, length)
    for i, n in enumerate(tokens_E):
        fits_R = room_R >= n
        if not fits_R.any():
            return i
        room_R[np.argmax(fits_R)] -= n
    return len(tokens_E)


def packed_decoder_only_layout(examples: CopyExamples, max_length: int, rows: int) -> PackedBatch:
    """Every example's [0, s, 0, s] shifted into inputs and targets (2n + 1 tokens each), packed
    first-fit in order into `rows` rows of max_length - 1 tokens, loss on the copies. The
    examples must fit (`first_fit_count`); rows left over are padding."""
    one_per_row = decoder_only_layout(examples, max_length)
    width_E = unit_tokens(examples.lengths_B)
    packed = [
        pack_sequences([x_T[:w] for x_T, w in zip(x_ET, width_E)], max_length - 1)
        for x_ET in (one_per_row.inputs_BT, one_per_row.targets_BT, one_per_row.mask_BT)
    ]
    (inputs, segment_ids, positions), (targets, _, _), (mask, _, _) = packed
    if inputs.shape[0] > rows:
        raise ValueError(
            f"copy task: {len(width_E)} examples need {inputs.shape[0]} rows of {max_length - 1}, > {rows}."
        )

    def fill(x_RT):
        return np.pad(x_RT, [(0, rows - x_RT.shape[0]), (0, 0)])

    return PackedBatch(*(fill(x) for x in (inputs, targets, mask, segment_ids, positions)))


def real_tokens(batch) -> int:
    """The input tokens of a batch that belong to an example (not padding)."""
    if isinstance(batch, PackedBatch):
        return int(np.sum(batch.segment_ids_BT > 0))
    if isinstance(batch, LanguageModelBatch):
        n_B = np.sum(batch.mask_BT > 0, axis=1)
        return int(np.sum(np.where(n_B > 0, unit_tokens(n_B), 0)))
    return int(np.sum(batch.source_lengths_B) + np.sum(batch.mask_BT > 0))  # source + target


def encoder_decoder_layout(examples: CopyExamples) -> Seq2SeqBatch:
    """Source s (padded, with lengths); decoder input [0, s[:-1]]; targets s; loss on s."""
    symbols_BS, n_B = examples
    target_in_BT = np.zeros_like(symbols_BS)
    target_in_BT[:, 1:] = symbols_BS[:, :-1]
    mask_BT = (np.arange(symbols_BS.shape[1])[None, :] < n_B[:, None]).astype(np.float32)
    return Seq2SeqBatch(symbols_BS, n_B, target_in_BT, symbols_BS, mask_BT)


class CopyBatches:
    """Batch of step s = f(seed, s), in the layout of `architecture` ("decoder" or
    "encoder_decoder"), decoder-only examples `packed` or one per row.

    min_symbols: n in [min_symbols, (max_length - 1) // 2) (0: the paper's max_length // 4).
    examples_per_step: the candidates drawn per step (0: batch_size); the step's examples are
    those first-fit places in batch_size rows of max_length - 1 tokens, up to the first that
    fits in none (module docstring). Packed: batch_size rows; padded: one row per candidate.
    """

    ARCHITECTURES = ("decoder", "encoder_decoder")

    def __init__(
        self,
        *,
        batch_size: int,
        max_length: int,
        num_symbols: int,
        architecture: str,
        seed: int,
        min_symbols: int = 0,
        examples_per_step: int = 0,
        packed: bool = False,
    ):
        if architecture not in self.ARCHITECTURES:
            raise ValueError(
                f"copy task: architecture must be one of {self.ARCHITECTURES}, got {architecture!r}."
            )
        length_range(max_length, min_symbols)
        if architecture != "decoder" and (packed or examples_per_step):
            raise ValueError(
                "copy task: packed and examples_per_step apply to architecture='decoder' only, "
                f"got architecture={architecture!r}."
            )
        self.batch_size, self.max_length, self.num_symbols = batch_size, max_length, num_symbols
        self.architecture, self.seed = architecture, seed
        self.min_symbols, self.examples_per_step, self.packed = min_symbols, examples_per_step, packed

    def examples(self, step: int) -> CopyExamples:
        """The examples of `step`, in order (for the decoder: those that fit, see above)."""
        rng = np.random.default_rng([self.seed, step])
        examples = random_examples(
            rng,
            self.examples_per_step or self.batch_size,
            self.max_length,
            self.num_symbols,
            self.min_symbols,
        )
        if self.architecture != "decoder":
            return examples
        kept = first_fit_count(unit_tokens(examples.lengths_B), self.batch_size, self.max_length - 1)
        return CopyExamples(examples.symbols_BS[:kept], examples.lengths_B[:kept])

    def batch(self, step: int):
        examples = self.examples(step)
        if self.architecture != "decoder":
            return encoder_decoder_layout(examples)
        if self.packed:
            return packed_decoder_only_layout(examples, self.max_length, self.batch_size)
        rows = self.examples_per_step or self.batch_size
        if len(examples.lengths_B) < rows:  # candidates that did not fit: empty rows
            examples = CopyExamples(
                *(np.pad(x, [(0, rows - len(x))] + [(0, 0)] * (x.ndim - 1)) for x in examples)
            )
        return decoder_only_layout(examples, self.max_length)
