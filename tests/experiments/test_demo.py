"""The demo task (experiments/tasks/progressions.py) through the one trainer, on a tiny config."""

import json

import numpy as np
import pytest

from configs import demo as demo_config
from experiments import tasks
from experiments.tasks import progressions


def test_demo_trains_and_continues_progressions_recurrently(tmp_path):
    config = demo_config.get_config("num_steps=400,eval_batch_size=32,progress_bar=false")
    result = tasks.train_and_evaluate(config, tmp_path)
    assert result["step"] == 400 and (tmp_path / "config.json").exists()
    assert result["loss"] < 0.8  # ln(16) = 2.77 at chance
    assert result["continuation_accuracy"] > 0.6  # chance is 1/16
    assert result["parallel_vs_recurrent_max_abs_diff"] < 1e-4
    assert json.loads((tmp_path / "config.json").read_text())["task"] == "progressions"


def test_progressions_are_arithmetic_mod_vocab():
    tokens = progressions.progressions(np.random.default_rng(0), 64, 10, 7)
    steps = (tokens[:, 1:] - tokens[:, :-1]) % 7
    assert np.all(steps == steps[:, :1]) and np.all(steps[:, 0] != 0)
    inputs, targets = progressions.next_token_pairs(tokens)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])


@pytest.mark.parametrize(
    "arg, match",
    [
        ("prompt_len=24", "prompt_len must be in"),
        ("seq_len=1", "seq_len"),
        ("vocab_size=0", r"^config.vocab_size must be >= 1, got 0.$"),
        ("eval_batch_size=0", r"^config.eval_batch_size must be >= 1, got 0.$"),
    ],
)
def test_bad_demo_configs_are_named(tmp_path, arg, match):
    with pytest.raises(ValueError, match=match):
        tasks.train_and_evaluate(demo_config.get_config(arg), tmp_path)
