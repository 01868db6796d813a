"""eSpeak NG through ctypes: speech audio and the phonemes it speaks, from the `espeakng-loader` wheel.

The wheel bundles the shared library and its data (voices, dictionaries), so no system package is needed.
The library runs in synchronous mode (audio is handed to a callback, no audio device). It keeps global
state (the current voice and parameters), so every call holds one process-wide lock; and its wave
generator carries state from one utterance to the next, so `synthesize` unloads and reloads the library
first (about 2 ms) to make its audio a function of its arguments alone. A voice is a language voice,
optionally with a variant: `"en-us"`, `"en-us+f3"`.

`phonemize(text, voice)` asks the same library, with the same voice, for the phonemes it speaks for `text`
(IPA, one phoneme per token, thanks to a separator character), so the targets of the synthetic corpus are
exact by construction. The variant (`+f3`) only changes the sound (pitch, formants), never the phonemes.
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import os
import threading

import numpy as np

from experiments.data.speech.phonemes import PHONEMES

SAMPLE_RATE = 22050  # what espeak_Initialize reports for synchronous output

# The English language voices of the wheel's data (lang/gmw/en*), by the names espeak accepts. Left out:
# "en-shaw" (the Shavian alphabet, for text written in it).
ENGLISH_VOICES: tuple[str, ...] = (
    "en-us",  # General American
    "en-us-nyc",  # New York City
    "en",  # British English (the default `en`)
    "en-gb-x-rp",  # Received Pronunciation
    "en-gb-scotland",  # Scottish
    "en-gb-x-gbclan",  # Lancaster
    "en-gb-x-gbcwmd",  # West Midlands
    "en-029",  # Caribbean
)
# The voice variants of the wheel's data (voices/!v) that are plain male or female speakers; the others
# there are named characters or effects (whisper, croak, robot, ...). Spoken as "en-us+f3".
VARIANTS: tuple[str, ...] = (
    *(f"m{i}" for i in range(1, 9)),
    *(f"f{i}" for i in range(1, 6)),
)

_AUDIO_OUTPUT_SYNCHRONOUS = 0x02
_ESPEAK_CHARS_UTF8 = 0x01
_ESPEAK_RATE = 1  # words per minute, 80..450
_ESPEAK_PITCH = 3  # 0..100, 50 normal
_PHONEMES_IPA = 0x02
_SEPARATOR = "_"  # between the phonemes of a word, so they tokenise exactly (bits 8..23 of phonememode)
_INVENTORY = frozenset(PHONEMES[1:])
_RANDOM_SEED = 0

_LOCK = threading.RLock()


def _new_lock_in_child() -> None:
    """A child forked while another thread held the lock would wait for ever on it: it gets a fresh one."""
    global _LOCK
    _LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_in_child)
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class _Engine:
    """The loaded library, its data path and the callback collecting audio chunks (kept referenced)."""

    def __init__(self):
        try:
            import espeakng_loader
        except ImportError as e:
            raise ImportError(
                "Speech synthesis needs eSpeak NG from the `espeakng-loader` wheel: "
                "`pip install espeakng-loader` (or the `experiments` extra: `pip install -e .[experiments]`)."
            ) from e
        self.data_path = espeakng_loader.get_data_path()
        self.library_path = espeakng_loader.get_library_path()
        self.libc = ctypes.CDLL(None)
        self.chunks: list[np.ndarray] = []
        self.callback = _SYNTH_CALLBACK(self._collect)
        self.variants = frozenset(os.listdir(os.path.join(self.data_path, "voices", "!v")))
        self.lib = None
        self.load()

    def load(self) -> None:
        """Loads and initialises a fresh instance of the library, unloading the current one first.

        eSpeak's wave generator keeps state from one utterance to the next (pitch flutter phase, filter
        memories, its random generators): the same call gives slightly different audio, even a few samples
        more or less, depending on what was spoken before. Unloading the library (`dlclose`) and loading it
        again resets all of it, so `synthesize` is a pure function of its arguments (this needs no other
        code in the process to hold the library open, which would keep it loaded).
        """
        if self.lib is not None:
            self.lib.espeak_Terminate()
            _ctypes.dlclose(self.lib._handle)
            self.lib = None
        lib = ctypes.CDLL(self.library_path)
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, self.data_path.encode(), 0)
        if rate != SAMPLE_RATE:
            raise RuntimeError(
                f"espeak_Initialize returned {rate}; expected the sample rate {SAMPLE_RATE} "
                f"(library {self.library_path}, data {self.data_path})."
            )
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_SetSynthCallback(self.callback)
        # Breath and noise sources draw from eSpeak's own generator and from libc's rand().
        lib.espeak_ng_SetRandSeed(ctypes.c_long(_RANDOM_SEED))
        self.libc.srand(_RANDOM_SEED)
        self.lib = lib
        self.voice: str | None = None

    def _collect(self, wav, num_samples, events):
        if num_samples > 0:
            self.chunks.append(np.ctypeslib.as_array(wav, (num_samples,)).copy())
        return 0  # continue synthesis

    def set_voice(self, voice: str) -> None:
        if voice == self.voice:
            return
        language, _, variant = voice.partition("+")
        known_variant = not variant or variant in self.variants
        # espeak ignores an unknown variant silently, hence the check of our own.
        if not language or not known_variant or self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            self.voice = None
            raise ValueError(
                f"Unknown eSpeak voice {voice!r}: a language voice such as one of {ENGLISH_VOICES}, "
                f"optionally with a variant '+v', v one of {VARIANTS} (or the others in "
                f"{os.path.join(self.data_path, 'voices', '!v')})."
            )
        self.voice = voice


@functools.cache
def _engine() -> _Engine:
    return _Engine()


def synthesize(text: str, voice: str, *, rate: int = 175, pitch: int = 50) -> np.ndarray:
    """Speaks `text` with `voice` (e.g. "en-us+f3") at `rate` words per minute and `pitch` (0..100).

    Returns int16 [num_samples] audio at `SAMPLE_RATE` Hz (empty for text with nothing to say), the same
    for the same arguments whatever was synthesised before (see `_Engine.load`; about 2 ms more per call).
    """
    if not 80 <= rate <= 450:
        raise ValueError(f"rate={rate} words per minute is outside eSpeak's range 80..450.")
    if not 0 <= pitch <= 100:
        raise ValueError(f"pitch={pitch} is outside eSpeak's range 0..100.")
    with _LOCK:
        engine = _engine()
        engine.load()  # a fresh library: the audio depends on the arguments only
        engine.set_voice(voice)
        engine.lib.espeak_SetParameter(_ESPEAK_RATE, int(rate), 0)
        engine.lib.espeak_SetParameter(_ESPEAK_PITCH, int(pitch), 0)
        engine.chunks = []
        buffer = ctypes.create_string_buffer(text.encode())
        error = engine.lib.espeak_Synth(buffer, len(buffer), 0, 0, 0, _ESPEAK_CHARS_UTF8, None, None)
        engine.lib.espeak_Synchronize()
        chunks, engine.chunks = engine.chunks, []
    if error != 0:
        raise RuntimeError(f"espeak_Synth failed with error {error} for {text!r} in voice {voice!r}.")
    return np.concatenate(chunks) if chunks else np.zeros([0], np.int16)


def phonemize(text: str, voice: str = "en-us") -> list[str]:
    """The phonemes `voice` speaks for `text`, in IPA, one list entry per phoneme.

    Stress marks and word and clause boundaries are dropped; multi-character phonemes ("aɪ", "tʃ", "iː")
    are single entries. These are the phonemes of `phonemes.PHONEMES` for the voices of `ENGLISH_VOICES`
    (on English text: other words may give others, which `phonemes.encode` refuses by name).
    """
    with _LOCK:
        engine = _engine()
        engine.set_voice(voice)
        mode = (ord(_SEPARATOR) << 8) | _PHONEMES_IPA
        pointer = ctypes.c_char_p(text.encode())
        clauses = []
        # Each call converts one clause and advances `pointer` past it (to NULL at the end).
        while pointer.value:
            clauses.append(engine.lib.espeak_TextToPhonemes(ctypes.byref(pointer), _ESPEAK_CHARS_UTF8, mode))
    found = []
    for clause in clauses:
        for word in clause.decode().split():
            for token in word.split(_SEPARATOR):
                found.extend(_split_token(token.replace("ˈ", "").replace("ˌ", "")))
    return found


def _split_token(token: str) -> list[str]:
    """`token` as phonemes of the inventory: itself if it is one (or cannot be split), else split greedily.

    eSpeak leaves the separator out in a few places: between the doubled phonemes of spelled-out letters
    ("ɐɐ", "ææ") and within some en-us-nyc words ("nt", "kdʒ"). Such a token is split into the longest
    inventory phonemes from the left; a token that does not split is returned whole (`encode` names it).
    """
    if not token or token in _INVENTORY:
        return [token] if token else []
    pieces, start = [], 0
    while start < len(token):
        end = next((e for e in range(len(token), start, -1) if token[start:e] in _INVENTORY), None)
        if end is None:
            return [token]
        pieces.append(token[start:end])
        start = end
    return pieces
