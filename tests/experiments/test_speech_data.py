"""The offline speech corpus: eSpeak NG synthesis and phonemes, the phoneme inventory, log-mel features
(against a slow dense-DFT reference), the standard-library sentences and the `lt_synth_speech` builder."""

import ast
import math
import re
import sys

import numpy as np
import pytest

from experiments.data.speech import espeak, features, phonemes, sentences

# --- eSpeak ---------------------------------------------------------------------------------------------


def test_synthesize_gives_int16_audio_whose_length_grows_with_the_text():
    short_N = espeak.synthesize("Hello world.", "en-us+f3")
    long_N = espeak.synthesize(
        "Hello world. This sentence is quite a lot longer than the first one.", "en-us"
    )
    assert short_N.dtype == np.int16 and short_N.ndim == 1
    assert 0.4 < short_N.shape[0] / espeak.SAMPLE_RATE < 3.0  # two words at 175 words per minute
    assert np.abs(short_N.astype(np.int32)).max() > 1000  # not silence
    assert long_N.shape[0] > 2 * short_N.shape[0]


def test_synthesize_speaks_faster_at_a_higher_rate():
    text = "The quick brown fox jumps over the lazy dog."
    slow_N = espeak.synthesize(text, "en-us", rate=120)
    fast_N = espeak.synthesize(text, "en-us", rate=240)
    assert fast_N.shape[0] < 0.75 * slow_N.shape[0]


def test_synthesize_is_a_function_of_its_arguments_only():
    # eSpeak keeps state between utterances (pitch flutter, filters, random sources): without a fresh
    # library per call, the same text would come out slightly different after other speech.
    first_N = espeak.synthesize("Return the number of items.", "en-gb-x-rp+m3", rate=160, pitch=40)
    espeak.synthesize("Something else is said in between.", "en-us+f2", rate=200)
    np.testing.assert_array_equal(
        espeak.synthesize("Return the number of items.", "en-gb-x-rp+m3", rate=160, pitch=40), first_N
    )


def test_phonemize_gives_the_ipa_phonemes_of_the_voice():
    assert espeak.phonemize("the quick brown fox", "en-us") == [
        *("ð", "ə", "k", "w", "ɪ", "k", "b", "ɹ", "aʊ", "n", "f", "ɑː", "k", "s"),
    ]
    # British English says the vowel of "fox" differently: the phonemes follow the voice.
    assert espeak.phonemize("the quick brown fox", "en-gb-x-rp")[-3] == "ɒ"
    # The variant changes the sound, not the phonemes; punctuation and clauses are dropped.
    assert espeak.phonemize("Hello, world!", "en-us+m3") == espeak.phonemize("hello world", "en-us")


def test_tokens_that_espeak_runs_together_are_split_into_inventory_phonemes():
    assert espeak._split_token("ɐɐ") == ["ɐ", "ɐ"]  # doubled phonemes of spelled-out letters
    assert espeak._split_token("kdʒ") == ["k", "dʒ"]  # a separator missing within an en-us-nyc word
    assert espeak._split_token("aɪə") == ["aɪə"]  # an inventory phoneme stays whole
    assert espeak._split_token("qq") == ["qq"]  # left for `phonemes.encode` to refuse by name
    assert "x" in espeak.phonemize("the loch", "en-gb-scotland")


def test_unknown_voices_are_a_clear_error():
    for voice in ("xx-nowhere", "en-us+nobody", ""):
        with pytest.raises(ValueError, match=re.escape(repr(voice)) + ".*en-us"):
            espeak.synthesize("Hello.", voice)
    with pytest.raises(ValueError, match="xx-nowhere"):
        espeak.phonemize("Hello.", "xx-nowhere")
    assert espeak.phonemize("Hello.", "en-us")  # the engine still works after the errors


def test_every_listed_voice_and_variant_exists():
    for voice in espeak.ENGLISH_VOICES:
        assert espeak.phonemize("Hello.", voice)
    for variant in espeak.VARIANTS:
        assert espeak.synthesize("Hi.", f"en+{variant}").size > 0


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)  # makes `import espeakng_loader` fail
    with pytest.raises(ImportError, match="pip install espeakng-loader"):
        espeak._Engine()


