"""The benchmark library and both benchmark scripts, at tiny sizes (figures are not asserted:
speed lives in BENCHMARKS.md, not in unit tests)."""

import csv
import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarking import attention_bench, generation_bench, measure, report
from linear_transformers import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_time_compiled_repeats_and_reports_the_median():
    compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((64, 64))).compile()
    timing = measure.time_compiled(compiled, jnp.ones((64, 64)), min_repeats=5, min_seconds=0.0)
    assert timing.repeats == 5
    assert 0 < timing.min_s <= timing.median_s
    with pytest.raises(ValueError, match="min_repeats"):
        measure.time_compiled(compiled, jnp.ones((64, 64)), min_repeats=0)


def test_peak_bytes_counts_temporaries():
    # softmax over N keys materialises [N, N] weights: 4x the length, ~16x the bytes.
    def peak(n):
        spec = jax.ShapeDtypeStruct((1, n, 1, 8), jnp.float32)
        fn = attention_bench.attention_fn("softmax", 64)
        compiled = jax.jit(fn).lower(spec, spec, spec).compile()
        return measure.peak_bytes(compiled)

    small, large = peak(256), peak(1024)
    assert large > 4 * 1024 * 1024 * 4 / 2  # at least half of one [1024, 1024] float32 matrix
    assert large / small > 8
    assert measure.memory_budget_bytes(fraction=0.5) > 0


def test_attention_cases_agree_with_each_other():
    # Every causal kind computes the same function; the benchmark must time the right thing.
    q, k, v, _ = attention_bench._inputs(
        attention_bench.AttentionBenchOptions(heads=2, head_dim=8, value_dim=8), 2, 37)
    outs = {kind: attention_bench.attention_fn(kind, 16)(q, k, v)
            for kind in ("causal-linear/chunked", "causal-linear/associative_scan",
                         "causal-linear/scan")}
    for kind, out in outs.items():
        np.testing.assert_allclose(out, outs["causal-linear/chunked"], atol=1e-5, rtol=1e-4,
                                   err_msg=kind)


def test_lsh_baselines_are_opt_in_and_time_causal_lsh():
    assert not any(k.startswith("lsh-") for k in attention_bench.default_kinds("gpu"))
    q, k, v, _ = attention_bench._inputs(
        attention_bench.AttentionBenchOptions(heads=2, head_dim=8, value_dim=8), 2, 70)
    out = attention_bench.attention_fn("lsh-4", 16)(q, k, v)
    rot = ops.lsh_rotations(jax.random.key(0), 4, 8, attention_bench.LSH_BUCKETS)
    expected = ops.lsh_attention(q, v, rot, chunk_size=attention_bench.LSH_CHUNK, causal=True)
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_attention_run_writes_rows_files_and_skips_what_does_not_fit(tmp_path):
    opts = attention_bench.AttentionBenchOptions(
        lengths=(32, 64), tokens=64, heads=2, head_dim=8, value_dim=8, min_repeats=1,
        min_seconds=0.0, chunk_size=16)
    result = attention_bench.run_and_report(opts, tmp_path, log=lambda *_: None)
    rows = result["rows"]
    kinds = attention_bench.default_kinds(jax.devices()[0].platform)
    assert len(rows) == 2 * len(kinds) * 2
    assert {r["batch"] for r in rows if r["n"] == 32} == {2}
    assert all(r["status"] == "ok" and r["time_ms"] > 0 and r["peak_mib"] > 0 for r in rows)
    with open(result["files"]["csv"]) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    saved = json.loads(result["files"]["json"].read_text())
    assert saved["machine"]["jax"] == jax.__version__ and len(saved["rows"]) == len(rows)
    assert result["files"]["png"].stat().st_size > 10_000

    starved = attention_bench.AttentionBenchOptions(lengths=(64,), tokens=64, heads=2, head_dim=8,
                                                    value_dim=8, kinds=("softmax",),
                                                    memory_fraction=1e-12)
    (row, *_), = [attention_bench.run(starved, log=lambda *_: None)]
    assert row["status"].startswith("skipped: needs") and math.isnan(row["time_ms"])


def test_attention_options_reject_bad_values():
    with pytest.raises(ValueError, match="unknown attention kind 'flash'"):
        attention_bench.AttentionBenchOptions(kinds=("flash",))
    with pytest.raises(ValueError, match="unknown pass 'backward'"):
        attention_bench.AttentionBenchOptions(passes=("backward",))
    with pytest.raises(ValueError, match="lengths must be positive"):
        attention_bench.AttentionBenchOptions(lengths=(0,))


