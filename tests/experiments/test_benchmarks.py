"""The benchmark library and both benchmark scripts, at tiny sizes (figures are not asserted:
speed lives in BENCHMARKS.md, not in unit tests)."""

import csv
import functools
import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarking import attention_bench, generation_bench, measure, peers, report
from linear_transformers import ops
from linear_transformers.ops.delta_rule import chunked as delta_rule_chunked
from linear_transformers.ops.gated_linear import pallas

ROOT = pathlib.Path(__file__).resolve().parents[2]


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
        fn = functools.partial(ops.softmax_attention, causal=True, implementation="xla")
        compiled = jax.jit(fn).lower(spec, spec, spec).compile()
        return measure.peak_bytes(compiled)

    small, large = peak(256), peak(1024)
    assert large > 4 * 1024 * 1024 * 4 / 2  # at least half of one [1024, 1024] float32 matrix
    assert large / small > 8
    assert measure.memory_budget_bytes(fraction=0.5) > 0


def test_attention_cases_agree_with_each_other(float32_products):
    # Every causal kind computes the same function; the benchmark must time the right thing.
    q, k, v, _ = attention_bench.random_inputs(
        attention_bench.AttentionBenchOptions(heads=2, head_dim=8, value_dim=8), 2, 37
    )
    outs = {
        kind: attention_bench.attention_fn(kind, 16)(q, k, v)
        for kind in (
            "causal-linear/chunked",
            "causal-linear/associative_scan",
            "causal-linear/scan",
            "causal-linear/pallas",
        )
    }
    for kind, out in outs.items():
        np.testing.assert_allclose(out, outs["causal-linear/chunked"], atol=1e-5, rtol=1e-4, err_msg=kind)


def test_lsh_baselines_are_opt_in_and_time_causal_lsh():
    assert not any(k.startswith("lsh-") for k in attention_bench.default_kinds("gpu"))
    # The Pallas kernel and cuDNN run by default only where they run compiled.
    gpu_only = {attention_bench.PALLAS, "softmax-cudnn"}
    assert gpu_only <= set(attention_bench.default_kinds("gpu"))
    assert not gpu_only & set(attention_bench.default_kinds("cpu"))
    q, k, v, _ = attention_bench.random_inputs(
        attention_bench.AttentionBenchOptions(heads=2, head_dim=8, value_dim=8), 2, 70
    )
    out = attention_bench.attention_fn("lsh-4", 16)(q, k, v)
    rot = ops.lsh_rotations(jax.random.key(0), 4, 8, attention_bench.LSH_BUCKETS)
    expected = ops.lsh_attention(q, v, rot, chunk_size=attention_bench.LSH_CHUNK, causal=True)
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_attention_run_writes_rows_files_and_skips_what_does_not_fit(tmp_path):
    opts = attention_bench.AttentionBenchOptions(
        lengths=(32, 64),
        tokens=64,
        heads=2,
        head_dim=8,
        value_dim=8,
        min_repeats=1,
        min_seconds=0.0,
        chunk_size=16,
    )
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

    starved = attention_bench.AttentionBenchOptions(
        lengths=(64,), tokens=64, heads=2, head_dim=8, value_dim=8, kinds=("softmax",), memory_fraction=1e-12
    )
    ((row, *_),) = [attention_bench.run(starved, log=lambda *_: None)]
    assert row["status"].startswith("skipped: needs") and math.isnan(row["time_ms"])


def test_attention_options_reject_bad_values():
    with pytest.raises(ValueError, match="unknown attention kind 'flash'"):
        attention_bench.AttentionBenchOptions(kinds=("flash",))
    with pytest.raises(ValueError, match="unknown pass 'backward'"):
        attention_bench.AttentionBenchOptions(passes=("backward",))
    with pytest.raises(ValueError, match="lengths must be positive"):
        attention_bench.AttentionBenchOptions(lengths=(0,))


def _row(kind, n, time_ms, peak_mib, batch=1, pass_="forward+backward"):
    return {
        "kind": kind,
        "pass": pass_,
        "n": n,
        "batch": batch,
        "time_ms": time_ms,
        "peak_mib": peak_mib,
        "status": "ok",
    }


