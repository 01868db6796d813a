"""The check of an accelerator, in one run: the op and model tests, then the quick benchmarks,
into one report.

A GPU is lent rarely and for minutes. This runs, in order:

1. the op and model tests (`GROUPS`; pytest in a process of its own, pytest-xdist workers, GPU
   memory preallocation off so that they share the device), each test's outcome written as it
   ends (`pytest_results`), so a run stopped by its time limit still reports what finished;
2. the quick parts of `accelerator_bench` at its "check" sizes (the Pallas kernel against XLA's
   chunked form, cuDNN and the memory roof at 16k; attention at 16k, the bf16 training step,
   the first step's compile time at 2, 8 and 16 layers).

and writes <out_dir>/check.md: the device, pass / fail / skip counts per group, every failure
with its assertion message, the slowest tests, and the benchmark's report (accelerator.md and
accelerator.csv beside it), rewritten after each stage. `tests` instead of the groups reruns
chosen tests (a failure's node id). On a CPU it runs too (the benchmark at "tiny" sizes): the
check of the check.
"""

from __future__ import annotations

import collections
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
# The tests of linear_transformers, by layer: the ops and the attention layers on them, then the
# models and the README's examples (whose claims hold at the device's default products). The
# experiments' own tests (tests/experiments: data, trainer, command lines, processes) are the CPU's.
GROUPS = {
    "ops": ("tests/ops", "tests/attention"),
    "models": ("tests/models", "tests/test_public_api.py", "tests/test_readme.py"),
}
OUTCOMES = ("passed", "failed", "skipped")
MAX_WORKERS = 14  # a 16-core host: two cores for the controller and the compiler's own threads


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    """What `run` checks.

    groups: Test groups (accelerator_check.GROUPS).
    tests: Tests (files or node ids) to run instead of the groups.
    tests_from: A file of tests (files or node ids), one per line, to run instead of the groups
        (read into `tests`).
    workers: pytest-xdist workers (0: one per core but two, at most 14).
    test_minutes: The tests stop after this many minutes (0: none).
    bench_parts: benchmark_accelerator parts to run after them.
    bench_minutes: The benchmarks' limit in minutes (0: none).
    """

    groups: tuple[str, ...] = tuple(GROUPS)
    tests: tuple[str, ...] = ()
    tests_from: str | None = None
    workers: int = 0
    test_minutes: float = 4.5
    bench_parts: tuple[str, ...] = ("kernel", "attention", "train_step", "compile")
    bench_minutes: float = 3.0

    def __post_init__(self):
        if self.tests_from:
            with open(self.tests_from) as f:  # node ids may hold commas and spaces: a line each
                lines = tuple(line.strip() for line in f if line.strip())
            object.__setattr__(self, "tests", self.tests + lines)
            object.__setattr__(self, "tests_from", None)
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
    return [path for group in opts.groups for path in GROUPS[group]]


def group_of(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return next((g for g, paths in GROUPS.items() if any(path.startswith(p) for p in paths)), "other")


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
        *(sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider"),
        *("-p", "experiments.benchmarking.pytest_results", "-m", "not slow", "-q", "-rfE", "--tb=short"),
        *("-n", str(num_workers), "--dist", "loadfile", *targets),
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
    rank = {"skipped": 1, "failed": 2}  # any other outcome counts as passed
    by_test: dict[str, str] = {}
    for r in records:
        now = by_test.get(r["nodeid"], "passed")
        by_test[r["nodeid"]] = max(now, r["outcome"], key=lambda outcome: rank.get(outcome, 0))
    return by_test


def counts(records: list[dict]) -> list[dict]:
    """Per group (in the order of their first test), then for "all": the tests of each outcome."""
    found = collections.Counter((group_of(nodeid), o) for nodeid, o in outcomes(records).items())
    rows = [{"group": g, **{o: found[g, o] for o in OUTCOMES}} for g in dict.fromkeys(g for g, _ in found)]
    return rows + [{"group": "all", **{o: sum(r[o] for r in rows) for o in OUTCOMES}}] if rows else []


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
    lines = ["# Accelerator check", "", f"{accelerator_bench.device_line(machine)} {elapsed_s:.0f} s so far."]
    lines += ["", "## Tests", ""] + (["(not run)"] if tests is None else _test_lines(opts, tests))
    lines += ["", "## Benchmarks", ""]
    if bench is None:
        lines.append("(not run)")
    else:
        body = pathlib.Path(bench["files"]["md"]).read_text().splitlines()
        lines += ["#" + line if line.startswith("#") else line for line in body[1:]]
    path = out_dir / "check.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _test_lines(opts: CheckOptions, tests: dict) -> list[str]:
    """The report's test section: what ran, the counts, every failure, the slowest tests."""
    stopped = (
        f"stopped at its limit of {opts.test_minutes:g} minutes"
        if tests["timed_out"]
        else f"exit status {tests['returncode']}"
    )
    finished = len(outcomes(tests["records"]))
    collected = "?" if tests["collected"] is None else tests["collected"]
    lines = [
        f"pytest on {len(test_targets(opts))} files or tests, {workers(opts.workers)} workers, "
        f"XLA_PYTHON_CLIENT_PREALLOCATE=false: {finished} of {collected} tests finished in "
        f"{tests['seconds']:.0f} s, {stopped}.",
        "",
        report.markdown_table(counts(tests["records"]), ["group", *OUTCOMES])
        if tests["records"]
        else "(no test finished)",
    ]
    failed = [r for r in tests["records"] if r["outcome"] == "failed"]
    if failed:
        lines += ["", "### Failures", ""]
        for r in failed:
            heading = f"**{r['nodeid']}** ({r['when']}, {r['duration_s']:.1f} s)"
            lines += [heading, "", "```", assertion(r["message"]), "```", ""]
    slowest = sorted(tests["records"], key=lambda r: -r["duration_s"])[:10]
    if slowest:
        table = report.markdown_table(slowest, ["nodeid", "when", "outcome", "duration_s"])
        lines += ["", "### Slowest", "", table]
    return lines


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
