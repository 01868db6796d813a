"""Importing `experiments` (as every entry point does first) raises the garbage collector's
youngest-generation threshold, and keeps a higher one set before (or 0: no automatic
collection). Each case in a fresh process: this one imported `experiments` long ago."""

import ast
import pathlib
import subprocess
import sys

import pytest

import experiments

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _thresholds_after_import(before: str = "") -> tuple[int, int, int]:
    script = f"import gc\n{before}\nimport experiments\nprint(gc.get_threshold())"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip())


def test_the_default_threshold_is_raised_and_the_older_generations_kept():
    # The script first checks that the process started at Python's default (700, 10, 10).
    after = _thresholds_after_import("assert gc.get_threshold() == (700, 10, 10), gc.get_threshold()")
    assert after == (experiments.YOUNGEST_GENERATION_THRESHOLD, 10, 10)


@pytest.mark.parametrize("thresholds", [(50_000, 5, 20), (0, 10, 10)])
def test_a_higher_threshold_or_none_set_before_is_kept(thresholds):
    assert _thresholds_after_import(f"gc.set_threshold{thresholds}") == thresholds
