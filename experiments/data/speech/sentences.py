"""Real English sentences available offline: the docstrings of the Python standard library.

The synthetic speech corpus needs a few thousand varied, natural sentences and no download. The standard
library's docstrings are English prose written by many authors; they are read from the `.py` sources with
`ast` (no module is imported, so nothing runs) and cleaned to sentences by these rules:

- Files: every `*.py` under `sysconfig.get_paths()["stdlib"]` in sorted path order, except those under
  `site-packages` (third-party code) and under folders named `test`, `tests` or `idle_test` (their
  docstrings describe test cases and are mostly code). Files `ast` cannot parse are skipped.
- Text: the docstrings of modules, classes and functions, in the order `ast.walk` meets them. Comments are
  not used: they are mostly fragments ("see above", "XXX ..."), not sentences.
- Paragraphs: a docstring is cut at blank lines; a paragraph holding a doctest (`>>>`), a reST directive
  or field (a line starting with `..` or `:`), or an indented line (a code block or a list's
  continuation) is dropped whole, and the lines of the others are joined with spaces.
- Sentences: a paragraph is split after `.`, `!` or `?` followed by white space and a capital letter.
- A sentence is kept when it is ASCII; starts with a capital letter and ends with `.`, `!` or `?`; has
  4..25 words; and every word is letters with at most one inner apostrophe or hyphen between letters
  (`don't`, `built-in`), optionally followed by one of `,;:` (and the final word by the end mark). So no
  digits, no brackets or quotes, no identifiers with underscores, dots or camelCase (`getLogger`), no
  URLs or paths. Words written in capitals are kept only when they are at most 4 letters (acronyms such
  as `HTTP`, which eSpeak spells out) or the sentence's first word.
- Duplicates are dropped, the first occurrence kept.

The result is deterministic for a given Python installation (its standard library decides the text).
"""

from __future__ import annotations

import ast
import collections
import functools
import os
import pathlib
import re
import sysconfig

MIN_WORDS = 4
MAX_WORDS = 25
SKIPPED_FOLDERS = frozenset({"site-packages", "test", "tests", "idle_test"})

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# A word: letters, optionally one inner apostrophe or hyphen between letters, then optional , ; or :.
_WORD = re.compile(r"[A-Za-z]+(?:['-][A-Za-z]+)?[,;:]?")
_CAMEL = re.compile(r"[a-z][A-Z]")


def stdlib_sentences() -> list[str]:
    """The cleaned, deduplicated sentences of the standard library's docstrings (see the module docstring)."""
    return list(_stdlib_sentences())


@functools.cache
def _stdlib_sentences() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for path in _source_files(pathlib.Path(sysconfig.get_paths()["stdlib"])):
        for docstring in _docstrings(path):
            for sentence in docstring_sentences(docstring):
                seen.setdefault(sentence, None)
    return tuple(seen)


def _source_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The `*.py` files under `root` outside SKIPPED_FOLDERS, sorted. The skipped folders are not
    entered: site-packages may hold far more files than the standard library."""
    found = []
    for directory, folders, names in os.walk(root):
        folders[:] = [name for name in folders if name not in SKIPPED_FOLDERS]
        found.extend(pathlib.Path(directory, name) for name in names if name.endswith(".py"))
    return sorted(found)


# The nodes that can hold statements; a module, class or function is a statement or the root.
_STATEMENT_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)


def _docstrings(path: pathlib.Path) -> list[str]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return []
    found = []
    # `ast.walk`'s breadth-first order, without entering expressions (no statement is inside
    # one): the same docstrings in the same order in under half the time.
    todo = collections.deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _STATEMENT_HOLDERS))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=True)
            if docstring:
                found.append(docstring)
    return found


def docstring_sentences(docstring: str) -> list[str]:
    """The sentences of one (cleaned, dedented) docstring that pass the rules of the module docstring."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n", docstring):
        lines = paragraph.strip("\n").split("\n")
        if any(_is_code_line(line) for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        sentences.extend(s for s in _SENTENCE_END.split(text) if is_clean_sentence(s))
    return sentences


def _is_code_line(line: str) -> bool:
    stripped = line.lstrip()
    return line[:1].isspace() or stripped.startswith((">>>", "..", ":"))


def is_clean_sentence(sentence: str) -> bool:
    """Whether `sentence` passes the rules of the module docstring (ASCII, 4..25 plain words, end mark)."""
    if not sentence.isascii() or sentence[:1] < "A" or sentence[:1] > "Z" or sentence[-1:] not in ".!?":
        return False
    words = sentence[:-1].split(" ")
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return False
    for i, word in enumerate(words):
        if not _WORD.fullmatch(word) or _CAMEL.search(word):
            return False
        letters = word.rstrip(",;:")
        if i > 0 and letters.isupper() and len(letters) > 4:
            return False
    return words[-1][-1:].isalpha()
