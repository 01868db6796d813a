"""Read a split of a speech corpus into memory, ready for batching: `load_utterances`.

The corpora are TFDS builders written as `array_record` (no TensorFlow), prepared under
`data_dir` the first time they are asked for:

  synthetic    synthetic.LtSynthSpeech  eSpeak NG speech of standard-library sentences, made
                                        here (configs "default": a few hours; "smoke": seconds)
  librispeech  corpora.LtLibriSpeech    LibriSpeech, from the user's copy in `manual_dir`
  wsj          corpora.LtWsj            WSJ (LDC93S6, LDC94S13), from the user's copy in `manual_dir`

Splits: "train", "validation", "test". The stored log-mel filterbanks are normalised per
utterance here (mean 0, variance 1 per bin) and stacked `stack` frames to one.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import numpy as np
from absl import logging

from experiments.data import preparing
from experiments.data.speech import features as features_lib

CORPORA = {
    "synthetic": ("experiments.data.speech.synthetic", "LtSynthSpeech"),
    "librispeech": ("experiments.data.speech.corpora", "LtLibriSpeech"),
    "wsj": ("experiments.data.speech.corpora", "LtWsj"),
}
SPLITS = ("train", "validation", "test")
SYNTHETIC_SIZES = ("default", "smoke")


@dataclasses.dataclass(frozen=True)
class Utterances:
    """A split in memory: features float32 [T_i, F], phoneme ids int32 [L_i], texts."""

    features: list[np.ndarray]
    phonemes: list[np.ndarray]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.features)

    @property
    def frame_counts(self) -> np.ndarray:
        return np.array([len(f) for f in self.features], np.int64)

    def select(self, rows) -> Utterances:
        return Utterances(
            [self.features[i] for i in rows], [self.phonemes[i] for i in rows], [self.texts[i] for i in rows]
        )


def builder(corpus: str, *, data_dir, size: str = "default"):
    """The TFDS builder of `corpus` (one of `CORPORA`); `size` picks the synthetic corpus's config."""
    if corpus not in CORPORA:
        raise ValueError(f"corpus {corpus!r} is not one of {sorted(CORPORA)}.")
    module, name = CORPORA[corpus]
    cls = getattr(importlib.import_module(module), name)
    data_dir = os.path.expanduser(os.fspath(data_dir))
    if corpus == "synthetic":
        if size not in SYNTHETIC_SIZES:
            raise ValueError(f"the synthetic corpus's size {size!r} is not one of {SYNTHETIC_SIZES}.")
        return cls(config=size, data_dir=data_dir, file_format="array_record")
    return cls(data_dir=data_dir, file_format="array_record")


def _manual_dir(data_dir, manual_dir) -> str:
    """`manual_dir`, by default `<data_dir>/downloads/manual`, with ~ expanded."""
    default = os.path.join(os.path.expanduser(os.fspath(data_dir)), "downloads", "manual")
    return os.path.expanduser(os.fspath(manual_dir or default))


def check_available(corpus: str, *, data_dir, manual_dir=None, size: str = "default") -> None:
    """Raise a FileNotFoundError naming the manual dir and what to put there when `corpus` is
    neither prepared nor in `manual_dir`; write nothing (TFDS would announce a download and
    leave an empty folder before its own error)."""
    if corpus == "synthetic":  # synthesised when first needed
        return
    b = builder(corpus, data_dir=data_dir, size=size)
    if not b.is_prepared():
        type(b).corpus_root(_manual_dir(data_dir, manual_dir))


def prepared_builder(corpus: str, *, data_dir, manual_dir=None, size: str = "default"):
    """`builder(...)`, prepared first if it is not: synthesised (synthetic) or read from
    `manual_dir` (default `<data_dir>/downloads/manual`); nothing is downloaded."""
    import tensorflow_datasets as tfds

    b = builder(corpus, data_dir=data_dir, size=size)
    if not b.is_prepared():
        with preparing.one_at_a_time(os.path.expanduser(os.fspath(data_dir)), b.name):
            b = builder(corpus, data_dir=data_dir, size=size)  # another process may have prepared it
            if not b.is_prepared():
                check_available(corpus, data_dir=data_dir, manual_dir=manual_dir, size=size)
                manual_dir = _manual_dir(data_dir, manual_dir)
                b.download_and_prepare(
                    download_config=tfds.download.DownloadConfig(
                        manual_dir=manual_dir, try_download_gcs=False
                    )
                )
        b = builder(corpus, data_dir=data_dir, size=size)
    return b


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def load_utterances(
    corpus: str,
    split: str,
    *,
    data_dir,
    manual_dir=None,
    size: str = "default",
    stack: int = 1,
    max_examples: int = 0,
    max_frames: int = 0,
) -> Utterances:
    """Split `split` of `corpus` in memory, in the builder's order: per-utterance normalised
    log-mel frames stacked `stack` to one (float32 [ceil(T / stack), stack * 80]), phoneme ids
    and the text.

    `max_examples` > 0 keeps the first ones; `max_frames` > 0 drops utterances longer than that
    many (stacked) frames. Utterances with fewer (stacked) frames than phonemes cannot be
    aligned by CTC and are dropped with a warning.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}.")
    if stack < 1:
        raise ValueError(f"stack must be >= 1 frame, got {stack}.")
    b = prepared_builder(corpus, data_dir=data_dir, manual_dir=manual_dir, size=size)
    if split not in b.info.splits:
        raise FileNotFoundError(
            f"corpus {corpus!r} under {b.data_path} has no split {split!r} (it has {sorted(b.info.splits)}): "
            "the manual dir held none of its files when it was prepared; add them and delete "
            f"{b.data_path} to prepare it again."
        )
    source = b.as_data_source(split)
    count = len(source) if max_examples <= 0 else min(max_examples, len(source))
    examples = source.__getitems__(range(count))
    out = Utterances([], [], [])
    unalignable = too_long = 0
    for example in examples:
        f_TF = features_lib.stack_frames(features_lib.normalise_utterance(example["features"]), stack)
        y_L = np.asarray(example["phonemes"], np.int32)
        if len(f_TF) < len(y_L):
            unalignable += 1
            continue
        if max_frames and len(f_TF) > max_frames:
            too_long += 1
            continue
        out.features.append(f_TF)
        out.phonemes.append(y_L)
        out.texts.append(_text(example["text"]))
    if unalignable:
        logging.warning(
            "%s %s: %d of %d utterances have fewer frames (stacked %d to one) than phonemes; left out.",
            corpus,
            split,
            unalignable,
            count,
            stack,
        )
    if too_long:
        logging.info(
            "%s %s: %d utterances longer than %d frames left out.", corpus, split, too_long, max_frames
        )
    if not len(out):
        raise ValueError(
            f"{corpus} {split}: no utterance left (of {count}) with stack={stack}, max_frames={max_frames}."
        )
    return out
