"""The synthetic speech corpus: standard-library sentences spoken by eSpeak NG, as log-mel features and
phoneme targets, a TFDS builder written as `array_record` with no TensorFlow and no download.

It stands in for WSJ phoneme recognition (the CTC experiment of "Transformers are RNNs"). Each sentence of
`sentences.stdlib_sentences()` is spoken once, by a voice and variant drawn at random ("en-gb-x-rp+m3"),
at a random rate (words per minute) and pitch, with white noise at a random signal-to-noise ratio; all
draws come from `np.random.default_rng([seed, key])`, `key` being the sentence's index in that list, so
the build is deterministic (for a given Python standard library, which supplies the text). The phoneme
targets are `espeak.phonemize(text, voice)` of the voice that spoke: exact by construction.

Splits are by sentence, from a hash of its text (90% train, 5% validation, 5% test), so no sentence is in
two splits. Dropped, and counted in the log: utterances whose phonemes are not all in `PHONEMES`, with no
phonemes, or with more phonemes than frames / 4 (CTC over 4-fold stacked frames, `stack_frames(x, 4)`,
could not align them; none of the stdlib sentences is this fast).

    builder = LtSynthSpeech(config="smoke", data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
    train = builder.as_data_source("train")
    train[0]  # {"features": float32 [T, 80], "phonemes": int32 [L], "text": bytes, "voice": bytes, ...}

Configs: "default" (2,600 / 362 / 336 utterances in train / validation / test, 3.1 hours of audio, median
303 frames and 38 phonemes per utterance, at most 1,242 frames and 126 phonemes; 308 MB; built in about
40 s on one core) and "smoke" (24 / 8 / 8 utterances by two voices, for tests, built in about a second).

Every example holds "features" (float32 [T, 80] log-mel at 100 frames per second, `features.log_mel`;
NOT normalised: `features.normalise_utterance` when loading), "phonemes" (int32 [L], ids into
`phonemes.PHONEMES`, no blank), "text" and "voice" (`tfds.features.Text`: bytes when read from a data
source, UTF-8), "num_samples" (int64, audio length at 22,050 Hz; T = ceil(num_samples * 100 / 22050)),
and the draws "rate" (int64, words per minute), "pitch" (int64, 0..100) and "snr_db" (float32).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds

from experiments.data.speech import espeak, features, phonemes, sentences

SPLITS = ("train", "validation", "test")
MIN_FRAMES_PER_PHONEME = 4  # utterances with fewer frames per phoneme are dropped (see the docstring)

_log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class SpeechConfig(tfds.core.BuilderConfig):
    """Which sentences are spoken, by which voices, with which random rate, pitch and noise.

    `sentences_per_split`: at most this many sentences of each split, the first ones in the order of
    `stdlib_sentences()` (None: all of them).
    """

    sentences_per_split: tuple[tuple[str, int | None], ...] = tuple((split, None) for split in SPLITS)
    voices: tuple[str, ...] = espeak.ENGLISH_VOICES
    variants: tuple[str, ...] = espeak.VARIANTS
    rate_range: tuple[int, int] = (140, 200)  # words per minute, inclusive
    pitch_range: tuple[int, int] = (30, 70)  # eSpeak pitch 0..100, inclusive
    snr_db_range: tuple[float, float] = (20.0, 40.0)
    seed: int = 0


class LtSynthSpeech(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Synthetic English speech (eSpeak NG) with exact phoneme targets, for CTC phoneme recognition."""

    name = "lt_synth_speech"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Standard-library sentences spoken by eSpeak NG."}
    BUILDER_CONFIGS: ClassVar[list[SpeechConfig]] = [
        SpeechConfig(
            name="default",
            description="3.1 hours: 2,600 train sentences and every validation (362) and test (336) "
            "sentence, 8 English voices x 13 variants; 308 MB, built in about 40 s.",
            sentences_per_split=(("train", 2600), ("validation", None), ("test", None)),
        ),
        SpeechConfig(
            name="smoke",
            description="24 + 8 + 8 sentences, 2 voices: built in seconds, for tests.",
            sentences_per_split=(("train", 24), ("validation", 8), ("test", 8)),
            voices=("en-us", "en-gb-x-rp"),
        ),
    ]
    DEFAULT_CONFIG_NAME = "default"

    def _info(self) -> tfds.core.DatasetInfo:
        info = self.dataset_info_from_configs(
            description=__doc__.split("\n\n")[0],
            features=tfds.features.FeaturesDict(
                {
                    "features": tfds.features.Tensor(shape=(None, features.NUM_MELS), dtype=np.float32),
                    "phonemes": tfds.features.Tensor(shape=(None,), dtype=np.int32),
                    "text": tfds.features.Text(),
                    "voice": tfds.features.Text(),
                    "num_samples": tfds.features.Scalar(dtype=np.int64),
                    "rate": tfds.features.Scalar(dtype=np.int64),
                    "pitch": tfds.features.Scalar(dtype=np.int64),
                    "snr_db": tfds.features.Scalar(dtype=np.float32),
                }
            ),
            supervised_keys=("features", "phonemes"),
            homepage="https://github.com/espeak-ng/espeak-ng",
            # Keep the sentences' order (examples sorted by their integer key): pipelines shuffle.
            disable_shuffling=True,
        )
        # No precomputed metadata on GCS to look up (see experiments/data/builders.py).
        info.initialize_from_bucket = lambda: None
        return info

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        chosen = split_sentences(self.builder_config)
        return {split: self._generate_examples(split, items) for split, items in chosen.items()}

    def _generate_examples(self, split: str, items: list[tuple[int, str]]):
        config = self.builder_config
        dropped: dict[str, int] = {}
        # One process builds "default" in under a minute (about 90 utterances per second on one core), so
        # no worker processes: spawned ones need a `__main__` guard in every calling script, forked ones
        # copy a parent that may run JAX's threads. eSpeak's global state rules out threads.
        for key, example, reason in map(_render, [(key, text, config) for key, text in items]):
            if reason:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            yield key, example
        if dropped:
            _log.warning("lt_synth_speech %s: dropped %s of %d utterances.", split, dropped, len(items))