def test_speedups_and_memory_slopes():
    ns = [1024, 2048, 4096, 8192]
    rows = (
        [_row("causal-linear/chunked", n, n / 1024, 3.0 * n) for n in ns]
        + [_row("softmax", n, (n / 1024) ** 2, 5e-4 * n * n) for n in ns]
        + [_row("softmax", 512, 1.0, 1.0, batch=8)]
    )  # batch > 1: not a pure function of N
    slopes = attention_bench.memory_slopes(rows)
    assert slopes["causal-linear/chunked"] == pytest.approx(1.0)
    assert slopes["softmax"] == pytest.approx(2.0)
    ratio = {r["n"]: r["slower_than_causal-linear/chunked"] for r in attention_bench.speedups(rows)}
    assert ratio == pytest.approx({n: n / 1024 for n in ns})


def test_generation_ratios_and_option_errors():
    speed = [
        {"arch": "mnist", "batch": 1, "method": "linear/recurrent", "images_per_s": 10.0},
        {"arch": "mnist", "batch": 1, "method": "softmax/kv-cache", "images_per_s": 2.5},
    ]
    assert generation_bench.ratios(speed) == [
        {"arch": "mnist", "batch": 1, "method": "softmax/kv-cache", "linear/recurrent_speedup": 4.0}
    ]
    with pytest.raises(ValueError, match="unknown method 'softmax/flash'"):
        generation_bench.GenerationBenchOptions(methods=("softmax/flash",))
    with pytest.raises(ValueError, match="unknown architecture 'imagenet'"):
        generation_bench.GenerationBenchOptions(archs=("imagenet",))


def test_generation_dtype_and_depth_are_checked_and_reach_the_model():
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'bfloat16', got 'float16'"):
        generation_bench.GenerationBenchOptions(dtype="float16")
    with pytest.raises(ValueError, match="num_layers must be >= 1 or None, got 0"):
        generation_bench.GenerationBenchOptions(num_layers=0)
    config = generation_bench.paper_config("mnist", "linear", num_layers=2, dtype="bfloat16")
    assert (config.model.attention, config.model.num_layers, config.model.dtype) == ("linear", 2, "bfloat16")


def test_peer_ratios_pair_each_of_our_cases_with_the_peers_same_case():
    rows = [
        _row("causal-linear/chunked", 4096, 50.0, 1.0),
        _row("fast-transformers:causal-linear", 4096, 100.0, math.nan),
        _row("softmax", 4096, 80.0, 1.0),
        _row("fast-transformers:full", 4096, math.nan, math.nan),  # did not run
        _row("causal-linear/chunked", 8192, 90.0, 1.0),
    ]  # no peer case
    ratios = peers.same_run_ratios(rows, ("n", "batch", "pass"), "time_ms", peers.ATTENTION_KINDS, "kind")
    assert ratios == [
        {
            "n": 4096,
            "batch": 1,
            "pass": "forward+backward",
            "ours": "causal-linear/chunked",
            "theirs": "fast-transformers:causal-linear",
            "ours_time_ms": 50.0,
            "theirs_time_ms": 100.0,
            "theirs_over_ours": 2.0,
        }
    ]


def test_a_peer_case_over_the_memory_budget_is_skipped_before_it_runs(monkeypatch):
    """Their softmax holds [B, H, N, N] matrices: a case that cannot fit is not started (it
    would take the machine's memory down with it); their linear kinds always run."""
    opts = attention_bench.AttentionBenchOptions(
        lengths=(64,), heads=2, head_dim=4, value_dim=4, min_seconds=0
    )
    ran = []
    monkeypatch.setattr(peers, "attention_call", lambda *a, **k: ran.append(a[0]) or (lambda: None))
    ours = {"kind": "softmax", "pass": "forward+backward", "n": 64, "status": "ok", "batch": 2}
    needs = peers.attention_peak_bytes("softmax", "forward+backward", 64, 2, 2)
    assert needs == 5 * 2 * 2 * 64 * 64 * 4
    (row,) = attention_bench.peer_rows(opts, ours, {}, budget=needs - 1)
    budget = f"{(needs - 1) / 2**30:.1f}"
    assert row["status"] == f"skipped: needs at least {needs / 2**30:.1f} GiB, budget {budget} GiB"
    assert row["kind"] == "fast-transformers:full" and ran == []
    attention_bench.peer_rows(opts, ours, {}, budget=needs)
    attention_bench.peer_rows(opts, {**ours, "kind": "linear"}, {}, budget=0)
    assert attention_bench.peer_rows(opts, {**ours, "kind": "causal-linear/scan"}, {}, budget=0) == []
    assert ran == ["softmax", "linear"]


