"""TFDS builders for real speech corpora read from the user's copy: LibriSpeech and WSJ (no download).

These corpora are large (LibriSpeech) or licensed (WSJ, from the LDC), so nothing is fetched: the
builders read the folders the user puts in the manual dir, in the layouts the corpora ship in, and write
`array_record` (no TensorFlow). Like `experiments/data/builders.py` they are unregistered
(`skip_registration=True`, names `lt_librispeech` and `lt_wsj`) and used through the classes:

    builder = LtLibriSpeech(data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=folder_holding_LibriSpeech, try_download_gcs=False))
    test = builder.as_data_source("test")

Every example has the layout of `synthetic.LtSynthSpeech`, so that the same loading code reads all
corpora:

    {"features": float32 [T, 80]   log-mel filterbanks, `features.log_mel` (not normalised), 100 frames/s
     "phonemes": int32 [L]         `phonemes.encode(espeak.phonemize(text, "en-us"))`
     "text": str                   the transcript as phonemised (lower case; for WSJ, cleaned: see
                                   `clean_wsj_transcript`)
     "voice": str                  the SPEAKER id (LibriSpeech "103", WSJ "011"): the key of
                                   LtSynthSpeech, which holds the eSpeak voice there
     "num_samples": int64          samples of the audio, at the file's own sample rate}

The phoneme targets are eSpeak NG's General American (en-us) phonemes of the transcript, the inventory of
the synthetic corpus, not a pronouncing dictionary's. Phoneme error rates on WSJ in the literature (and
TIMIT-style results) use CMUdict phonemes folded to 39 or 42 classes, so a PER measured here on real
WSJ is not directly comparable with them. Utterances whose phonemes fall outside `phonemes.PHONEMES`, or
which have none (a transcript of noises only), are left out and counted in a warning. Unlike the
synthetic corpus, fast utterances (few frames per phoneme) are kept: `loading.load_utterances` drops
those that CTC cannot align at the frame stacking it is asked for.

Splits are "train", "validation" and "test"; each builder documents which corpus folders make them
(`SPLIT_FOLDERS`). Preparing writes the splits whose folders are present (a user holding only the
evaluation data can prepare validation and test); a split whose folders are all missing is left out with
a warning naming them, and preparing fails with a `FileNotFoundError` naming the folders when no split
is present at all. Examples are stored in a fixed order (by folder, then utterance id).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from absl import logging

from experiments.data.speech import espeak, phonemes
from experiments.data.speech import features as features_lib
from experiments.data.speech.audio_files import read_flac, read_sphere, read_wav
from experiments.data.speech.wsj_transcripts import clean_wsj_transcript, read_wsj_transcripts

SPLITS = ("train", "validation", "test")
PHONEMIZER_VOICE = "en-us"  # the eSpeak voice whose phonemes are the targets


@dataclasses.dataclass(frozen=True)
class Utterance:
    """One utterance found on disk: its id, audio file, raw transcript and speaker."""

    id: str
    audio_path: str
    transcript: str
    speaker: str


def speech_features() -> tfds.features.FeaturesDict:
    """The feature dict of the real corpora: the keys of `synthetic.LtSynthSpeech` bar its synthesis draws
    ("rate", "pitch", "snr_db"), declared as it declares them, so that the same loading code reads both."""
    return tfds.features.FeaturesDict(
        {
            "features": tfds.features.Tensor(shape=(None, features_lib.NUM_MELS), dtype=np.float32),
            "phonemes": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "text": tfds.features.Text(),
            "voice": tfds.features.Text(),
            "num_samples": tfds.features.Scalar(dtype=np.int64),
        }
    )


class _SpeechCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared parts: the example layout, finding each split's utterances, turning one into an example."""

    DESCRIPTION: ClassVar[str]
    HOMEPAGE: ClassVar[str]
    SPLIT_FOLDERS: ClassVar[Mapping[str, tuple[str, ...]]]

    def _info(self) -> tfds.core.DatasetInfo:
        info = self.dataset_info_from_configs(
            description=self.DESCRIPTION,
            features=speech_features(),
            supervised_keys=("features", "phonemes"),
            homepage=self.HOMEPAGE,
            # Keep the order of the corpus (by folder, then utterance id): the training pipeline shuffles
            # by itself, reproducibly.
            disable_shuffling=True,
        )
        # No GCS metadata exists for these data sets; skip the lookup (and the tmp folder it leaves).
        info.initialize_from_bucket = lambda: None
        return info

    @classmethod
    def corpus_root(cls, manual_dir: os.PathLike | str | None) -> str:
        """The folder under `manual_dir` holding the corpus.

        Raises:
          FileNotFoundError: naming `manual_dir` when it, or the corpus in it, is missing, and what to put
            there.
        """
        raise NotImplementedError

    @classmethod
    def find_utterances(cls, manual_dir: os.PathLike | str | None, split: str) -> list[Utterance]:
        """The utterances of `split` in `manual_dir`, in the order they are stored.

        Raises:
          ValueError: for a split not in `SPLITS`.
          FileNotFoundError: naming the folder(s) of `split` that are missing and what to put there.
        """
        raise NotImplementedError

    @classmethod
    def read_audio(cls, path: str) -> tuple[np.ndarray, int]:
        """The mono samples of the audio file `path` (int16 [num_samples]) and its sample rate."""
        raise NotImplementedError

    @classmethod
    def clean_transcript(cls, transcript: str) -> str:
        """The words spoken, as eSpeak is to read them (the "text" of the example)."""
        raise NotImplementedError

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        try:
            manual_dir = dl_manager.manual_dir
        except AssertionError:  # TFDS's way of saying that the manual dir is missing or empty
            manual_dir = dl_manager._manual_dir  # only to name it in the error
        self.corpus_root(manual_dir)  # one clear error when the manual dir or the corpus is missing
        found, missing = {}, []
        for split in SPLITS:
            try:
                found[split] = self.find_utterances(manual_dir, split)
            except FileNotFoundError as e:
                missing.append(str(e))
        if not found:
            raise FileNotFoundError(" ".join(missing))
        for message in missing:
            logging.warning("%s: %s That split is left out.", self.name, message)
        return {split: self._generate_examples(split, utterances) for split, utterances in found.items()}

    def _generate_examples(self, split: str, utterances: list[Utterance]):
        skipped: list[str] = []
        key = 0
        for utterance in utterances:
            example = self.make_example(utterance)
            if example is None:
                skipped.append(utterance.id)
                continue
            yield key, example
            key += 1
        if skipped:
            logging.warning(
                "%s %s: %d of %d utterances left out, with no phonemes or phonemes outside "
                "phonemes.PHONEMES (first ids: %s).",
                self.name, split, len(skipped), len(utterances), ", ".join(skipped[:5]),
            )  # fmt: skip

    @classmethod
    def make_example(cls, utterance: Utterance) -> dict | None:
        """The example of `utterance`, or None when its phonemes are empty or outside the inventory."""
        text = cls.clean_transcript(utterance.transcript)
        try:
            ids = phonemes.encode(espeak.phonemize(text, PHONEMIZER_VOICE))
        except ValueError:
            return None
        if not len(ids):
            return None
        audio, sample_rate = cls.read_audio(utterance.audio_path)
        return {
            "features": features_lib.log_mel(audio, sample_rate),
            "phonemes": ids,
            "text": text,
            "voice": utterance.speaker,
            "num_samples": len(audio),
        }


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}.")