# --- Phoneme inventory ----------------------------------------------------------------------------------


def test_encode_decode_round_trip():
    sequence = espeak.phonemize("Return the value of the attribute.", "en-gb-scotland")
    ids_L = phonemes.encode(sequence)
    assert ids_L.dtype == np.int32 and ids_L.shape == (len(sequence),)
    assert (ids_L != phonemes.BLANK).all()
    assert phonemes.decode(ids_L) == sequence
    assert phonemes.decode([phonemes.BLANK]) == ["<blank>"] and phonemes.PHONEMES[0] == "<blank>"
    assert len(set(phonemes.PHONEMES)) == len(phonemes.PHONEMES)


def test_unknown_phonemes_and_ids_are_errors():
    with pytest.raises(ValueError, match="'q'.*PHONEMES"):
        phonemes.encode(["t", "q"])
    with pytest.raises(ValueError, match="<blank>"):
        phonemes.encode(["<blank>"])
    with pytest.raises(ValueError, match=str(len(phonemes.PHONEMES))):
        phonemes.decode([1, len(phonemes.PHONEMES)])


def test_the_inventory_covers_every_voice_on_stdlib_sentences():
    texts = sentences.stdlib_sentences()[::20]  # about 330 sentences
    seen = set()
    for voice in espeak.ENGLISH_VOICES:
        for text in texts:
            sequence = espeak.phonemize(text, voice)
            phonemes.encode(sequence)  # raises on a phoneme outside the inventory
            seen.update(sequence)
    assert len(seen) > 60  # the accents' phonemes, not just a handful


# --- Features -------------------------------------------------------------------------------------------


def _slaney_mel(hz: float) -> float:
    return 3.0 * hz / 200.0 if hz < 1000.0 else 15.0 + 27.0 * math.log(hz / 1000.0) / math.log(6.4)


def _slaney_hz(mel: float) -> float:
    return 200.0 * mel / 3.0 if mel < 15.0 else 1000.0 * 6.4 ** ((mel - 15.0) / 27.0)