def sentence_split(text: str) -> str:
    """The split of a sentence, from the SHA-256 of its text: 90% train, 5% validation, 5% test."""
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def split_sentences(config: SpeechConfig) -> dict[str, list[tuple[int, str]]]:
    """{split: [(key, sentence)]} of `config`: keys are indices into `stdlib_sentences()`."""
    limits = dict(config.sentences_per_split)
    unknown = set(limits) - set(SPLITS)
    if unknown:
        raise ValueError(f"sentences_per_split names unknown splits {sorted(unknown)}; allowed: {SPLITS}.")
    chosen: dict[str, list[tuple[int, str]]] = {split: [] for split in limits}
    for key, text in enumerate(sentences.stdlib_sentences()):
        split = sentence_split(text)
        if split in chosen and (limits[split] is None or len(chosen[split]) < limits[split]):
            chosen[split].append((key, text))
    return chosen


def draw_utterance(key: int, config: SpeechConfig) -> dict:
    """The random voice ("en-us+f3"), rate, pitch, SNR and noise generator of example `key`."""
    rng = np.random.default_rng([config.seed, key])
    language = config.voices[rng.integers(len(config.voices))]
    variant = config.variants[rng.integers(len(config.variants))]
    return {
        "voice": f"{language}+{variant}",
        "rate": int(rng.integers(config.rate_range[0], config.rate_range[1] + 1)),
        "pitch": int(rng.integers(config.pitch_range[0], config.pitch_range[1] + 1)),
        "snr_db": float(rng.uniform(*config.snr_db_range)),
        "rng": rng,
    }


def add_noise(audio_N: np.ndarray, snr_db: float, rng: np.random.Generator) -> np.ndarray:
    """`audio_N` (int16) as float32 in [-1, 1) plus white Gaussian noise `snr_db` below its mean power.

    The power is that of the whole utterance, its leading and trailing pauses included.
    """
    speech_N = audio_N.astype(np.float32) / 32768.0
    power = float(np.mean(np.square(speech_N, dtype=np.float64))) if speech_N.size else 0.0
    noise_std = np.sqrt(power / 10.0 ** (snr_db / 10.0))
    return speech_N + (noise_std * rng.standard_normal(speech_N.shape)).astype(np.float32)


def _render(job) -> tuple[int, dict | None, str | None]:
    """Synthesises one example: (key, example, None), or (key, None, why it is dropped)."""
    key, text, config = job
    draw = draw_utterance(key, config)
    audio_N = espeak.synthesize(text, draw["voice"], rate=draw["rate"], pitch=draw["pitch"])
    try:
        ids_L = phonemes.encode(espeak.phonemize(text, draw["voice"]))
    except ValueError:
        return key, None, "phoneme not in the inventory"
    noisy_N = add_noise(audio_N, draw["snr_db"], draw["rng"])
    features_TF = features.log_mel(noisy_N, espeak.SAMPLE_RATE)
    if ids_L.size == 0:
        return key, None, "no phonemes"
    if features_TF.shape[0] < MIN_FRAMES_PER_PHONEME * ids_L.size:
        return key, None, f"fewer than {MIN_FRAMES_PER_PHONEME} frames per phoneme"
    example = {
        "features": features_TF,
        "phonemes": ids_L,
        "text": text,
        "voice": draw["voice"],
        "num_samples": int(audio_N.shape[0]),
        "rate": draw["rate"],
        "pitch": draw["pitch"],
        "snr_db": np.float32(draw["snr_db"]),
    }
    return key, example, None