def test_peers_that_are_unknown_or_not_installed_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown peers \['flash'\]; known: \['fast-transformers'\]"):
        attention_bench.AttentionBenchOptions(peers=("flash",))
    monkeypatch.setitem(sys.modules, "fast_transformers", None)  # as if not installed
    for options in (attention_bench.AttentionBenchOptions, generation_bench.GenerationBenchOptions):
        with pytest.raises(ValueError, match="needs torch and pytorch-fast-transformers"):
            options(peers=("fast-transformers",))


def test_the_peer_computes_what_ours_computes():
    """Same inputs, the authors' causal linear attention and ours: the same outputs, so the
    timings compare the same computation."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fast_transformers")
    from fast_transformers.masking import LengthMask, TriangularCausalMask

    q, k, v = (np.random.default_rng(i).standard_normal((2, 48, 3, 8), np.float32) for i in range(3))
    theirs = peers.attention_module("causal-linear", 8)(
        *(torch.from_numpy(x) for x in (q, k, v)),
        TriangularCausalMask(48),
        LengthMask(torch.full((2,), 48)),
        LengthMask(torch.full((2,), 48)),
    ).numpy()
    ours = ops.causal_linear_attention(q, k, v, implementation="chunked", chunk_size=16)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-4)
    opts = attention_bench.AttentionBenchOptions(heads=3, head_dim=8, value_dim=8, min_seconds=0)
    ours = attention_bench.case_row(opts, "causal-linear/chunked", "forward+backward", 48, 2, 16)
    (row,) = attention_bench.peer_rows(opts, ours, {}, budget=2**40)
    assert row["status"] == "ok" and row["time_ms"] > 0
    options = generation_bench.GenerationBenchOptions(timed_steps=3, min_seconds=0)
    generation = generation_bench.peer_row(options, "linear/recurrent", 2, 784)
    assert generation["timed_steps"] == 3 and generation["ms_per_step"] > 0


def test_paper_models_have_the_paper_architecture():
    model = generation_bench.paper_model("cifar10", "softmax")
    assert model.max_length == 3072 and model.transformer.num_layers == 16
    model = generation_bench.paper_model("mnist", "linear", max_length=100)
    assert model.max_length == 100 and model.transformer.num_layers == 8


def test_markdown_table_and_plot(tmp_path):
    table = report.markdown_table([{"a": 1.23456, "b": math.nan}, {"a": 2, "b": "x"}], ["a", "b"])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1.23 | - |", "| 2 | x |"]
    path = report.plot_series(
        tmp_path / "p.png",
        [{"xlabel": "N", "ylabel": "ms", "series": {"a": [(1, 1.0), (2, math.nan), (4, 3.0)]}}],
        title="t",
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _run_script(module, *args, tmp_path):
    out = tmp_path / module
    proc = subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", f"--out_dir={out}", "--device=cpu", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_benchmark_attention_script_smoke(tmp_path):
    out, stdout = _run_script(
        "benchmark_attention",
        "--lengths=16,64",
        "--tokens=32",
        "--heads=2",
        "--head_dim=8",
        "--value_dim=8",
        "--min_seconds=0",
        tmp_path=tmp_path,
    )
    assert "causal-linear/chunked" in stdout and "slope" in stdout
    assert {p.name for p in out.iterdir()} == {"attention.csv", "attention.json", "attention.png"}


def test_benchmark_generation_script_smoke(tmp_path):
    out, stdout = _run_script(
        "benchmark_generation",
        "--archs=mnist",
        "--num_layers=1",
        "--batches=1",
        "--timed_steps=2",
        "--recompute_steps=1",
        "--memory_lengths=8,32",
        "--min_seconds=0",
        tmp_path=tmp_path,
    )
    assert "images/s" in stdout
    rows = json.loads((out / "generation.json").read_text())
    assert [r["method"] for r in rows["rows"]] == list(generation_bench.DEFAULT_METHODS)
    assert all(r["images_per_s"] > 0 for r in rows["rows"])
    # A KV-cache step costs more as the cache fills: timed over the whole image, never scaled.
    timed = {r["method"]: r["timed_steps"] for r in rows["rows"]}
    assert timed == {"linear/recurrent": 2, "softmax/kv-cache": 784, "softmax/recompute": 1}
    memory = {(r["method"], r["length"]): r["peak_mib"] for r in rows["memory"]}
    # The RNN's state does not grow with the generated length; the KV cache does.
    assert memory[("linear/recurrent", 32)] == pytest.approx(memory[("linear/recurrent", 8)], rel=0.01)
    assert memory[("softmax/kv-cache", 32)] > memory[("softmax/kv-cache", 8)]
    assert (out / "generation.png").exists()


# --- prefill and sequence-parallel benchmarks -------------------------------------------------

from experiments.benchmarking import prefill_bench, sequence_parallel_bench  # noqa: E402


def test_prefill_speedups_pair_methods_of_one_case():
    rows = [
        {"kind": "linear", "batch": 1, "prompt": 512, "method": "prefill", "time_ms": 2.0, "status": "ok"},
        {"kind": "linear", "batch": 1, "prompt": 512, "method": "step-scan", "time_ms": 9.0, "status": "ok"},
        {
            "kind": "linear",
            "batch": 4,
            "prompt": 512,
            "method": "prefill",
            "time_ms": 4.0,
            "status": "ok",
        },  # its step-scan was skipped: no ratio
        {
            "kind": "linear",
            "batch": 4,
            "prompt": 512,
            "method": "step-scan",
            "time_ms": math.nan,
            "status": "skipped: needs 9.0 GiB",
        },
    ]
    assert prefill_bench.speedups(rows, prefill_bench.LM_GROUP) == [
        {
            "kind": "linear",
            "batch": 1,
            "prompt": 512,
            "prefill_ms": 2.0,
            "step_scan_ms": 9.0,
            "step_scan_over_prefill": 4.5,
        }
    ]
    images = [
        {"arch": "mnist", "kind": "linear", "batch": 16, "method": m, "time_ms": t, "status": "ok"}
        for m, t in (("step-scan", 300.0), ("prefill", 200.0))
    ]
    (ratio,) = prefill_bench.speedups(images, prefill_bench.IMAGE_GROUP)
    assert ratio["step_scan_over_prefill"] == pytest.approx(1.5)


def test_prefill_options_reject_bad_values():
    with pytest.raises(ValueError, match="unknown attention kind 'reformer'"):
        prefill_bench.PrefillBenchOptions(kinds=("reformer",))
    with pytest.raises(ValueError, match="unknown image architecture 'imagenet'"):
        prefill_bench.PrefillBenchOptions(image_arch="imagenet")
    with pytest.raises(ValueError, match="prompt_lengths must be positive"):
        prefill_bench.PrefillBenchOptions(prompt_lengths=(0,))
    opts = prefill_bench.PrefillBenchOptions(prompt_lengths=(512, 2048, 8192), softmax_lengths=(512,))
    assert opts.lengths_for("softmax") == (512,) and opts.lengths_for("linear")[-1] == 8192


def _sp_row(kind, p, peak, temp, step, loss=1.0):
    return {"kind": kind, "P": p, "peak_mib": peak, "temp_mib": temp, "step_ms": step, "loss": loss}


def test_sequence_parallel_ratios_and_slopes():
    rows = [
        _sp_row("linear", p, 2.0 + 64.0 / p, 64.0 / p, 100.0 * (1 + p / 8), 1.0 + 1e-6 * p)
        for p in (1, 2, 4, 8)
    ]
    rows += [_sp_row("softmax", 1, 512.0, 500.0, 50.0), _sp_row("softmax", 2, math.nan, math.nan, math.nan)]
    out = {(r["kind"], r["P"]): r for r in sequence_parallel_bench.add_ratios(rows)}
    assert out[("linear", 8)]["temp_vs_p1"] == pytest.approx(1 / 8)
    assert out[("linear", 8)]["peak_vs_p1"] == pytest.approx(10.0 / 66.0)
    assert out[("linear", 8)]["ideal_memory"] == pytest.approx(1 / 8)
    assert out[("linear", 4)]["step_vs_p1"] == pytest.approx(1.5 / 1.125)
    assert out[("linear", 2)]["loss_diff_vs_p1"] == pytest.approx(1e-6)
    assert math.isnan(out[("softmax", 2)]["peak_vs_p1"])
    temp = sequence_parallel_bench.memory_slopes(rows, "temp_mib")
    assert temp["linear"] == pytest.approx(-1.0) and "softmax" not in temp  # one finite point
    assert -1.0 < sequence_parallel_bench.memory_slopes(rows)["linear"] < -0.8


def test_sequence_parallel_options_reject_bad_values():
    with pytest.raises(ValueError, match="length 1000 must be positive and divide by every P"):
        sequence_parallel_bench.SequenceParallelBenchOptions(length=1000, parallelism=(1, 16))
    with pytest.raises(ValueError, match="unknown attention kind 'reformer'"):
        sequence_parallel_bench.SequenceParallelBenchOptions(kinds=("reformer",))
    with pytest.raises(ValueError, match=r"P=\d+ needs \d+ devices but JAX sees"):
        sequence_parallel_bench.sequence_mesh(jax.device_count() + 1)


def test_benchmark_prefill_script_smoke(tmp_path):
    out, stdout = _run_script(
        "benchmark_prefill",
        "--prompt_lengths=16",
        "--batches=2",
        "--kinds=gla,softmax",  # any kind with a recurrent form: a gated one here
        "--softmax_lengths=16",
        "--num_layers=1",
        "--model_dim=16",
        "--num_heads=2",
        "--vocab_size=11",
        "--image_layers=1",
        "--image_length=12",
        "--image_prefix=5",
        "--image_batches=2",
        "--image_kinds=linear",
        "--min_seconds=0",
        tmp_path=tmp_path,
    )
    assert "step-scan / prefill" in stdout and "images/s" in stdout
    with open(out / "prefill.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["kind"], r["prompt"], r["method"]) for r in rows] == [
        ("gla", "16", "prefill"),
        ("gla", "16", "step-scan"),
        ("softmax", "16", "prefill"),
        ("softmax", "16", "step-scan"),
    ]
    # Both paths compute the same logits; the table says so.
    assert all(r["status"] == "ok" and float(r["max_logit_diff"]) < 1e-3 for r in rows)
    saved = json.loads((out / "prefill.json").read_text())
    assert len(saved["ratios"]) == 2 and len(saved["image_ratios"]) == 1
    # The same key per sub-pixel: the prefix is kept and the same images are drawn.
    assert all(
        r["prefix_kept"] and r["same_subpixels"] > 0.9 and r["images_per_s"] > 0 for r in saved["images"]
    )
    assert {p.name for p in out.iterdir()} == {
        "prefill.csv",
        "prefill.json",
        "prefill.png",
        "prefill_images.csv",
    }


def test_benchmark_sequence_parallel_script_smoke(tmp_path):
    # linear only: each training step takes seconds to compile; softmax runs the same code.
    out, stdout = _run_script(
        "benchmark_sequence_parallel",
        "--parallelism=1,8",
        "--length=64",
        "--kinds=linear",
        "--num_layers=1",
        "--model_dim=16",
        "--num_heads=2",
        "--vocab_size=11",
        "--min_seconds=0",
        tmp_path=tmp_path,
    )
    assert "slope of memory per device" in stdout
    rows = json.loads((out / "sequence_parallel.json").read_text())["rows"]
    assert [(r["kind"], r["P"], r["tokens_per_device"]) for r in rows] == [
        ("linear", 1, 64),
        ("linear", 8, 8),
    ]
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in rows)
    # The same model on the same tokens: splitting time over devices changes nothing but memory.
    assert rows[1]["loss_diff_vs_p1"] < 1e-4
    assert rows[1]["temp_mib"] < rows[0]["temp_mib"]
    with open(out / "sequence_parallel.csv") as f:
        assert len(list(csv.DictReader(f))) == 2
    assert (out / "sequence_parallel.png").exists()


# --- gated (decayed) linear attention benchmark ----------------------------------------------

from experiments.benchmarking import gated_bench  # noqa: E402


def test_gated_cases_time_the_decayed_op_and_its_reference(float32_products):
    opts = gated_bench.GatedBenchOptions(heads=2, head_dim=8, value_dim=8)
    q, k, v, g, _ = gated_bench.random_inputs(opts, "gated-feature/chunked", 2, 37)
    assert g.shape == (2, 37, 2, 8) and float(g.max()) < 0 and float(g.min()) > -10
    chunked = jax.jit(gated_bench.attention_fn("gated-feature/chunked", None))(q, k, v, g)
    dense = jax.jit(gated_bench.attention_fn("gated-feature/reference", None))(q, k, v, g)
    np.testing.assert_allclose(chunked, dense, atol=1e-5, rtol=1e-4)
    assert gated_bench.chunk_size_used("gated-feature/chunked", None) == ops.DEFAULT_CHUNK_SIZE
    assert gated_bench.chunk_size_used("gated-step/reference", 32) is None
    assert gated_bench.chunk_size_used("gated-feature/pallas", None) == pallas.DEFAULT_CHUNK_SIZE
    assert gated_bench.chunk_size_used("gated-step/pallas", None) == pallas.DEFAULT_CHUNK_SIZE
    row = gated_bench.run_case(opts, "gated-step/reference", "forward", 64, budget=0)
    assert row["status"].startswith("skipped: needs") and math.isnan(row["time_ms"]) and row["peak_mib"] > 0


def test_gated_ratios_and_goal_come_from_the_same_run():
    def row(kind, n, time_ms, pass_="forward+backward", status="ok"):
        return {"kind": kind, "pass": pass_, "n": n, "time_ms": time_ms, "status": status}

    rows = gated_bench.add_ratios(
        [
            row("causal-linear/chunked", 64, 10.0),
            row("gated-step/chunked", 64, 12.0),
            row("gated-feature/chunked", 64, 40.0),
            row("gated-feature/reference", 64, math.nan, status="skipped: needs 9.0 GiB"),
            row("gated-head/chunked", 64, 5.0, pass_="forward"),  # no forward baseline: no ratio
        ]
    )
    ratios = [r["vs_causal_linear"] for r in rows]
    assert ratios[:3] == [1.0, pytest.approx(1.2), pytest.approx(4.0)] and all(map(math.isnan, ratios[3:]))
    assert [(g["decay"], g["goal"]) for g in gated_bench.goal_checks(rows)] == [
        ("step", "met"),
        ("feature", "missed"),
    ]
    with pytest.raises(ValueError, match="unknown decay 'scalar'"):
        gated_bench.GatedBenchOptions(decays=("scalar",))
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        gated_bench.GatedBenchOptions(dtype="float16")


def test_delta_cases_time_the_delta_rule_against_its_scan_and_the_gated_form(float32_products):
    opts = gated_bench.GatedBenchOptions(heads=2, head_dim=8, value_dim=8)
    q, k, v, beta, g, _ = gated_bench.random_inputs(opts, "delta-feature/chunked", 2, 37)
    assert beta.shape == (2, 37, 2) and float(beta.min()) > 0 and float(beta.max()) < 1
    assert g.shape == (2, 37, 2, 8) and float(g.max()) < 0
    chunked = jax.jit(gated_bench.attention_fn("delta-feature/chunked", None))(q, k, v, beta, g)
    scan = jax.jit(gated_bench.attention_fn("delta-feature/scan", None))(q, k, v, beta, g)
    np.testing.assert_allclose(chunked, scan, atol=1e-5, rtol=1e-4)
    assert gated_bench.chunk_size_used("delta-step/scan", 32) is None
    # The delta rule's chunk is its own, the platform's (32 on this CPU run), not the gated op's.
    assert gated_bench.chunk_size_used("delta-step/chunked", None) == delta_rule_chunked.default_chunk_size()

    def row(kind, time_ms):
        return {"kind": kind, "pass": "forward+backward", "n": 64, "time_ms": time_ms, "status": "ok"}

    rows = [row("gated-step/chunked", 10.0), row("delta-step/chunked", 20.0), row("delta-step/scan", 80.0)]
    rows.append(row("delta-none/chunked", 30.0))  # no scan, no gated case of its decay
    # Timed in turn with the gated per-step form and the scan: those ratios, not the sweep's, count.
    rows.append(row("delta-feature/chunked", 40.0) | {"over_gated_step": 2.2, "scan_over_chunked": 6.0})
    rows.append(row("delta-feature/scan", 80.0))
    checks = gated_bench.delta_checks(rows)
    assert [
        (c["scan / chunked"], c["scan goal"], c["chunked / gated, same decay"], c["chunked / gated per step"],
         c["gated goal"]) for c in checks[:1]
    ] == [(4.0, "missed", 2.0, 2.0, "met")]  # fmt: skip
    assert (checks[1]["scan goal"], checks[1]["chunked / gated per step"], checks[1]["gated goal"]) == (
        "not run", 3.0, "missed",
    )  # fmt: skip
    assert math.isnan(checks[1]["chunked / gated, same decay"])
    columns = ("scan / chunked", "scan goal", "chunked / gated per step", "gated goal")
    assert [checks[2][c] for c in columns] == [6.0, "met", 2.2, "met"]
    with pytest.raises(ValueError, match="unknown delta impl 'reference'"):
        gated_bench.GatedBenchOptions(delta_impls=("reference",))
    with pytest.raises(ValueError, match="goal_rounds must be >= 0, got -1"):
        gated_bench.GatedBenchOptions(goal_rounds=-1)


def test_interleaved_times_give_the_median_of_each_rounds_ratio(monkeypatch):
    """Each round times every call in turn, the second of two runs; the machine's speed drifting
    between rounds (here tenfold in the third) moves every call of the round alike and no ratio."""
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    # Two runs per call and round, the first untimed (here slower: after the other call).
    costs = {"base": iter([9, 1.0, 9, 1.0, 90, 10.0]), "other": iter([9, 2.0, 9, 2.5, 90, 20.0])}

    def call(name):
        def run():
            clock[0] += next(costs[name])

        return run

    times = measure.interleaved_times({"base": call("base"), "other": call("other")}, rounds=3)
    assert times == {"base": [1.0, 1.0, 10.0], "other": [2.0, 2.5, 20.0]}
    assert measure.median_ratio(times, "other", "base") == 2.0  # rounds: 2.0, 2.5, 2.0
    with pytest.raises(ValueError, match=r"'gated' was not timed; timed: \['base', 'other'\]"):
        measure.median_ratio(times, "other", "gated")
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        measure.interleaved_times({"base": call("base")}, rounds=0)


def test_benchmark_gated_script_smoke(tmp_path):
    out, stdout = _run_script(
        "benchmark_gated",
        "--lengths=64,128",
        "--tokens=128",
        "--heads=2",
        "--head_dim=8",
        "--value_dim=8",
        "--decays=step",
        "--impls=chunked",
        "--delta_decays=step",
        "--delta_impls=chunked",
        "--passes=forward+backward",
        "--min_seconds=0",
        "--goal_rounds=2",
        tmp_path=tmp_path,
    )
    assert "goal: a decay costs at most 1.3x" in stdout and "delta rule, forward+backward" in stdout
    assert {p.name for p in out.iterdir()} == {"gated.csv", "gated.json", "gated.png"}
    with open(out / "gated.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["n"], r["kind"]) for r in rows] == [
        (n, kind)
        for n in ("64", "128")
        for kind in ("causal-linear/chunked", "gated-step/chunked", "delta-step/chunked")
    ]
    assert all(
        r["status"] == "ok" and float(r["time_ms"]) > 0 and float(r["vs_causal_linear"]) > 0 for r in rows
    )
    saved = json.loads((out / "gated.json").read_text())
    assert saved["machine"]["jax"] == jax.__version__ and len(saved["rows"]) == 6
    assert [c["decay"] for c in saved["goal"]["checks"]] == ["step", "step"]
    assert [(c["n"], c["scan goal"]) for c in saved["delta"]] == [(64, "not run"), (128, "not run")]
    # The delta rule over the gated per-step form, timed in turn: that case's rows alone.
    interleaved = [r["kind"] for r in rows if not math.isnan(float(r["over_gated_step"]))]
    assert all(math.isnan(float(r["scan_over_chunked"])) for r in rows)  # no scan ran
    assert interleaved == ["delta-step/chunked"] * 2
    assert all(c["chunked / gated per step"] > 0 for c in saved["delta"])


# --- flags generated from an options dataclass --------------------------------------------------

import dataclasses  # noqa: E402
from typing import Literal  # noqa: E402

from absl import flags as absl_flags  # noqa: E402

from experiments.benchmarking import flags, processes_bench  # noqa: E402


@dataclasses.dataclass(frozen=True)
class _Options:
    """Options of the test below.

    count: How many.
    scale: How much.
    loud: Whether it is loud.
    name: What it is called,
        on two lines.
    sizes: Sizes, each positive.
    limit: At most this (none: no limit).
    """

    count: int = 3
    scale: float = 0.5
    loud: bool = False
    name: str = "x"
    sizes: tuple[int, ...] = (1, 2)
    limit: int | None = None
    mode: Literal["a", "b"] = dataclasses.field(default="a", metadata={"help": "A or b."})

    def __post_init__(self):
        if any(size < 1 for size in self.sizes):
            raise ValueError(f"sizes must be positive, got {self.sizes}.")


def _parsed(options_class, *argv):
    values = absl_flags.FlagValues()
    build = flags.define(options_class, values, module_name="test")
    values(["program", *argv])
    return values, build


def test_flags_are_generated_from_an_options_dataclass_and_build_it_back():
    values, build = _parsed(_Options)
    assert build() == _Options()
    assert (
        values["name"].help == "What it is called, on two lines." and values["mode"].help == "<a|b>: A or b."
    )
    assert values["sizes"].default == ["1", "2"] and values["limit"].default is None
    argv = ("--count=7", "--scale=2", "--loud", "--name=y", "--sizes=4,5,6", "--limit=9", "--mode=b")
    assert _parsed(_Options, *argv)[1]() == _Options(7, 2.0, True, "y", (4, 5, 6), 9, "b")
    with pytest.raises(absl_flags.IllegalFlagValueError, match="mode"):
        _parsed(_Options, "--mode=c")
    with pytest.raises(ValueError, match=r"^--sizes=1,x: invalid literal for int\(\)"):
        _parsed(_Options, "--sizes=1,x")[1]()
    # The dataclass's own check, with the flag it is due to (not --count, which it accepts).
    with pytest.raises(ValueError, match=r"^--sizes=0: sizes must be positive, got \(0,\)\.$"):
        _parsed(_Options, "--count=2", "--sizes=0")[1]()
    # A field type of the options' own: its metadata's parser, the default printed back.
    values, build = _parsed(processes_bench.ProcessesBenchOptions, "--setups=2x2,1x3")
    assert build().setups == (processes_bench.Setup(2, 2), processes_bench.Setup(1, 3))
    assert values["setups"].default == ["1x4", "2x2", "1x2"]
    with pytest.raises(ValueError, match=r"^--setups=2x: a setup is PROCESSESxDEVICES like 2x2"):
        _parsed(processes_bench.ProcessesBenchOptions, "--setups=2x")[1]()


def test_every_benchmark_option_has_a_flag_with_help():
    from experiments.benchmarking import accelerator_bench, accelerator_check

    for options in (
        attention_bench.AttentionBenchOptions,
        gated_bench.GatedBenchOptions,
        generation_bench.GenerationBenchOptions,
        prefill_bench.PrefillBenchOptions,
        sequence_parallel_bench.SequenceParallelBenchOptions,
        processes_bench.ProcessesBenchOptions,
        accelerator_bench.AcceleratorBenchOptions,
        accelerator_check.CheckOptions,
    ):
        values, build = _parsed(options)
        assert build() == options(), options
        assert {f.name for f in dataclasses.fields(options)} == set(values), options


def test_a_refused_flag_ends_the_command_in_one_line_naming_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.benchmark_gated", "--decays=scalar", f"--out_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "benchmark_gated: error: --decays=scalar: unknown decay 'scalar'; expected some of "
        "('none', 'head', 'step', 'feature')."
    )


# --- precision benchmark ------------------------------------------------------------------------

from experiments.benchmarking import precision_bench  # noqa: E402


def test_precision_options_reject_bad_values():
    with pytest.raises(ValueError, match="unknown attention kind 'reformer'"):
        precision_bench.PrecisionBenchOptions(kinds=("reformer",))
    with pytest.raises(ValueError, match="lengths: give at least one value"):
        precision_bench.PrecisionBenchOptions(lengths=())


def test_precision_run_writes_a_row_per_seed_and_the_worst_per_case(tmp_path):
    opts = precision_bench.PrecisionBenchOptions(kinds=("retention",), lengths=(8,), seeds=(0, 1), batch=1)
    out = precision_bench.run_and_report(opts, tmp_path, log=lambda *_: None)
    assert [(r["kind"], r["length"], r["seed"]) for r in out["rows"]] == [
        ("retention", 8, 0),
        ("retention", 8, 1),
    ]
    for r in out["rows"]:
        assert r["over_sensitivity"] == pytest.approx(
            max(r["bf16_error"], r["recurrent_error"]) / r["sensitivity"]
        )
    (worst,) = precision_bench.worst_per_case(out["rows"])
    assert worst["bf16_error"] == max(r["bf16_error"] for r in out["rows"])
    assert {"csv", "worst_csv", "json", "png"} <= set(out["files"])