def _reference_filterbank(sample_rate, n_fft, num_mels, fmin, fmax):
    low, high = _slaney_mel(fmin), _slaney_mel(fmax)
    points = [_slaney_hz(low + j * (high - low) / (num_mels + 1)) for j in range(num_mels + 2)]
    weights = np.zeros((num_mels, n_fft // 2 + 1))
    for m in range(num_mels):
        lower, centre, upper = points[m : m + 3]
        for k in range(n_fft // 2 + 1):
            hz = k * sample_rate / n_fft
            if lower <= hz <= centre:
                weights[m, k] = (hz - lower) / (centre - lower)
            elif centre < hz <= upper:
                weights[m, k] = (upper - hz) / (upper - centre)
            weights[m, k] *= 2.0 / (upper - lower)
    return weights


def _reference_log_mel(audio_N, sample_rate, num_mels=80):
    """Slow and plain: frame by frame, a dense DFT matrix, float64."""
    x = audio_N.astype(np.float64) / (32768.0 if audio_N.dtype == np.int16 else 1.0)
    window = round(0.025 * sample_rate)
    n_fft = 2 ** math.ceil(math.log2(window))
    n = np.arange(window)
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * n / window)
    dft = np.exp(-2j * np.pi * np.outer(np.arange(n_fft // 2 + 1), n) / n_fft)  # [K, window]
    filters = _reference_filterbank(sample_rate, n_fft, num_mels, 20.0, min(8000.0, sample_rate / 2))
    rows = []
    for i in range(math.ceil(len(x) * 100 / sample_rate)):
        start = (i * sample_rate) // 100
        frame = np.array([x[start + j] if start + j < len(x) else 0.0 for j in range(window)])
        power = np.abs(dft @ (frame * hann)) ** 2
        rows.append(np.log(filters @ power + 1e-6))
    return np.array(rows)


@pytest.mark.parametrize("sample_rate", [16000, 22050])
def test_log_mel_matches_a_slow_reference(sample_rate):
    rng = np.random.default_rng(sample_rate)
    audio_N = (rng.standard_normal(int(0.31 * sample_rate)) * 0.1).astype(np.float32)
    audio_N[: sample_rate // 20] = 0.0  # a silent start: the log floor
    got_TF = features.log_mel(audio_N, sample_rate)
    want_TF = _reference_log_mel(audio_N, sample_rate)
    assert got_TF.dtype == np.float32 and got_TF.shape == want_TF.shape == (31, 80)
    np.testing.assert_allclose(got_TF, want_TF, rtol=1e-4, atol=2e-3)
    np.testing.assert_allclose(
        features.mel_filterbank(sample_rate, 1024, 80, 20.0, min(8000.0, sample_rate / 2)),
        _reference_filterbank(sample_rate, 1024, 80, 20.0, min(8000.0, sample_rate / 2)),
        rtol=1e-9,
        atol=1e-12,
    )


def test_int16_audio_is_scaled_by_one_over_32768():
    audio_N = np.random.default_rng(0).integers(-20000, 20000, 4000).astype(np.int16)
    np.testing.assert_allclose(
        features.log_mel(audio_N, 16000), features.log_mel(audio_N / 32768.0, 16000), rtol=1e-5, atol=1e-4
    )
    np.testing.assert_allclose(
        features.log_mel(audio_N, 16000), _reference_log_mel(audio_N, 16000), atol=2e-3
    )


@pytest.mark.parametrize("sample_rate", [8000, 16000, 22050, 44100])
def test_exactly_100_frames_per_second_of_audio(sample_rate):
    assert features.log_mel(np.zeros(sample_rate, np.float32), sample_rate).shape == (100, 80)
    # One sample more starts a 101st frame (zero-padded past the end); none gives no frame.
    assert features.log_mel(np.zeros(sample_rate + 1, np.float32), sample_rate).shape == (101, 80)
    assert features.log_mel(np.zeros(0, np.int16), sample_rate).shape == (0, 80)
    assert features.log_mel(np.zeros(3 * sample_rate // 2, np.float32), sample_rate, num_mels=40).shape == (
        150,
        40,
    )


@pytest.mark.parametrize("sample_rate", [16000, 22050])
@pytest.mark.parametrize("hz", [150.0, 440.0, 1234.0, 3000.0, 6500.0])
def test_a_sine_puts_its_energy_in_the_band_of_its_frequency(sample_rate, hz):
    t = np.arange(sample_rate // 2) / sample_rate
    features_TF = features.log_mel(0.5 * np.sin(2 * np.pi * hz * t), sample_rate)
    n_fft = features.fft_size(sample_rate)
    filters_MK = features.mel_filterbank(sample_rate, n_fft, 80, 20.0, min(8000.0, sample_rate / 2))
    band = int(np.argmax(filters_MK[:, round(hz * n_fft / sample_rate)]))  # the filter peaking nearest hz
    loudest_T = np.argmax(features_TF[5:-5], axis=1)
    assert np.all(np.abs(loudest_T - band) <= 1), (band, loudest_T)


@pytest.mark.parametrize("sample_rate", [16000, 22050])
def test_mel_filters_peak_at_increasing_frequencies(sample_rate):
    n_fft = features.fft_size(sample_rate)
    filters_MK = features.mel_filterbank(sample_rate, n_fft, 80, 20.0, min(8000.0, sample_rate / 2))
    assert filters_MK.shape == (80, n_fft // 2 + 1) and (filters_MK >= 0).all()
    assert np.all(np.diff(np.argmax(filters_MK, axis=1)) > 0)  # every filter reaches a bin of its own
    peak_hz = np.argmax(filters_MK, axis=1) * sample_rate / n_fft
    assert peak_hz[0] < 100 and 7000 < peak_hz[-1] < 8000
    assert (filters_MK[:, round(8100 * n_fft / sample_rate) :] == 0).all()  # nothing above 8 kHz


def test_bad_audio_is_a_clear_error():
    with pytest.raises(ValueError, match="int32"):
        features.log_mel(np.zeros(100, np.int32), 16000)
    with pytest.raises(ValueError, match=r"\(2, 100\)"):
        features.log_mel(np.zeros((2, 100), np.float32), 16000)
    with pytest.raises(ValueError, match="fmax"):
        features.mel_filterbank(16000, 512, 80, 20.0, 9000.0)


def test_normalise_utterance_gives_mean_0_std_1_per_bin():
    rng = np.random.default_rng(1)
    features_TF = rng.normal(5.0, 3.0, (50, 4)) * np.array([1.0, 10.0, 0.1, 0.0]) - 13.8
    normalised_TF = features.normalise_utterance(features_TF)
    assert normalised_TF.dtype == np.float32 and normalised_TF.shape == (50, 4)
    np.testing.assert_allclose(normalised_TF.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(normalised_TF[:, :3].std(axis=0), 1.0, rtol=1e-5)
    assert np.all(normalised_TF[:, 3] == 0.0)  # the constant bin: finite, zero


def test_stack_frames_concatenates_k_frames_and_pads_the_tail():
    features_TF = np.arange(30, dtype=np.float32).reshape(10, 3) + 1
    stacked = features.stack_frames(features_TF, 4)
    assert stacked.shape == (3, 12) and stacked.dtype == np.float32
    np.testing.assert_array_equal(stacked[0], features_TF[0:4].reshape(-1))
    np.testing.assert_array_equal(stacked[2], np.concatenate([features_TF[8:10].reshape(-1), np.zeros(6)]))
    assert features.stack_frames(features_TF, 5).shape == (2, 15)
    assert features.stack_frames(features_TF, 1).shape == (10, 3)


# --- Sentences ------------------------------------------------------------------------------------------


def test_stdlib_sentences_are_many_clean_and_deterministic():
    texts = sentences.stdlib_sentences()
    assert len(texts) > 3000
    assert len(set(texts)) == len(texts)
    for text in texts:
        assert re.fullmatch(r"[A-Z][A-Za-z ,;:'-]*[A-Za-z][.!?]", text), text
        assert 4 <= len(text.split()) <= 25, text
        assert "  " not in text and "--" not in text
    sentences._stdlib_sentences.cache_clear()
    assert sentences.stdlib_sentences() == texts


NESTED_DEFINITIONS = '''
"""Module."""
import os

@decorator(lambda: None)
class Outer:
    """Outer."""
    def method(self):
        """Method."""
        def inner():
            """Inner."""
    class Nested:
        """Nested."""

if os.name:
    def in_if():
        """In if."""
else:
    async def in_else():
        """In else."""

try:
    def in_try():
        """In try."""
except ValueError:
    class InHandler:
        """In handler."""
finally:
    def in_finally():
        """In finally."""

match os.name:
    case "posix" if True:
        def in_case():
            """In case."""

for _ in ():
    with open(os.devnull):
        while False:
            def deep():
                """Deep."""
'''


def test_docstrings_are_those_ast_walk_meets_in_its_order(tmp_path):
    path = tmp_path / "nested.py"
    path.write_text(NESTED_DEFINITIONS)
    definitions = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    tree = ast.parse(NESTED_DEFINITIONS)
    want = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, definitions)]
    assert len(want) == 12 and sentences._docstrings(path) == want


def test_source_files_are_the_sorted_python_files_outside_the_skipped_folders(tmp_path):
    for name in [
        "b.py",
        "a/z.py",
        "a/b/c.py",
        "a/notes.txt",
        "a/test/t.py",
        "tests/t.py",
        "x/site-packages/pkg/m.py",
        "x/idle_test/i.py",
        "x/testing/k.py",
        "x/test_case.py",
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    want = [
        p
        for p in sorted(tmp_path.rglob("*.py"))
        if not sentences.SKIPPED_FOLDERS.intersection(p.relative_to(tmp_path).parts)
    ]
    assert [p.relative_to(tmp_path).as_posix() for p in want] == [
        "a/b/c.py",
        "a/z.py",
        "b.py",
        "x/test_case.py",
        "x/testing/k.py",
    ]
    assert sentences._source_files(tmp_path) == want


def test_the_cleaning_rules_reject_code_and_keep_prose():
    keep = ["Return the number of items in the queue.", "It's a built-in function, isn't it?"]
    reject = [
        "Use os.path.join to build paths.",  # a dotted name
        "Call get_value when the lock is held.",  # an underscore
        "See https://python.org for the details.",  # a URL
        "Return the getLogger result for a name.",  # camelCase
        "Return the value of x[0] here.",  # brackets
        "There are 3 items in the queue.",  # a digit
        "Too short here.",  # three words
        "the sentence starts in lower case.",
        "A sentence without an end mark",
    ]
    assert all(sentences.is_clean_sentence(s) for s in keep)
    assert not any(sentences.is_clean_sentence(s) for s in reject)
    docstring = (
        "Summary line here is fine.\n\n>>> Example code is here.\n\nAnother good sentence follows now."
    )
    assert sentences.docstring_sentences(docstring) == [
        "Summary line here is fine.",
        "Another good sentence follows now.",
    ]


# --- The builder ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from experiments.data.speech.synthetic import LtSynthSpeech

    builder = LtSynthSpeech(
        config="smoke", data_dir=tmp_path_factory.mktemp("speech"), file_format="array_record"
    )
    builder.download_and_prepare()
    return {split: builder.as_data_source(split) for split in ("train", "validation", "test")}


def test_the_smoke_build_has_disjoint_splits_by_sentence(smoke):
    from experiments.data.speech.synthetic import sentence_split

    texts = {split: [ds[i]["text"].decode() for i in range(len(ds))] for split, ds in smoke.items()}
    assert {split: len(t) for split, t in texts.items()} == {"train": 24, "validation": 8, "test": 8}
    for split, split_texts in texts.items():
        assert all(sentence_split(text) == split for text in split_texts)
    assert len(set().union(*texts.values())) == 40


def test_smoke_examples_are_consistent(smoke):
    num_phonemes, num_samples = [], []
    for ds in smoke.values():
        for i in range(len(ds)):
            example = ds[i]
            text, voice = example["text"].decode(), example["voice"].decode()
            features_TF = example["features"]
            assert features_TF.dtype == np.float32 and features_TF.shape[1:] == (80,)
            assert np.isfinite(features_TF).all() and features_TF.std() > 1.0  # speech, not silence
            assert voice.split("+")[0] in ("en-us", "en-gb-x-rp") and voice.split("+")[1] in espeak.VARIANTS
            np.testing.assert_array_equal(example["phonemes"], phonemes.encode(espeak.phonemize(text, voice)))
            assert abs(features_TF.shape[0] - example["num_samples"] / espeak.SAMPLE_RATE * 100) <= 1
            assert 140 <= example["rate"] <= 200 and 30 <= example["pitch"] <= 70
            assert 20 <= example["snr_db"] <= 40
            num_phonemes.append(len(example["phonemes"]))
            num_samples.append(example["num_samples"])
    assert len(set(ds[i]["voice"] for ds in smoke.values() for i in range(len(ds)))) > 5  # drawn at random
    assert np.corrcoef(num_phonemes, num_samples)[0, 1] > 0.7


def test_the_build_is_deterministic(smoke):
    from experiments.data.speech.synthetic import LtSynthSpeech, _render, split_sentences

    config = LtSynthSpeech.builder_configs["smoke"]
    chosen = split_sentences(config)
    for split, ds in smoke.items():  # examples in key order: the order of the sentences
        assert [ds[i]["text"].decode() for i in range(len(ds))] == [text for _, text in chosen[split]]
    # Rendering an example again, after other speech, gives the stored one exactly.
    key, text = chosen["validation"][3]
    _, again, _ = _render((key, text, config))
    stored = smoke["validation"][3]
    np.testing.assert_array_equal(again["features"], stored["features"])
    assert again["voice"] == stored["voice"].decode() and again["num_samples"] == stored["num_samples"]
    # Another key draws another voice, rate or pitch for the same sentence.
    _, other, _ = _render((key + 1, text, config))
    assert (other["voice"], other["rate"], other["pitch"]) != (again["voice"], again["rate"], again["pitch"])
