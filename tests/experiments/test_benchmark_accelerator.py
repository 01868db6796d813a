"""The one-command accelerator benchmark at tiny sizes on the CPU: every part runs through the
real benchmark modules, the report names the device and has a row for every part, and a part
that raises is recorded as skipped while the others are still written (figures are not
asserted: they are the GPU's to give)."""

import csv
import dataclasses
import pathlib
import subprocess
import sys
import types

import jax
import pytest

from experiments.benchmarking import accelerator_bench, gated_bench, kernel_bench

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_every_part_at_tiny_sizes_and_a_failing_part_is_skipped(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    # gated_bench times every gated case through run_case: all of them now raise (the entry
    # point's test below runs the gated part for real).
    monkeypatch.setattr(gated_bench, "run_case", boom)
    result = accelerator_bench.run_and_report(
        accelerator_bench.AcceleratorBenchOptions(sizes="tiny"), tmp_path, log=lambda line: None
    )
    statuses = {name: part.status for name, part in result["parts"].items()}
    assert statuses["gated"] == "skipped: failed: RuntimeError: boom"
    assert all(statuses[p].startswith("ok: ") for p in accelerator_bench.PARTS if p != "gated"), statuses

    device_kind = jax.devices()[0].device_kind
    markdown = (tmp_path / "accelerator.md").read_text()
    assert f"**Device:** {device_kind} (platform cpu" in markdown and f"jax {jax.__version__}" in markdown
    for part in accelerator_bench.PARTS:
        assert f"| {part} | {statuses[part]} |" in markdown  # the parts table
        assert f"## {part}: " in markdown
    rows = _csv(tmp_path / "accelerator.csv")
    assert {r["device"] for r in rows} == {device_kind}
    summary = {r["part"]: r["status"] for r in rows if r["case"] == "part summary"}
    assert summary == statuses
    measured = {r["part"] for r in rows if r["case"] != "part summary" and r["status"] == "ok"}
    assert measured == set(accelerator_bench.PARTS) - {"gated"}
    train = [r for r in rows if r["part"] == "train_step" and r["case"] != "part summary"]
    assert float(train[0]["tokens_per_s"]) > 0 and float(train[0]["steps_per_s"]) > 0
    # The first step by depth: cold (compiled) and from the persistent cache, which is faster.
    first = [r for r in rows if r["part"] == "compile" and r["layers"]]
    assert [(r["case"], int(r["layers"])) for r in first] == [
        ("warm-up", 1),
        ("1 layers", 1),
        ("2 layers", 2),
    ]
    assert first[0]["status"].startswith("warm-up")
    assert all(0 < float(r["cached_first_call_s"]) < float(r["first_call_s"]) for r in first)
    # No cuDNN on the CPU: the attention targets say so instead of a verdict.
    verdicts = {t["target"]: t["verdict"] for t in result["targets"]}
    assert verdicts["chunked >= 8x cuDNN flash attention, N=16384, forward"] == "not measured"
    # The kernel part: the kernel (interpreted here) and the copy of its bytes both ran.
    assert verdicts["pallas forward <= 3x the copy of its bytes, no decay, N=64"] in ("met", "missed")
    fastest = "pallas forward <= 3x the copy of its bytes, no decay, N=64, fastest launches"
    assert verdicts[fastest] in ("met", "missed") and "each case's fastest launch" in markdown
    kernel = [r for r in rows if r["part"] == "kernel" and r["kind"] == "gated-none/pallas"]
    assert kernel and float(kernel[0]["gb_per_s"]) > 0 and int(kernel[0]["bytes"]) == 4 * 2 * 64 * 2 * 8 * 2
    assert all(float(r["rel_err"]) <= kernel_bench.REL_ERR_LIMIT for r in kernel)  # every launch checked
    # Its other launches, each set against the default launch of the same case.
    assert "| 64 | none | forward | value_block=32 | " in markdown
    launches = kernel_bench.tunings([r | {"n": int(r["n"]), "time_ms": float(r["time_ms"])} for r in kernel])
    forward = [t for t in kernel_bench.TUNINGS if kernel_bench.times_pass(t, "forward")]
    assert {t["tuning"] for t in launches} == {kernel_bench.tuning_label(t) for t in forward}
    assert all(t["default_over_tuned"] > 0 for t in launches)
    # A launch that changes only the backward is not timed forward, where it is the default.
    backward_only = [t for t in kernel_bench.TUNINGS if t not in forward]
    assert backward_only == [{"split_key_value": True}, {"split_backward": False}]
    assert all(kernel_bench.times_pass(t, "forward+backward") for t in kernel_bench.TUNINGS)


def test_a_kernel_row_is_checked_against_the_float32_chunked_form(monkeypatch):
    """A kernel that gives a wrong result is marked wrong, and no table or goal reads its time."""
    opts = accelerator_bench._sizes("tiny").kernel
    n, budget = opts.lengths[0], opts.budget_bytes()
    right = kernel_bench.run_case(opts, "gated-step/pallas", "forward+backward", n, budget)
    assert right["status"] == "ok" and right["rel_err"] <= kernel_bench.REL_ERR_LIMIT
    attention_fn = gated_bench.attention_fn

    def half_again(kind, chunk_size):  # the kernel's result 1.5 times what it should be
        fn = attention_fn(kind, chunk_size)
        return fn if kind.endswith("/chunked") else lambda *args: 1.5 * fn(*args)

    monkeypatch.setattr(gated_bench, "attention_fn", half_again)
    wrong = kernel_bench.run_case(opts, "gated-step/pallas", "forward", n, budget)
    assert wrong["status"].startswith("wrong: rel_err 0.5 > 0.02 against the float32 chunked form")
    assert kernel_bench.default_launches([right, wrong]).keys() == {
        (n, "gated-step/pallas", "forward+backward")
    }


def test_the_entry_point_writes_the_report_of_the_selected_parts(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.benchmark_accelerator",
            "--sizes=tiny",
            "--device=cpu",
            "--parts=gated",
            f"--out_dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _csv(out / "accelerator.csv")
    summary = {r["part"]: r["status"] for r in rows if r["case"] == "part summary"}
    assert summary["gated"] == "ok: 2 cases"  # the baseline and one decay
    assert summary["attention"] == "skipped: not selected (--parts=gated)"
    assert set(summary) == set(accelerator_bench.PARTS)
    assert "time / time(causal-linear/chunked), same run" in (out / "accelerator.md").read_text()


def test_accelerator_sizes_refuse_the_cpu_and_options_are_checked():
    with pytest.raises(ValueError, match="--sizes=accelerator is sized for an accelerator.*--sizes=tiny"):
        accelerator_bench.check_platform("accelerator", "cpu")
    accelerator_bench.check_platform("accelerator", "gpu")
    accelerator_bench.check_platform("tiny", "cpu")
    accelerator_bench.check_platform("check", "cpu", parts=("compile", "train_step"))  # minutes
    with pytest.raises(ValueError, match=r"parts \['attention'\]"):
        accelerator_bench.check_platform("check", "cpu", parts=("compile", "attention"))
    with pytest.raises(ValueError, match="unknown or no parts \\['attn'\\]; expected some of"):
        accelerator_bench.AcceleratorBenchOptions(parts=("attn",))
    with pytest.raises(ValueError, match="unknown sizes 'huge'"):
        accelerator_bench.AcceleratorBenchOptions(sizes="huge")
    with pytest.raises(ValueError, match="max_minutes must be > 0"):
        accelerator_bench.AcceleratorBenchOptions(max_minutes=0)


def test_budgets_failures_and_the_run_limit(tmp_path, monkeypatch):
    """The driver alone, on fake parts and a fake clock: a case that raises, a part over its
    budget, parts past the run's limit."""
    clock = [0.0]
    monkeypatch.setattr(accelerator_bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def case(label, seconds=0.0, fail=False):
        def run():
            clock[0] += seconds
            if fail:
                raise ValueError("bad case\nsecond line")
            return [{"status": "ok", "value": 1.0}]

        return accelerator_bench.Case(label, run)

    parts = {
        "attention": [case("a1"), case("a2", fail=True)],
        "generation": [case("g1", seconds=15), case("g2")],  # g2: past the part's 10 s
        "train_step": [case("t1", seconds=50)],  # the run's minute is spent after it
    }
    fakes = {
        name: dataclasses.replace(spec, cases=lambda sizes, name=name: parts.get(name, []))
        for name, spec in accelerator_bench.PART_SPECS.items()
    }
    monkeypatch.setattr(accelerator_bench, "PART_SPECS", fakes)
    tiny = accelerator_bench._sizes("tiny")
    monkeypatch.setattr(
        accelerator_bench,
        "_sizes",
        lambda name: dataclasses.replace(tiny, budgets_s=tiny.budgets_s + (("generation", 10.0),)),
    )
    opts = accelerator_bench.AcceleratorBenchOptions(sizes="tiny", max_minutes=1.0)
    result = accelerator_bench.run_and_report(opts, tmp_path, log=lambda line: None)
    statuses = {name: part.status for name, part in result["parts"].items()}
    assert statuses["attention"] == "partial: 1 of 2 cases failed, 0 not run"
    assert result["parts"]["attention"].rows[1]["status"] == "failed: ValueError: bad case"
    assert statuses["generation"] == (
        "partial: 0 of 2 cases failed, 1 not run (the part's budget of 10 s was spent)"
    )
    assert result["parts"]["generation"].rows[1] == {
        "case": "g2",
        "status": "skipped: the part's budget of 10 s was spent",
    }
    assert statuses["train_step"] == "ok: 1 case"
    for part in ("chunk_size", "prefill", "gated"):
        assert statuses[part] == "skipped: the run's limit of 1 minutes was spent before it"
    rows = _csv(tmp_path / "accelerator.csv")
    assert {r["part"] for r in rows if r["case"] == "part summary"} == set(accelerator_bench.PARTS)
    assert "finished after 65 s" in (tmp_path / "accelerator.md").read_text()

    # One part selected, with a budget of its own: g2 runs.
    clock[0] = 0.0
    opts = accelerator_bench.AcceleratorBenchOptions(sizes="tiny", parts=("generation",), part_seconds=20.0)
    result = accelerator_bench.run_and_report(opts, tmp_path, log=lambda line: None)
    assert result["parts"]["generation"].status == "ok: 2 cases"
    with pytest.raises(ValueError, match=r"part_seconds must be >= 0 \(0: each part's own budget\), got -1"):
        accelerator_bench.AcceleratorBenchOptions(part_seconds=-1)


def test_targets_are_met_or_missed_from_the_same_run():
    def attention(kind, pass_, n, ms):
        return {"kind": kind, "pass": pass_, "n": n, "time_ms": ms, "status": "ok"}

    rows = [
        attention("causal-linear/chunked", "forward", 16384, 1.0),
        attention("softmax-cudnn", "forward", 16384, 9.0),
        attention("causal-linear/chunked", "forward", 65536, 2.0),
        attention("softmax-cudnn", "forward", 65536, 20.0),
    ]
    verdicts = [(t["measured"], t["verdict"]) for t in accelerator_bench.attention_targets(rows)]
    assert verdicts == [
        ("9.00x", "met"),
        ("not measured", "not measured"),  # no forward+backward rows
        ("10.00x", "missed"),
        ("not measured", "not measured"),
    ]

    def image(method, batch, ips):
        return {"method": method, "batch": batch, "images_per_s": ips, "status": "ok"}

    rows = [
        image("linear/recurrent", 1, 100.0),
        image("softmax/kv-cache", 1, 50.0),
        image("linear/recurrent", 1024, 4000.0),
        image("softmax/kv-cache", 1024, 500.0),
    ]
    verdicts = [(t["measured"], t["verdict"]) for t in accelerator_bench.generation_targets(rows)]
    assert verdicts == [("4,000 at B=1024", "met"), ("2.00x", "missed"), ("8.00x", "met")]


def test_the_kernel_goals_are_read_at_the_default_and_at_each_cases_fastest_launch():
    """The goals at the default launch, and again at each case's fastest launch that ran (a
    failed launch's time, however short, is not read); the fastest-launch table names it."""

    def row(kind, pass_, ms, tuning="", status="ok"):
        decay = kind.removeprefix("gated-").removeprefix("copy-").split("/")[0]
        return {
            "kind": kind,
            "decay": decay,
            "pass": pass_,
            "n": 64,
            "time_ms": ms,
            "tuning": tuning,
            "status": status,
        }

    both = "forward+backward"
    rows = [
        row("gated-none/pallas", "forward", 4.0),
        row("gated-none/pallas", "forward", 2.0, "walks=8"),
        row("gated-none/pallas", "forward", 0.5, "num_warps=4", status="wrong: rel_err 0.5 > 0.02"),
        row("gated-none/pallas", "forward", 3.0, "num_stages=3"),
        row("copy-none", "forward", 1.0),
        row("softmax-cudnn", both, 30.0),
        row("gated-none/pallas", both, 5.0),
        row("gated-none/pallas", both, 6.0, "walks=8"),
    ]
    verdicts = {t["target"]: (t["measured"], t["verdict"]) for t in accelerator_bench.kernel_targets(rows)}
    assert verdicts["pallas forward <= 3x the copy of its bytes, no decay, N=64"] == ("4.00x", "missed")
    roof = "pallas forward <= 3x the copy of its bytes, no decay, N=64, fastest launches"
    assert verdicts[roof] == ("2.00x", "met")
    cudnn = "pallas forward+backward >= 10x cuDNN flash attention, no decay, N=64"
    assert verdicts[cudnn] == verdicts[cudnn + ", fastest launches"] == ("6.00x", "missed")
    fastest = {(r["pass"], r["tuning"], r["default_over_fastest"]) for r in kernel_bench.fastest(rows)}
    assert fastest == {("forward", "walks=8", 2.0), (both, "default", 1.0)}
    # Without other launches, the goals are read once.
    once = accelerator_bench.kernel_targets([r for r in rows if not r["tuning"]])
    assert not any("fastest" in t["target"] for t in once)
