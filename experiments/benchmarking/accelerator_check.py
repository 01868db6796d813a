"""The check of an accelerator, in one run: the op and model tests, then the quick benchmarks,
into one report.

A GPU is lent rarely and for minutes. This runs, in order:

1. the op and model tests (`GROUPS`; pytest in a process of its own, pytest-xdist workers, GPU
   memory preallocation off so that they share the device), each test's outcome written as it
   ends (`pytest_results`), so a run stopped by its time limit still reports what finished;
2. the quick parts of `accelerator_bench` at its "check" sizes (attention at 16k, the bf16
   training step, the first step's compile time at 2, 8 and 16 layers).

and writes <out_dir>/check.md: the device, pass / fail / skip counts per group, every failure
with its assertion message, the slowest tests, and the benchmark's report (accelerator.md and
accelerator.csv beside it), rewritten after each stage. `tests` instead of the groups reruns
chosen tests (a failure's node id). On a CPU it runs too (the benchmark at "tiny" sizes): the
check of the check.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

from experiments.benchmarking import accelerator_bench, pytest_results, report

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The tests of linear_transformers.ops, and of the modules and models built on them. The
# experiments' own tests (data, trainer, command lines, processes) are the CPU's.
OP_TESTS = (
    "test_attention_layouts.py",
    "test_causal_linear.py",
    "test_chunk_segments.py",
    "test_ctc.py",
    "test_default_precision.py",
    "test_fla_parity.py",
    "test_gated_linear_attention.py",
    "test_kv_cache_blocks.py",
    "test_linear_and_softmax_ops.py",
    "test_linformer_attention.py",
    "test_lsh_attention.py",
    "test_masked_rows.py",
    "test_memory.py",
    "test_mixture.py",
    "test_op_errors.py",
    "test_softmax_choice.py",
    "test_softmax_chunked.py",
    "test_state_passing_ops.py",
)
MODEL_TESTS = (
    "test_acoustic.py",
    "test_attention_layer.py",
    "test_attention_options.py",
    "test_builder_kwargs.py",
    "test_family_kinds.py",
    "test_fast_transformers_interop.py",
    "test_image_generator.py",
    "test_layer_stack.py",
    "test_library_input_checks.py",
    "test_module_errors.py",
    "test_packed_sequences.py",
    "test_precision.py",
    "test_prefill.py",
    "test_public_api.py",
    "test_seq2seq.py",
    "test_transformer.py",
)
GROUPS = {"ops": OP_TESTS, "models": MODEL_TESTS}
MAX_WORKERS = 14  # a 16-core host: two cores for the controller and the compiler's own threads


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    groups: tuple[str, ...] = tuple(GROUPS)
    tests: tuple[str, ...] = ()  # pytest node ids or files instead of the groups
    workers: int = 0  # 0: one per core but two, at most MAX_WORKERS
    test_minutes: float = 4.5
    bench_parts: tuple[str, ...] = ("attention", "train_step", "compile")
    bench_minutes: float = 2.5

    def __post_init__(self):
        unknown = [g for g in self.groups if g not in GROUPS]
        if unknown:
            raise ValueError(f"unknown test groups {unknown}; expected some of {sorted(GROUPS)}.")
        if not self.groups and not self.tests:
            raise ValueError("nothing to test: give groups or tests.")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0: one per core), got {self.workers}.")
        for name in ("test_minutes", "bench_minutes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (0 skips the stage), got {getattr(self, name)}.")
        unknown = [p for p in self.bench_parts if p not in accelerator_bench.PARTS]
        if unknown:
            raise ValueError(
                f"unknown benchmark parts {unknown}; expected some of {accelerator_bench.PARTS}."
            )


def workers(requested: int) -> int:
    return requested or max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 2))


def test_targets(opts: CheckOptions) -> list[str]:
    if opts.tests:
        return list(opts.tests)
    return [f"tests/{name}" for group in opts.groups for name in GROUPS[group]]


def group_of(nodeid: str) -> str:
    name = nodeid.split("::")[0].removeprefix("tests/")
    return next((g for g, files in GROUPS.items() if name in files), "other")


def run_tests(
    targets: list[str], num_workers: int, timeout_s: float, out_dir: pathlib.Path, log=print
) -> dict:
    """pytest on `targets` in a process of its own, stopped after `timeout_s`: {"records":
    [one per test outcome], "collected" (None if collection did not finish), "seconds",
    "returncode", "timed_out", "log"}."""
    results = out_dir / "test_results.jsonl"
    results.unlink(missing_ok=True)
    env = {
        **os.environ,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        pytest_results.RESULTS_VARIABLE: str(results),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-o",
        "addopts=",
        "-p",
        "no:cacheprovider",
        "-p",
        "experiments.benchmarking.pytest_results",
        "-m",
        "not slow",
        "-q",
        "-rfE",
        "--tb=short",
        "-n",
        str(num_workers),
        "--dist",
        "loadfile",
        *targets,
    ]
    log(f"tests: {' '.join(command[2:])}")
    start = time.perf_counter()
    with open(out_dir / "tests.log", "w") as output:
        try:
            process = subprocess.run(
                command, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=timeout_s
            )
            returncode, timed_out = process.returncode, False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
    lines = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    collected = next((r["collected"] for r in lines if "collected" in r), None)
    return {
        "records": [r for r in lines if "nodeid" in r],
        "collected": collected,
        "seconds": time.perf_counter() - start,
        "returncode": returncode,
        "timed_out": timed_out,
        "log": out_dir / "tests.log",
    }


def outcomes(records: list[dict]) -> dict[str, str]:
    """Each test's outcome: "failed" if any phase failed (a teardown error too), else "skipped"
    if it was skipped, else "passed"."""
    by_test: dict[str, str] = {}
    for r in records:
        now = by_test.get(r["nodeid"])
        if r["outcome"] == "failed" or now == "failed":
            by_test[r["nodeid"]] = "failed"
        elif r["outcome"] == "skipped" or now == "skipped":
            by_test[r["nodeid"]] = "skipped"
        else:
            by_test[r["nodeid"]] = "passed"
    return by_test


def counts(records: list[dict]) -> list[dict]:
    table: dict[str, dict] = {}
    for nodeid, outcome in outcomes(records).items():
        row = table.setdefault(
            group_of(nodeid), {"group": group_of(nodeid), "passed": 0, "failed": 0, "skipped": 0}
        )
        row[outcome] += 1
    rows = list(table.values())
    if rows:
        rows.append({"group": "all", **{k: sum(r[k] for r in rows) for k in ("passed", "failed", "skipped")}})
    return rows


def assertion(message: str, max_lines: int = 20) -> str:
    """The lines of a failure's report that say what went wrong: pytest's "E " lines (the
    assertion and its values), else the report's last lines."""
    lines = message.splitlines()
    said = [line for line in lines if line.startswith("E ")]
    return "\n".join((said or lines)[-max_lines:])