def _row(kind, n, time_ms, peak_mib, batch=1, pass_="forward+backward"):
    return {"kind": kind, "pass": pass_, "n": n, "batch": batch, "time_ms": time_ms,
            "peak_mib": peak_mib, "status": "ok"}


def test_speedups_and_memory_slopes():
    ns = [1024, 2048, 4096, 8192]
    rows = ([_row("causal-linear/chunked", n, n / 1024, 3.0 * n) for n in ns] +
            [_row("softmax", n, (n / 1024) ** 2, 5e-4 * n * n) for n in ns] +
            [_row("softmax", 512, 1.0, 1.0, batch=8)])  # batch > 1: not a pure function of N
    slopes = attention_bench.memory_slopes(rows)
    assert slopes["causal-linear/chunked"] == pytest.approx(1.0)
    assert slopes["softmax"] == pytest.approx(2.0)
    ratio = {r["n"]: r["slower_than_causal-linear/chunked"]
             for r in attention_bench.speedups(rows)}
    assert ratio == pytest.approx({n: n / 1024 for n in ns})


def test_generation_ratios_and_option_errors():
    speed = [{"arch": "mnist", "batch": 1, "method": "linear/recurrent", "images_per_s": 10.0},
             {"arch": "mnist", "batch": 1, "method": "softmax/kv-cache", "images_per_s": 2.5}]
    assert generation_bench.ratios(speed) == [
        {"arch": "mnist", "batch": 1, "method": "softmax/kv-cache",
         "linear/recurrent_speedup": 4.0}]
    with pytest.raises(ValueError, match="unknown method 'softmax/flash'"):
        generation_bench.GenerationBenchOptions(methods=("softmax/flash",))
    with pytest.raises(ValueError, match="unknown architecture 'imagenet'"):
        generation_bench.GenerationBenchOptions(archs=("imagenet",))


def test_paper_models_have_the_paper_architecture():
    model = generation_bench.paper_model("cifar10", "softmax")
    assert model.max_length == 3072 and len(model.decoder.layers) == 16
    model = generation_bench.paper_model("mnist", "linear", max_length=100)
    assert model.max_length == 100 and len(model.decoder.layers) == 8


def test_markdown_table_and_plot(tmp_path):
    table = report.markdown_table([{"a": 1.23456, "b": math.nan}, {"a": 2, "b": "x"}], ["a", "b"])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1.23 | - |", "| 2 | x |"]
    path = report.plot_series(tmp_path / "p.png", [
        {"xlabel": "N", "ylabel": "ms", "series": {"a": [(1, 1.0), (2, math.nan), (4, 3.0)]}}],
        title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run_script(module, *args, tmp_path):
    out = tmp_path / module
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", f"--out_dir={out}",
                           "--device=cpu", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_benchmark_attention_script_smoke(tmp_path):
    out, stdout = _run_script("benchmark_attention", "--lengths=16,64", "--tokens=32",
                              "--heads=2", "--head_dim=8", "--value_dim=8", "--min_seconds=0",
                              tmp_path=tmp_path)
    assert "causal-linear/chunked" in stdout and "slope" in stdout
    assert {p.name for p in out.iterdir()} == {"attention.csv", "attention.json", "attention.png"}


def test_benchmark_generation_script_smoke(tmp_path):
    out, stdout = _run_script("benchmark_generation", "--archs=mnist", "--batches=1",
                              "--timed_steps=2", "--recompute_steps=1", "--memory_lengths=8,32",
                              "--min_seconds=0", tmp_path=tmp_path)
    assert "images/s" in stdout
    rows = json.loads((out / "generation.json").read_text())
    assert [r["method"] for r in rows["rows"]] == list(generation_bench.DEFAULT_METHODS)
    assert all(r["images_per_s"] > 0 and r["timed_steps"] <= 2 for r in rows["rows"])
    memory = {(r["method"], r["length"]): r["peak_mib"] for r in rows["memory"]}
    # The RNN's state does not grow with the generated length; the KV cache does.
    assert memory[("linear/recurrent", 32)] == pytest.approx(memory[("linear/recurrent", 8)],
                                                             rel=0.01)
    assert memory[("softmax/kv-cache", 32)] > memory[("softmax/kv-cache", 8)]
    assert (out / "generation.png").exists()
