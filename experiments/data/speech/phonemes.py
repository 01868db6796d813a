"""The fixed phoneme inventory of the synthetic speech corpus: CTC blank first, then eSpeak's IPA phonemes.

`PHONEMES` was found empirically: every phoneme `espeak.phonemize` gives for the 6,622 sentences of
`sentences.stdlib_sentences()` (Python 3.11) under each voice of `espeak.ENGLISH_VOICES`, 91 in all,
listed from the most frequent to the least (over all voices together); then the 6 more it gives for a
larger vocabulary (the 193,697 distinct words of all the standard library's `.py` files, and a few
foreign names): "x" (loch, Bach), "ɬ" (Welsh ll), "ç", "ɑ̃" (French nasal), "nʲ", "ɪʲ" (Scottish), so
that real corpora phonemized with these voices fit too. The list is fixed, not recomputed, so that the
class ids of a trained model never change: new phonemes may only be appended. Multi-character phonemes
("aɪ", "tʃ", "iː", "ɔːɹ") are single entries, as eSpeak speaks them as one phoneme.

Rare symbols are kept as they are, not merged into a similar phoneme: the targets must be exactly what the
voice speaks. So the inventory holds accent-specific phonemes (Scottish "r", "ʉ", "ʍ"; Caribbean "t̪";
"a:" with an ASCII colon, eSpeak's own name for a Scottish phoneme it gives no IPA symbol) and a few seen
only a handful of times ("u": 16 times in 8 x 6,622 sentences). Text with a phoneme missing here (another
Python's standard library may hold new words) makes `encode` raise; the synthetic corpus builder drops
such utterances and counts them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BLANK = 0

PHONEMES: tuple[str, ...] = (
    "<blank>",
    *"""
    ɪ t n ə s d k ɹ l ɛ z m p ð f a ɒ b v aɪ ɐ ʌ iː w eɪ uː j ɔː ʃ ŋ ɡ æ ɜː ʊ eː dʒ əl r ɑː ᵻ tʃ i oʊ h θ
    əʊ oː ɔɪ ɚ ɾ ei əu ɜ aʊ ɔ ɛə ʌʊ əɪ ʉ e iə eə ɔːɹ ʉː ʌɹ ɔə aɪə aː ɑə æʊ ɑːɹ a: oə aa t̪ o ʌʉ ʒ ʍ eʲ ʊə
    n̩ ʔ ɛɹ əɹ oɪ aɪɚ ɪɹ ʉɹ ʊɹ u
    x ɬ ç ɑ̃ nʲ ɪʲ
    """.split(),
)
NUM_CLASSES = len(PHONEMES)  # the CTC output size, blank included

_IDS = {phoneme: i for i, phoneme in enumerate(PHONEMES)}
assert len(_IDS) == NUM_CLASSES, "PHONEMES holds a duplicate"


def encode(phonemes: Sequence[str]) -> np.ndarray:
    """The ids of `phonemes`: int32 [len(phonemes)], each in 1..NUM_CLASSES-1 (never the blank).

    Raises:
      ValueError: naming the first phoneme that is not in `PHONEMES` (or is the blank).
    """
    ids = []
    for phoneme in phonemes:
        i = _IDS.get(phoneme, BLANK)
        if i == BLANK:
            raise ValueError(
                f"Phoneme {phoneme!r} is not in the inventory experiments.data.speech.phonemes.PHONEMES "
                f"({NUM_CLASSES - 1} eSpeak phonemes of the English voices, plus the blank at 0)."
            )
        ids.append(i)
    return np.asarray(ids, dtype=np.int32)


def decode(ids) -> list[str]:
    """The phonemes of the ids `ids` (any integer sequence or array); blanks are kept as "<blank>".

    Raises:
      ValueError: for an id outside 0..NUM_CLASSES-1.
    """
    ids = np.asarray(ids)
    if ids.size and (ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"decode takes a 1-D sequence of integer ids, got {ids.dtype} of shape {ids.shape}.")
    bad = [int(i) for i in ids.reshape(-1) if not 0 <= i < NUM_CLASSES]
    if bad:
        raise ValueError(f"Phoneme id {bad[0]} is outside 0..{NUM_CLASSES - 1} (the size of PHONEMES).")
    return [PHONEMES[int(i)] for i in ids.reshape(-1)]
