"""WSJ transcripts: reading the LDC's .dot / .lsn files and cleaning their markup to the words
that were said (`read_wsj_transcripts`, `clean_wsj_transcript`)."""

from __future__ import annotations

import os
import re

# Verbalised punctuation (WSJ0's "VP" prompts): the punctuation mark the speaker named, then its name,
# e.g. ",COMMA", ".PERIOD", "\"DOUBLE-QUOTE", "--DASH", "-HYPHEN", "%PERCENT", "(LEFT-PAREN".
_VERBALISED_PUNCTUATION = re.compile(r"^[^\w\s'<*\[~]+([A-Za-z][A-Za-z-]*)$")
_KALDI_MARKERS = {"noise", "spoken_noise", "unk", "sil", "silence", "vocalized-noise"}


def _clean_wsj_word(word: str) -> str:
    """One whitespace-separated token of a WSJ transcript, cleaned (see `clean_wsj_transcript`)."""
    word = word.replace("\\", "")
    if "[" in word or "]" in word or word in ("~", "."):
        return ""
    if word.startswith("<") and word.endswith(">"):
        inner = word[1:-1]
        return "" if inner.lower() in _KALDI_MARKERS else inner
    punctuation = _VERBALISED_PUNCTUATION.match(word)
    if punctuation:
        return punctuation.group(1).replace("-", " ")
    word = re.sub(r"\([^)]*\)", "", word)  # the unspoken part of a word fragment: "th(e)-"
    word = re.sub(r"[^\w'.\-]", "", word)  # marks: "*" mispronounced, ":" lengthened, "!" stressed, "~"
    return word.strip("-")


def clean_wsj_transcript(transcript: str) -> str:
    """The words spoken in a WSJ `.dot` (or `.lsn`) transcript, lower case, for eSpeak to phonemise.

    Rules, after the CSR `.dot` specification (LDC93S6 `dot_spec.doc`) and Kaldi's `wsj/s5` normalisation,
    applied to each whitespace-separated token:

    - Backslashes, the escape character of the `.dot` files ("I\\. B\\. M\\.", "\\,COMMA"), are removed.
    - Non-speech events in square brackets are dropped: "[loud_breath]", "[<door_slam]", "[door_slam>]",
      "[/phone_ring]", "[phone_ring/]" (eSpeak has no phoneme for them).
    - "~" (a truncated utterance) and a lone "." (a pause) are dropped.
    - "<word>" keeps the word: the speaker said it (a verbal deletion, in Kaldi's reading); the noise
      markers of Kaldi-normalised text ("<NOISE>", "<SPOKEN_NOISE>", "<UNK>") are dropped.
    - Verbalised punctuation, a mark followed by its name (",COMMA", ".PERIOD", "\\"DOUBLE-QUOTE",
      "--DASH", "%PERCENT", ".POINT"), becomes the name the speaker said: "comma", "double quote".
    - Word fragments: the unspoken part in parentheses and the hyphen marking the cut are removed
      ("th(e)-" -> "th").
    - Remaining marks inside words are removed: "*" around mispronounced words ("*word*" -> "word"),
      ":" of lengthened sounds ("re:structuring"), "!" of stressed words; letters, digits, apostrophes,
      periods (abbreviations: "mr.", "u.s.") and inner hyphens are kept.

    Everything is lower-cased (eSpeak spells out upper-case words) and whitespace is collapsed.
    """
    words = (_clean_wsj_word(word) for word in transcript.split())
    return " ".join(" ".join(words).lower().split())


_DOT_LINE = re.compile(r"^(.*?)\s*\((\w+)\)\s*$")


def read_wsj_transcripts(path: os.PathLike | str) -> dict[str, str]:
    """The lines "transcript (utterance_id)" of a WSJ `.dot` or `.lsn` file, as {id (lower case): transcript}.

    Raises:
      ValueError: naming the file and the line without a trailing "(utterance_id)".
    """
    transcripts = {}
    with open(path, encoding="latin-1") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            match = _DOT_LINE.match(line.strip())
            if not match:
                raise ValueError(
                    f"{path}, line {number}: expected 'transcript (utterance_id)', got {line.strip()!r}."
                )
            transcripts[match.group(2).lower()] = match.group(1)
    return transcripts