def _check_manual_dir(manual_dir, corpus: str, what: str) -> str:
    """`manual_dir` as a string, or a FileNotFoundError saying what to put there."""
    if manual_dir is None or not os.path.isdir(manual_dir):
        raise FileNotFoundError(
            f"The manual dir {manual_dir} of {corpus} does not exist. {corpus} is not downloaded: put {what} "
            "there (or pass manual_dir= pointing to it)."
        )
    return os.fspath(manual_dir)


# ----------------------------------------------------------------------------------------------------
# LibriSpeech


def read_librispeech_transcripts(path: os.PathLike | str) -> dict[str, str]:
    """The lines "ID TRANSCRIPT" of a LibriSpeech `<speaker>-<chapter>.trans.txt`, as {id: transcript}.

    Raises:
      ValueError: naming the file and line that is not "ID TRANSCRIPT".
    """
    transcripts = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            utterance_id, _, transcript = line.strip().partition(" ")
            if not transcript.strip():
                raise ValueError(f"{path}, line {number}: expected 'ID TRANSCRIPT', got {line.strip()!r}.")
            transcripts[utterance_id] = transcript.strip()
    return transcripts


def _subdirs(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name)))


class LtLibriSpeech(_SpeechCorpus, skip_registration=True):
    """LibriSpeech (Panayotov et al., 2015): read English audiobooks, 16 kHz FLAC, from the manual dir.

    Layout, as in the archives of openslr.org/12 (extract them all into the manual dir):
    `<manual_dir>/LibriSpeech/<subset>/<speaker>/<chapter>/<speaker>-<chapter>-<utt>.flac`, with the
    transcripts of a chapter in `<speaker>-<chapter>.trans.txt` beside them (lines "ID TRANSCRIPT", upper
    case). The manual dir may also be the `LibriSpeech` folder itself.

    FLAC is decoded with the `soundfile` package (libsndfile): NumPy, the standard library and the rest
    of our dependencies have no FLAC reader. It is imported only when preparing.

    The transcripts are lower-cased before phonemising (upper-case words such as "US" would be spelled
    out by eSpeak) and stored so in "text". "voice" holds the speaker id.
    """

    name = "lt_librispeech"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Read from the LibriSpeech FLAC files."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Download LibriSpeech's dev-clean, test-clean and train-* archives from https://www.openslr.org/12 "
        "and extract them into the manual dir (giving <manual_dir>/LibriSpeech/<subset>/...)."
    )
    DESCRIPTION = "LibriSpeech ASR corpus (Panayotov et al., 2015) with eSpeak NG en-us phoneme targets."
    HOMEPAGE = "https://www.openslr.org/12"
    CORPUS_FOLDER = "LibriSpeech"
    # The LibriSpeech subsets making each split. train: every one of these that is present (at least one
    # must be), clean-100 first; the usual 100-hour setup holds only train-clean-100.
    SPLIT_FOLDERS: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "train": ("train-clean-100", "train-clean-360", "train-other-500"),
        "validation": ("dev-clean",),
        "test": ("test-clean",),
    }

    @classmethod
    def corpus_root(cls, manual_dir) -> str:
        """`<manual_dir>/LibriSpeech`, or `manual_dir` itself when it holds the subsets directly."""
        manual_dir = _check_manual_dir(
            manual_dir,
            "LibriSpeech",
            f"the extracted archives of {cls.HOMEPAGE} (a {cls.CORPUS_FOLDER}/ folder)",
        )
        root = os.path.join(manual_dir, cls.CORPUS_FOLDER)
        if os.path.isdir(root):
            return root
        subsets = {folder for folders in cls.SPLIT_FOLDERS.values() for folder in folders}
        if subsets & set(os.listdir(manual_dir)):
            return manual_dir
        raise FileNotFoundError(
            f"{manual_dir} holds no {cls.CORPUS_FOLDER}/ folder. Extract LibriSpeech's archives from "
            f"{cls.HOMEPAGE} there, giving {root}/<subset>/<speaker>/<chapter>/*.flac and *.trans.txt."
        )

    @classmethod
    def find_utterances(cls, manual_dir, split):
        _check_split(split)
        root = cls.corpus_root(manual_dir)
        subsets = [s for s in cls.SPLIT_FOLDERS[split] if os.path.isdir(os.path.join(root, s))]
        if not subsets:
            wanted = " or ".join(os.path.join(root, s) for s in cls.SPLIT_FOLDERS[split])
            raise FileNotFoundError(
                f"LibriSpeech split {split!r} needs the folder {wanted}, which is missing: extract the "
                f"archive {cls.SPLIT_FOLDERS[split][0]}.tar.gz of {cls.HOMEPAGE} into "
                f"{os.path.dirname(root)}."
            )
        return [u for subset in subsets for u in cls._subset_utterances(os.path.join(root, subset))]

    @classmethod
    def _subset_utterances(cls, folder: str) -> Iterator[Utterance]:
        for speaker in _subdirs(folder):
            for chapter in _subdirs(os.path.join(folder, speaker)):
                chapter_dir = os.path.join(folder, speaker, chapter)
                transcripts_path = os.path.join(chapter_dir, f"{speaker}-{chapter}.trans.txt")
                if not os.path.isfile(transcripts_path):
                    raise FileNotFoundError(f"{chapter_dir} has no transcript file {transcripts_path}.")
                for utterance_id, transcript in sorted(
                    read_librispeech_transcripts(transcripts_path).items()
                ):
                    audio_path = os.path.join(chapter_dir, utterance_id + ".flac")
                    if not os.path.isfile(audio_path):
                        raise FileNotFoundError(
                            f"{transcripts_path} lists {utterance_id}, but {audio_path} is missing "
                            "(an incompletely extracted archive?)."
                        )
                    yield Utterance(utterance_id, audio_path, transcript, speaker)

    @classmethod
    def read_audio(cls, path):
        return read_flac(path)

    @classmethod
    def clean_transcript(cls, transcript):
        return " ".join(transcript.lower().split())


