"""The MQAR task (experiments/tasks/mqar.py): its sequences, its scoring, and a run through the
one trainer on a tiny config."""

import math

import numpy as np
import pytest

from configs import mqar as mqar_config
from experiments import tasks
from experiments.tasks import mqar


def test_each_key_is_stated_once_then_queried_once_for_its_value():
    inputs, targets = mqar.mqar_batch(np.random.default_rng(0), 32, 20, 5, 16)
    assert inputs.shape == targets.shape == (32, 20) and inputs.dtype == np.int32
    for row_in, row_t in zip(inputs, targets):
        keys, values = row_in[0:10:2], row_in[1:10:2]
        assert len(set(keys)) == 5 and keys.min() >= 1 and keys.max() < 8 and values.min() >= 8
        assert (row_t[:10] == -1).all()
        queried = np.nonzero(row_t >= 0)[0]
        assert len(queried) == 5 and sorted(row_in[queried]) == sorted(keys)
        answers = dict(zip(keys, values))
        assert all(row_t[p] == answers[row_in[p]] for p in queried)
        others = np.setdiff1d(np.arange(10, 20), queried)
        assert (row_in[others] == 0).all()


def test_a_tiny_run_reports_recall_over_the_queries(tmp_path):
    config = mqar_config.get_config(
        "attention=gated-deltanet,num_steps=2,batch_size=4,eval_batch_size=8,seq_len=16,num_kv_pairs=4,"
        "vocab_size=32,model_dim=16,feed_forward_dim=16,progress_bar=false"
    )
    result = tasks.train_and_evaluate(config, tmp_path)
    assert result["step"] == 2 and math.isfinite(result["eval_loss"])
    assert 0 <= result["recall_accuracy"] <= 1


@pytest.mark.parametrize(
    "arg, match",
    [
        ("num_kv_pairs=40,vocab_size=64", r"num_kv_pairs=40 needs as many distinct keys .* at most 31"),
        ("seq_len=40", r"seq_len=40 must hold the 16 pairs .* at least 3 \* num_kv_pairs = 48"),
        ("num_kv_pairs=0", r"^config.num_kv_pairs must be >= 1, got 0.$"),
    ],
)
def test_bad_mqar_configs_are_named(tmp_path, arg, match):
    with pytest.raises(ValueError, match=match):
        tasks.train_and_evaluate(mqar_config.get_config(arg), tmp_path)


def test_the_comparison_trains_each_kind_and_n_then_tabulates_recall(tmp_path):
    """One kind x two n, two steps each: one row per run with its held-out recall, the table by
    kind, the files; a second call reads the finished runs back instead of training again."""
    from experiments.benchmarking import mqar_bench

    options = mqar_bench.MqarComparisonOptions(
        kinds=("linear",),
        num_kv_pairs=(2, 3),
        overrides="num_steps=2,batch_size=4,eval_batch_size=8,seq_len=12,vocab_size=32,model_dim=16,"
        "feed_forward_dim=16,progress_bar=false",
    )
    lines = []
    result = mqar_bench.run_and_report(options, tmp_path, log=lines.append)
    assert [(r["kind"], r["num_kv_pairs"], r["steps"]) for r in result["rows"]] == [
        ("linear", 2, 2),
        ("linear", 3, 2),
    ]
    assert all(0 <= r["recall_accuracy"] <= 1 for r in result["rows"])
    assert {"csv", "recall_csv", "json", "png"} <= set(result["files"])
    assert any("| kind | n=2 | n=3 |" in line for line in lines)
    again = mqar_bench.run_and_report(options, tmp_path, log=lambda line: None)
    assert again["rows"] == result["rows"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kinds=("flash",)), r"unknown attention kinds \['flash'\]"),
        (dict(num_kv_pairs=(50,)), r"seq_len=128 must hold the 50 pairs"),
    ],
)
def test_bad_comparison_options_are_named(kwargs, match):
    from experiments.benchmarking import mqar_bench

    with pytest.raises(ValueError, match=match):
        mqar_bench.MqarComparisonOptions(**kwargs)
