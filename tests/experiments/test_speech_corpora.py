"""The LibriSpeech and WSJ builders (`experiments/data/speech/corpora.py`) on tiny fake corpora written here.

The fake corpora have the real layouts (folders, file names, transcript files) and audio formats (FLAC;
NIST SPHERE with both byte orders, shorten-compressed headers, `sph2pipe`'d WAV), with sines and noise
in place of speech.
"""

from __future__ import annotations

import os
import sys
import wave

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")
soundfile = pytest.importorskip("soundfile")

from experiments import tasks  # noqa: E402
from experiments.data.speech import audio_files, corpora, espeak, features, loading, phonemes, wsj_transcripts  # noqa: E402
from experiments.tasks import speech  # noqa: E402
from experiments.training import variants  # noqa: E402

RATE = 16_000


def tone(seconds: float, seed: int) -> np.ndarray:
    """int16 audio: a sine plus noise, `seconds` long at 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * RATE))) / RATE
    audio = 0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.shape)
    return (audio * 32767).astype(np.int16)


def expected_phonemes(text: str) -> np.ndarray:
    return phonemes.encode(espeak.phonemize(text, "en-us"))


def prepare(builder_cls, data_dir, manual_dir):
    builder = builder_cls(data_dir=os.fspath(data_dir), file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir), try_download_gcs=False)
    )
    return builder


def read_split(builder, split) -> list[dict]:
    source = builder.as_data_source(split)
    return [source[i] for i in range(len(source))]


def as_str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ----------------------------------------------------------------------------------------------------
# LibriSpeech

# split -> subset, [(speaker, chapter, utterance, seconds, transcript)]
LIBRISPEECH = {
    "train": (
        "train-clean-100",
        [
            ("19", "198", "0000", 0.52, "NORTHANGER ABBEY"),
            ("19", "198", "0001", 0.75, "THIS LITTLE WORK WAS FINISHED IN THE YEAR EIGHTEEN O THREE"),
            ("26", "495", "0000", 1.0, "US AND THEM"),
        ],
    ),
    "validation": (
        "dev-clean",
        [
            ("84", "121123", "0000", 0.61, "GO DO YOU HEAR"),
            ("84", "121123", "0001", 0.8, "BUT IN LESS THAN FIVE MINUTES THE STAIRCASE GROANED"),
        ],
    ),
    "test": (
        "test-clean",
        [
            ("1089", "134686", "0000", 0.9, "HE HOPED THERE WOULD BE STEW FOR DINNER"),
            ("1089", "134686", "0001", 0.47, "STUFF IT INTO YOU HIS BELLY COUNSELLED HIM"),
        ],
    ),
}


def write_librispeech(manual_dir, splits=tuple(LIBRISPEECH)) -> dict[str, np.ndarray]:
    """Writes the fake corpus of `splits` under `manual_dir/LibriSpeech`; returns {utterance id: audio}."""
    audio = {}
    for split in splits:
        subset, rows = LIBRISPEECH[split]
        chapters: dict[str, list[str]] = {}
        for speaker, chapter, utt, seconds, transcript in rows:
            folder = os.path.join(manual_dir, "LibriSpeech", subset, speaker, chapter)
            os.makedirs(folder, exist_ok=True)
            utterance_id = f"{speaker}-{chapter}-{utt}"
            audio[utterance_id] = tone(seconds, seed=len(audio))
            soundfile.write(os.path.join(folder, utterance_id + ".flac"), audio[utterance_id], RATE)
            chapters.setdefault(folder, []).append(f"{utterance_id} {transcript}")
        for folder, lines in chapters.items():
            speaker, chapter = folder.split(os.sep)[-2:]
            with open(os.path.join(folder, f"{speaker}-{chapter}.trans.txt"), "w") as f:
                f.write("\n".join(reversed(lines)) + "\n")  # out of order: the builder sorts
    return audio


@pytest.fixture(scope="module")
def librispeech(tmp_path_factory):
    root = tmp_path_factory.mktemp("librispeech")
    audio = write_librispeech(root / "manual")
    return prepare(corpora.LtLibriSpeech, root / "tfds", root / "manual"), audio


def test_librispeech_examples(librispeech):
    builder, audio = librispeech
    assert set(builder.info.splits) == set(LIBRISPEECH)
    for split, (_, rows) in LIBRISPEECH.items():
        examples = read_split(builder, split)
        assert len(examples) == len(rows)
        for example, (speaker, chapter, utt, seconds, transcript) in zip(examples, rows):
            samples = audio[f"{speaker}-{chapter}-{utt}"]
            features_TF = example["features"]
            assert features_TF.dtype == np.float32 and features_TF.shape[1] == features.NUM_MELS == 80
            assert abs(features_TF.shape[0] - seconds * 100) <= 1
            np.testing.assert_allclose(features_TF, features.log_mel(samples, RATE), rtol=1e-6, atol=1e-6)
            assert as_str(example["text"]) == transcript.lower()
            np.testing.assert_array_equal(example["phonemes"], expected_phonemes(transcript.lower()))
            assert example["phonemes"].dtype == np.int32
            assert as_str(example["voice"]) == speaker
            assert example["num_samples"] == len(samples)


def test_librispeech_lowercases_before_phonemising():
    # Upper-case "US" is spelled out by eSpeak ("you ess"); the pronoun is what LibriSpeech means.
    assert corpora.LtLibriSpeech.clean_transcript("US  AND THEM") == "us and them"
    assert not np.array_equal(expected_phonemes("us"), expected_phonemes("US"))


def test_librispeech_loads_through_the_speech_loader(librispeech, tmp_path):
    builder, _ = librispeech
    # builder.data_path is <data_dir>/lt_librispeech/1.0.0
    data_dir = os.path.dirname(os.path.dirname(os.fspath(builder.data_path)))
    loaded = loading.load_utterances("librispeech", "test", data_dir=data_dir, manual_dir=tmp_path / "unused")
    assert loaded.texts == [t.lower() for *_, t in LIBRISPEECH["test"][1]]
    assert [len(p) for p in loaded.phonemes] == [len(expected_phonemes(t)) for t in loaded.texts]


def test_librispeech_train_takes_every_train_subset(tmp_path):
    write_librispeech(tmp_path)
    extra = tmp_path / "LibriSpeech" / "train-other-500" / "7" / "8"
    extra.mkdir(parents=True)
    soundfile.write(extra / "7-8-0000.flac", tone(0.3, 9), RATE)
    (extra / "7-8.trans.txt").write_text("7-8-0000 ONE MORE\n")
    found = corpora.LtLibriSpeech.find_utterances(tmp_path, "train")
    assert [u.id for u in found] == ["19-198-0000", "19-198-0001", "26-495-0000", "7-8-0000"]
    # The manual dir may also be the LibriSpeech folder itself.
    assert corpora.LtLibriSpeech.find_utterances(tmp_path / "LibriSpeech", "train") == found


def test_librispeech_missing_manual_dir(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere.*openslr"):
        prepare(corpora.LtLibriSpeech, tmp_path / "tfds", missing)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "README").write_text("not LibriSpeech")
    with pytest.raises(FileNotFoundError, match="holds no LibriSpeech/ folder"):
        prepare(corpora.LtLibriSpeech, tmp_path / "tfds", tmp_path / "empty")


def test_librispeech_missing_split_folder(tmp_path):
    write_librispeech(tmp_path / "manual", splits=("validation",))
    with pytest.raises(FileNotFoundError, match="split 'test' needs the folder .*test-clean"):
        corpora.LtLibriSpeech.find_utterances(tmp_path / "manual", "test")
    with pytest.raises(FileNotFoundError, match="train-clean-100"):
        corpora.LtLibriSpeech.find_utterances(tmp_path / "manual", "train")
    # Preparing writes the splits that are there.
    builder = prepare(corpora.LtLibriSpeech, tmp_path / "tfds", tmp_path / "manual")
    assert set(builder.info.splits) == {"validation"}


def test_librispeech_missing_flac_is_named(tmp_path):
    write_librispeech(tmp_path, splits=("test",))
    os.remove(tmp_path / "LibriSpeech" / "test-clean" / "1089" / "134686" / "1089-134686-0001.flac")
    with pytest.raises(FileNotFoundError, match="1089-134686-0001.flac is missing"):
        corpora.LtLibriSpeech.find_utterances(tmp_path, "test")


def test_missing_soundfile_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "soundfile", None)  # makes `import soundfile` raise ImportError
    with pytest.raises(ImportError, match="pip install soundfile"):
        audio_files.read_flac(tmp_path / "x.flac")


# ----------------------------------------------------------------------------------------------------
# NIST SPHERE and WAV


def sphere_bytes(samples: np.ndarray, *, byte_format="01", coding="pcm", n_bytes=2, rate=RATE) -> bytes:
    """A NIST_1A file: the 1024-byte header, then the samples in `byte_format` ("01" little-endian)."""
    fields = [
        "database_id -s7 CSR-WSJ",
        "utterance_id -s8 011c0201",
        "channel_count -i 1",
        f"sample_count -i {len(samples)}",
        f"sample_rate -i {rate}",
        "sample_min -i -32768",
        "sample_max -i 32767",
        f"sample_n_bytes -i {n_bytes}",
        f"sample_byte_format -s2 {byte_format}",
        f"sample_coding -s{len(coding)} {coding}",
        "sample_sig_bits -i 16",
        "end_head",
    ]
    header = ("NIST_1A\n   1024\n" + "\n".join(fields) + "\n").encode("ascii")
    header += b" " * (1024 - len(header))
    dtype = "<i2" if byte_format == "01" else ">i2"
    return header + np.asarray(samples).astype(dtype).tobytes()


def write_wav(path, samples: np.ndarray, rate=RATE) -> None:
    with wave.open(os.fspath(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.astype("<i2").tobytes())


@pytest.mark.parametrize("byte_format", ["01", "10"])
def test_sphere_reader_returns_the_samples_written(tmp_path, byte_format):
    samples = np.array([0, 1, -1, 258, -259, 32767, -32768, 12345], np.int16)
    path = tmp_path / "a.wv1"
    path.write_bytes(sphere_bytes(samples, byte_format=byte_format, rate=8000))
    read, rate = audio_files.read_sphere(path)
    assert rate == 8000 and read.dtype == np.int16
    np.testing.assert_array_equal(read, samples)


def test_sphere_header_fields():
    header = audio_files.parse_sphere_header(sphere_bytes(np.zeros(5, np.int16), byte_format="10"))
    assert header["header_size"] == 1024
    assert header["sample_count"] == 5 and header["sample_rate"] == RATE
    assert header["sample_byte_format"] == "10" and header["sample_coding"] == "pcm"
    assert header["database_id"] == "CSR-WSJ"


@pytest.mark.parametrize("coding", ["pcm,embedded-shorten-v2.00", "shorten"])
def test_sphere_reader_refuses_shorten(tmp_path, coding):
    path = tmp_path / "011c0201.wv1"
    path.write_bytes(sphere_bytes(np.zeros(100, np.int16), coding=coding))
    with pytest.raises(ValueError, match=r"011c0201.wv1 is shorten-compressed.*sph2pipe -f wav"):
        audio_files.read_sphere(path)


def test_sphere_reader_refuses_other_formats(tmp_path):
    path = tmp_path / "a.wv1"
    path.write_bytes(sphere_bytes(np.zeros(4, np.int16), n_bytes=1))
    with pytest.raises(ValueError, match="1-byte samples"):
        audio_files.read_sphere(path)
    path.write_bytes(sphere_bytes(np.zeros(4, np.int16), coding="ulaw"))
    with pytest.raises(ValueError, match="sample_coding 'ulaw'"):
        audio_files.read_sphere(path)
    path.write_bytes(sphere_bytes(np.zeros(4, np.int16))[:-2])
    with pytest.raises(ValueError, match="says 4 samples, but the file holds 3"):
        audio_files.read_sphere(path)
    path.write_bytes(b"RIFF....WAVEfmt ")
    with pytest.raises(ValueError, match="not a NIST SPHERE file"):
        audio_files.read_sphere(path)


def test_wav_reader(tmp_path):
    samples = tone(0.1, 3)
    write_wav(tmp_path / "a.wav", samples, rate=8000)
    read, rate = audio_files.read_wav(tmp_path / "a.wav")
    assert rate == 8000
    np.testing.assert_array_equal(read, samples)


# ----------------------------------------------------------------------------------------------------
# WSJ transcripts

CLEANING = [
    # Kaldi's examples of raw .dot lines.
    (
        "Saatchi officials said the management re:structuring might accelerate its efforts",
        "saatchi officials said the management restructuring might accelerate its efforts",
    ),
    (
        "[loud_breath] And new hardware such as the set of personal computers I\\. B\\. M\\. introduced "
        "last week can lead to unexpected changes in the software business [door_slam]",
        "and new hardware such as the set of personal computers i. b. m. introduced last week can lead to "
        "unexpected changes in the software business",
    ),
    (
        "Of course there isn\\'t any guarantee the company will keep its hot hand [misc_noise]",
        "of course there isn't any guarantee the company will keep its hot hand",
    ),
    # Verbalised punctuation (WSJ0 VP): the name is what was said.
    (
        "Yields rose \\,COMMA analysts said \\.PERIOD",
        "yields rose comma analysts said period",
    ),
    (
        '\\"DOUBLE-QUOTE We\'re out --DASH for now \\"END-QUOTE \\period',
        "double quote we're out dash for now end quote period",
    ),
    ("Rates fell two %PERCENT to six .POINT five", "rates fell two percent to six point five"),
    # Disfluencies and non-speech events.
    ("the *mispronounced* word th(e)- thing ~", "the mispronounced word th thing"),
    ("<and> [<door_slam] [phone_ring/] it rang [/phone_ring] <NOISE> . now", "and it rang now"),
    ("!Mr\\. Smith's U\\.S\\. unit", "mr. smith's u.s. unit"),
]


@pytest.mark.parametrize("raw, cleaned", CLEANING)
def test_wsj_transcript_cleaning(raw, cleaned):
    assert wsj_transcripts.clean_wsj_transcript(raw) == cleaned


def test_wsj_cleaned_transcripts_phonemise():
    for _, cleaned in CLEANING:
        assert len(expected_phonemes(cleaned)) > 0


def test_read_wsj_transcripts(tmp_path):
    path = tmp_path / "4k0c0300.dot"
    path.write_text(
        "Saatchi officials said the management re:structuring (4k0c0301)\n"
        "\n"
        "[loud_breath] the th(e)- company (4K0C0302)\n"
    )
    assert wsj_transcripts.read_wsj_transcripts(path) == {
        "4k0c0301": "Saatchi officials said the management re:structuring",
        "4k0c0302": "[loud_breath] the th(e)- company",
    }
    path.write_text("a line with no id\n")
    with pytest.raises(ValueError, match=r"4k0c0300.dot, line 1: expected 'transcript \(utterance_id\)'"):
        wsj_transcripts.read_wsj_transcripts(path)


# ----------------------------------------------------------------------------------------------------
# WSJ builder

# (audio path under the manual dir, format, seconds, transcript file, raw transcript); format "wv1-01" and
# "wv1-10" are uncompressed SPHERE in either byte order, "wav" is sph2pipe output, "shorten" a .wv1 that
# must never be read (a .wav beside it is read instead).
WSJ_AUDIO = [
    ("11-1.1/wsj0/si_tr_s/011/011c0201", "wv1-01", 0.63, "11-4.1/wsj0/transcrp/dots/si_tr_s/011/011c0200.dot",
     "The company's stock \\,COMMA *rose* two %PERCENT [loud_breath] \\.PERIOD"),
    ("11-1.1/wsj0/si_tr_s/011/011c0202", "wv1-10", 0.5, "11-4.1/wsj0/transcrp/dots/si_tr_s/011/011c0200.dot",
     "Analysts said th(e)- the outlook is dim ~"),
    ("11-2.1/wsj0/si_tr_s/401/401c0201", "wv1-01", 0.4, "11-4.1/wsj0/transcrp/dots/si_tr_s/401/401c0200.dot",
     "Excluded like Kaldi"),
    ("13-1.1/wsj1/si_tr_s/46u/46uc0301", "wav", 0.82, "13-34.1/wsj1/trans/wsj1/si_tr_s/46u/46uc0300.dot",
     "<and> new hardware from I\\. B\\. M\\. [door_slam]"),
    ("13-16.1/wsj1/si_dt_20/4k0/4k0c0301", "wv1-10", 0.71,
     "13-34.1/wsj1/trans/wsj1/si_dt_20/4k0/4k0c0300.dot",
     "Saatchi officials said the management re:structuring might work"),
    ("13-16.1/wsj1/si_dt_20/4k0/4k0c0302", "wav", 0.45, "13-34.1/wsj1/trans/wsj1/si_dt_20/4k0/4k0c0300.lsn",
     "ONLY AN LSN TRANSCRIPT"),
    ("13-16.1/wsj1/si_dt_05/4k1/4k1c0101", "wv1-01", 0.3, "13-34.1/wsj1/trans/wsj1/si_dt_05/4k1/4k1c0100.dot",
     "The five k set is not dev ninety three"),
    ("11-14.1/wsj0/si_et_20/440/440c0201", "shorten", 0.56, "11-14.1/wsj0/si_et_20/440/440c0200.dot",
     "Of course there isn\\'t any guarantee [misc_noise]"),
    ("11-14.1/wsj0/si_et_20/440/440c0202", "wv1-01", 0.37, "11-14.1/wsj0/si_et_20/440/440c0200.dot",
     "Hot hand"),
]  # fmt: skip
WSJ_SPLITS = {
    "train": ["011c0201", "011c0202", "46uc0301"],
    "validation": ["4k0c0301", "4k0c0302"],
    "test": ["440c0201", "440c0202"],
}


def write_wsj(manual_dir) -> dict[str, np.ndarray]:
    """Writes the fake WSJ of `WSJ_AUDIO` under `manual_dir`; returns {utterance id: audio}."""
    audio, transcript_lines = {}, {}
    for i, (stem, kind, seconds, transcript_file, raw) in enumerate(WSJ_AUDIO):
        utterance_id = os.path.basename(stem)
        audio[utterance_id] = samples = tone(seconds, seed=i)
        path = os.path.join(manual_dir, stem)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if kind == "wav":
            write_wav(path + ".wav", samples)
        elif kind == "shorten":  # as the LDC ships it (the bytes after the header are not read)
            with open(path + ".wv1", "wb") as f:
                f.write(sphere_bytes(samples, coding="pcm,embedded-shorten-v2.00"))
            write_wav(path + ".wav", samples)
        else:
            with open(path + ".wv1", "wb") as f:
                f.write(sphere_bytes(samples, byte_format=kind[-2:]))
        with open(path + ".wv2", "wb") as f:  # the second microphone: ignored
            f.write(sphere_bytes(-samples, byte_format="01"))
        transcript_lines.setdefault(transcript_file, []).append(f"{raw} ({utterance_id})")
    for transcript_file, lines in transcript_lines.items():
        path = os.path.join(manual_dir, transcript_file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return audio


RAW_TRANSCRIPTS = {os.path.basename(stem): raw for stem, *_, raw in WSJ_AUDIO}
SECONDS = {os.path.basename(stem): seconds for stem, _, seconds, *_ in WSJ_AUDIO}


@pytest.fixture(scope="module")
def wsj(tmp_path_factory):
    root = tmp_path_factory.mktemp("wsj")
    audio = write_wsj(root / "manual")
    return prepare(corpora.LtWsj, root / "tfds", root / "manual"), audio


def test_wsj_examples(wsj):
    builder, audio = wsj
    assert set(builder.info.splits) == set(WSJ_SPLITS)
    for split, ids in WSJ_SPLITS.items():
        examples = read_split(builder, split)
        assert len(examples) == len(ids), split
        for example, utterance_id in zip(examples, ids):
            samples = audio[utterance_id]
            features_TF = example["features"]
            assert features_TF.dtype == np.float32 and features_TF.shape[1] == 80
            assert abs(features_TF.shape[0] - SECONDS[utterance_id] * 100) <= 1
            np.testing.assert_allclose(features_TF, features.log_mel(samples, RATE), rtol=1e-6, atol=1e-6)
            text = wsj_transcripts.clean_wsj_transcript(RAW_TRANSCRIPTS[utterance_id])
            assert as_str(example["text"]) == text
            np.testing.assert_array_equal(example["phonemes"], expected_phonemes(text))
            assert as_str(example["voice"]) == utterance_id[:3]
            assert example["num_samples"] == len(samples)


def test_wsj_split_folders_are_kaldis():
    assert corpora.LtWsj.SPLIT_FOLDERS == {
        "train": ("wsj0/si_tr_s", "wsj1/si_tr_s"),  # si284
        "validation": ("wsj1/si_dt_20",),  # dev93
        "test": ("wsj0/si_et_20",),  # eval92
    }


def test_wsj_refuses_shorten_without_a_wav(tmp_path):
    write_wsj(tmp_path / "manual")
    os.remove(tmp_path / "manual" / "11-14.1/wsj0/si_et_20/440/440c0201.wav")
    with pytest.raises(ValueError, match=r"440c0201.wv1 is shorten-compressed.*sph2pipe -f wav"):
        prepare(corpora.LtWsj, tmp_path / "tfds", tmp_path / "manual")


def test_wsj_missing_manual_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"manual dir .*nowhere of WSJ does not exist.*LDC93S6"):
        prepare(corpora.LtWsj, tmp_path / "tfds", tmp_path / "nowhere")


def test_wsj_missing_split_folder(tmp_path):
    write_wsj(tmp_path / "manual")
    os.rename(
        tmp_path / "manual" / "11-14.1" / "wsj0" / "si_et_20", tmp_path / "manual" / "si_et_20_elsewhere"
    )
    with pytest.raises(FileNotFoundError, match=r"split 'test' needs the folder\(s\) wsj0/si_et_20"):
        corpora.LtWsj.find_utterances(tmp_path / "manual", "test")
    assert [u.id for u in corpora.LtWsj.find_utterances(tmp_path / "manual", "train")] == WSJ_SPLITS["train"]


def test_wsj_utterances_without_transcripts_are_left_out(tmp_path):
    write_wsj(tmp_path)
    os.remove(tmp_path / "13-34.1/wsj1/trans/wsj1/si_dt_20/4k0/4k0c0300.lsn")
    assert [u.id for u in corpora.LtWsj.find_utterances(tmp_path, "validation")] == ["4k0c0301"]
    os.remove(tmp_path / "13-34.1/wsj1/trans/wsj1/si_dt_20/4k0/4k0c0300.dot")
    with pytest.raises(FileNotFoundError, match="no .wav or .wv1 file with a transcript"):
        corpora.LtWsj.find_utterances(tmp_path, "validation")


def test_a_missing_corpus_fails_before_anything_is_written(tmp_path, capfd):
    """The trainer on a LibriSpeech copy that is not there: TFDS announces no download, and
    neither its data folder nor the workdir is created."""
    config = variants.apply(speech.schema(), "smoke", speech.VARIANTS)
    config.corpus, config.data_dir, config.manual_dir = "librispeech", str(tmp_path / "tfds"), "/nonexistent"
    with pytest.raises(FileNotFoundError, match="manual dir /nonexistent of LibriSpeech does not exist"):
        tasks.train_and_evaluate(config, tmp_path / "workdir")
    assert not (tmp_path / "tfds").exists() and not (tmp_path / "workdir").exists()
    assert "Downloading" not in "".join(capfd.readouterr())