# ----------------------------------------------------------------------------------------------------
# WSJ


class LtWsj(_SpeechCorpus, skip_registration=True):
    """WSJ0 and WSJ1 (CSR-I LDC93S6, CSR-II LDC94S13): read news text, 16 kHz, from the manual dir.

    The manual dir holds the LDC discs as shipped (e.g. `11-1.1/wsj0/...`, `13-34.1/wsj1/...`) or merged
    (`wsj0/...`, `wsj1/...`), at any depth. Audio: `<...>/wsj0|wsj1/<set>/<speaker>/<utterance>.wv1`, the
    Sennheiser close-talking channel in NIST SPHERE (the second microphone, `.wv2`, is ignored). The LDC's
    files are shorten-compressed, which is not read here: convert them first with
    `sph2pipe -f wav X.wv1 X.wav`, keeping each `.wav` in the folder of its `.wv1` (a `.wav` is read in
    preference to its `.wv1`; uncompressed SPHERE `.wv1` files are read as they are). Transcripts: every
    `.dot` file anywhere under the manual dir (WSJ0 keeps them in `wsj0/transcrp/dots/`, WSJ1 in
    `wsj1/trans/wsj1/`, the Nov'92 test set beside its audio), lines "transcript (utterance_id)"; an
    utterance with no `.dot` line falls back to the `.lsn` files. The transcripts are cleaned by
    `clean_wsj_transcript`. "voice" holds the speaker id, the first 3 characters of the utterance id.

    Splits, the standard ones of Kaldi's `egs/wsj/s5` recipe (`local/wsj_data_prep.sh`), by the set
    folders holding their audio (`SPLIT_FOLDERS`):

    - train = si284: `wsj0/si_tr_s` + `wsj1/si_tr_s` (37,416 utterances in Kaldi), without the speaker
      folder `wsj0/si_tr_s/401`, which Kaldi's lists leave out too (`EXCLUDED_FOLDERS`).
    - validation = dev93: `wsj1/si_dt_20` (the 503 utterances of Kaldi's test_dev93, index h1_p0).
    - test = eval92: `wsj0/si_et_20` (the 333 utterances of Kaldi's test_eval92, index
      `test/nvp/si_et_20.ndx`).

    The `_05` folders (`si_dt_05`, `si_et_05`) are the 5k-vocabulary variants of these test sets (Kaldi's
    dev93_5k, eval92_5k); subclass with another `SPLIT_FOLDERS` to use them. Kaldi selects the test
    utterances through the LDC's index (`.ndx`) files; this builder takes the whole set folders, which hold
    the same utterances as far as we know (not checked against a real copy).

    Phoneme error rates on WSJ in the literature use CMUdict phonemes (39 or 42 classes); ours are eSpeak
    NG's, so they are not directly comparable.
    """

    name = "lt_wsj"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Read from sph2pipe-converted WSJ0/WSJ1."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put the LDC's WSJ0 (LDC93S6) and WSJ1 (LDC94S13) discs in the manual dir, with every .wv1 file "
        "converted by `sph2pipe -f wav X.wv1 X.wav` into a .wav beside it."
    )
    DESCRIPTION = "WSJ0 + WSJ1 read speech (LDC93S6, LDC94S13) with eSpeak NG en-us phoneme targets."
    HOMEPAGE = "https://catalog.ldc.upenn.edu/LDC94S13A"
    # Per split, the "<wsj0|wsj1>/<set>" folders holding its audio (matched case-insensitively).
    SPLIT_FOLDERS: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "train": ("wsj0/si_tr_s", "wsj1/si_tr_s"),
        "validation": ("wsj1/si_dt_20",),
        "test": ("wsj0/si_et_20",),
    }
    EXCLUDED_FOLDERS: ClassVar[tuple[str, ...]] = ("wsj0/si_tr_s/401",)
    AUDIO_EXTENSIONS: ClassVar[tuple[str, ...]] = (".wav", ".wv1")  # in order of preference

    @classmethod
    def corpus_root(cls, manual_dir):
        """`manual_dir` itself: the WSJ folders are looked for at any depth under it."""
        return _check_manual_dir(
            manual_dir, "WSJ", "the LDC's WSJ0 (LDC93S6) and WSJ1 (LDC94S13) discs, .wv1 converted to .wav"
        )

    @classmethod
    def find_utterances(cls, manual_dir, split):
        _check_split(split)
        manual_dir = cls.corpus_root(manual_dir)
        folders = cls._set_folders(manual_dir, split)
        audio = cls._audio_files(folders)
        transcripts = cls._transcripts(manual_dir)
        utterances, untranscribed = [], []
        for utterance_id, path in sorted(audio.items()):
            if utterance_id in transcripts:
                utterances.append(Utterance(utterance_id, path, transcripts[utterance_id], utterance_id[:3]))
            else:
                untranscribed.append(utterance_id)
        if untranscribed:
            logging.warning(
                "WSJ %s: %d utterances have no line in any .dot or .lsn file under %s; left out (first: %s).",
                split, len(untranscribed), manual_dir, ", ".join(untranscribed[:5]),
            )  # fmt: skip
        if not utterances:
            raise FileNotFoundError(
                f"WSJ split {split!r}: the folders {folders} hold no .wav or .wv1 file with a transcript in "
                f"a .dot or .lsn file under {manual_dir}."
            )
        return utterances

    @classmethod
    def _set_folders(cls, manual_dir: str, split: str) -> list[str]:
        """Every folder under `manual_dir` that is one of `split`'s "<wsj0|wsj1>/<set>" folders."""
        wanted = {folder.lower() for folder in cls.SPLIT_FOLDERS[split]}
        found = []
        for parent, dirs, _ in os.walk(manual_dir):
            dirs.sort()
            for name in dirs:
                if f"{os.path.basename(parent)}/{name}".lower() in wanted:
                    found.append(os.path.join(parent, name))
        if not found:
            raise FileNotFoundError(
                f"WSJ split {split!r} needs the folder(s) {' and '.join(cls.SPLIT_FOLDERS[split])} (at any "
                f"depth under {manual_dir}, e.g. {manual_dir}/11-1.1/{cls.SPLIT_FOLDERS[split][0]}/<speaker>/"
                "*.wav), "
                "which are missing: copy the LDC's WSJ0 (LDC93S6) and WSJ1 (LDC94S13) discs there."
            )
        return found

    @classmethod
    def _audio_files(cls, set_folders: list[str]) -> dict[str, str]:
        """{utterance id: audio path} of `<set>/<speaker>/<utterance>.wav|.wv1`, a .wav before its .wv1.

        Raises:
          ValueError: for an utterance found in two places (two copies of the corpus in the manual dir).
        """
        excluded = {folder.lower() for folder in cls.EXCLUDED_FOLDERS}
        found: dict[str, str] = {}
        for set_folder in set_folders:
            set_name = "/".join(set_folder.replace(os.sep, "/").split("/")[-2:]).lower()
            for speaker in _subdirs(set_folder):
                if f"{set_name}/{speaker.lower()}" in excluded:
                    continue
                for utterance_id, path in cls._speaker_audio(os.path.join(set_folder, speaker)).items():
                    if utterance_id in found:
                        raise ValueError(
                            f"WSJ utterance {utterance_id} is in two places: {found[utterance_id]} and "
                            f"{path}; keep one copy of the corpus in the manual dir."
                        )
                    found[utterance_id] = path
        return found

    @classmethod
    def _speaker_audio(cls, folder: str) -> dict[str, str]:
        """{utterance id: path} of one speaker's folder, the preferred extension of each utterance."""
        by_id: dict[str, str] = {}
        for name in sorted(os.listdir(folder)):
            stem, extension = os.path.splitext(name)
            extension = extension.lower()
            if extension not in cls.AUDIO_EXTENSIONS:
                continue
            previous = by_id.get(stem.lower())
            if previous is None or cls.AUDIO_EXTENSIONS.index(extension) < cls.AUDIO_EXTENSIONS.index(
                os.path.splitext(previous)[1].lower()
            ):
                by_id[stem.lower()] = os.path.join(folder, name)
        return by_id

    @classmethod
    def _transcripts(cls, manual_dir: str) -> dict[str, str]:
        """{utterance id: raw transcript} from every .dot file under `manual_dir`, then the .lsn files."""
        dots: dict[str, str] = {}
        lsns: dict[str, str] = {}
        for parent, dirs, files in os.walk(manual_dir):
            dirs.sort()
            for name in sorted(files):
                extension = os.path.splitext(name)[1].lower()
                if extension in (".dot", ".lsn"):
                    target = dots if extension == ".dot" else lsns
                    target.update(read_wsj_transcripts(os.path.join(parent, name)))
        return {**lsns, **dots}

    @classmethod
    def read_audio(cls, path):
        if path.lower().endswith(".wav"):
            return read_wav(path)
        return read_sphere(path)

    @classmethod
    def clean_transcript(cls, transcript):
        return clean_wsj_transcript(transcript)