def write_report(
    out_dir: pathlib.Path,
    machine: dict,
    opts: CheckOptions,
    tests: dict | None,
    bench: dict | None,
    elapsed_s: float,
) -> pathlib.Path:
    lines = [
        "# Accelerator check",
        "",
        f"**Device:** {machine['device_kind']} (platform {machine['platform']}, {machine['num_devices']} "
        f"device(s)); jax {machine['jax']}, jaxlib {machine['jaxlib']}, flax {machine['flax']}; host "
        f"{machine['host']} ({machine['host_cpus']} CPUs). {elapsed_s:.0f} s so far.",
        "",
        "## Tests",
        "",
    ]
    if tests is None:
        lines.append("(not run)")
    else:
        stopped = (
            f"stopped at its limit of {opts.test_minutes:g} minutes"
            if tests["timed_out"]
            else f"exit status {tests['returncode']}"
        )
        finished = len(outcomes(tests["records"]))
        collected = "?" if tests["collected"] is None else tests["collected"]
        lines += [
            f"pytest on {len(test_targets(opts))} files or tests, {workers(opts.workers)} workers, "
            f"XLA_PYTHON_CLIENT_PREALLOCATE=false: {finished} of {collected} tests finished in "
            f"{tests['seconds']:.0f} s, {stopped}.",
            "",
            report.markdown_table(counts(tests["records"]), ["group", "passed", "failed", "skipped"])
            if tests["records"]
            else "(no test finished)",
        ]
        failed = [r for r in tests["records"] if r["outcome"] == "failed"]
        if failed:
            lines += ["", "### Failures", ""]
            for r in failed:
                lines += [
                    f"**{r['nodeid']}** ({r['when']}, {r['duration_s']:.1f} s)",
                    "",
                    "```",
                    assertion(r["message"]),
                    "```",
                    "",
                ]
        slowest = sorted(tests["records"], key=lambda r: -r["duration_s"])[:10]
        if slowest:
            lines += [
                "",
                "### Slowest",
                "",
                report.markdown_table(slowest, ["nodeid", "when", "outcome", "duration_s"]),
            ]
    lines += ["", "## Benchmarks", ""]
    if bench is None:
        lines.append("(not run)")
    else:
        body = pathlib.Path(bench["files"]["md"]).read_text().splitlines()
        lines += ["#" + line if line.startswith("#") else line for line in body[1:]]
    path = out_dir / "check.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def check_test_tools() -> None:
    """The tests run under pytest with pytest-xdist (the `dev` extra): say so before any work."""
    missing = [name for name in ("pytest", "xdist") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"the accelerator check runs the tests with pytest and pytest-xdist, and cannot import "
            f'{", ".join(missing)}: install the dev extra (pip install -e ".[dev]"), or pass '
            f"--test_minutes=0 for the benchmarks alone."
        )


def run(opts: CheckOptions, out_dir, *, log=print) -> dict:
    if opts.test_minutes:
        check_test_tools()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = accelerator_bench.describe_machine()
    start = time.perf_counter()
    tests = bench = None

    def write():
        return write_report(out_dir, machine, opts, tests, bench, time.perf_counter() - start)

    write()
    if opts.test_minutes:
        tests = run_tests(test_targets(opts), workers(opts.workers), opts.test_minutes * 60, out_dir, log=log)
        write()
        log(f"tests: {counts(tests['records'])[-1:] or 'none finished'} in {tests['seconds']:.0f} s")
    if opts.bench_minutes and opts.bench_parts:
        sizes = "tiny" if machine["platform"] == "cpu" else "check"
        bench_opts = accelerator_bench.AcceleratorBenchOptions(
            sizes=sizes, parts=opts.bench_parts, max_minutes=opts.bench_minutes
        )
        bench = accelerator_bench.run_and_report(bench_opts, out_dir, log=log)
    path = write()
    log(f"wrote {path}")
    return {"tests": tests, "bench": bench, "report": path}
