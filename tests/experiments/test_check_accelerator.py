"""The accelerator check (`python -m experiments.check_accelerator`) on the CPU: its test stage
on a file of tests written here (a pass, a failure, a skip, and a run stopped by its limit), its
report, and which tests it runs."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

from experiments.benchmarking import accelerator_check

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUTCOMES = """
    import time
    import pytest

    def test_passes():
        assert 1 + 1 == 2

    def test_fails():
        got = 3
        assert got == 4, "three is not four"

    def test_is_skipped():
        pytest.skip("not here")
"""


def _tests(tmp_path, body=OUTCOMES):
    path = tmp_path / "test_outcomes.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_the_report_counts_every_outcome_and_says_why_a_test_failed(tmp_path):
    opts = accelerator_check.CheckOptions(tests=(_tests(tmp_path),), workers=1, bench_minutes=0)
    result = accelerator_check.run(opts, tmp_path / "out", log=lambda line: None)
    tests = result["tests"]
    assert not tests["timed_out"] and tests["returncode"] == 1 and tests["collected"] == 3
    assert accelerator_check.outcomes(tests["records"]) == {
        f"{tests['records'][0]['nodeid'].split('::')[0]}::test_{name}": outcome
        for name, outcome in (("passes", "passed"), ("fails", "failed"), ("is_skipped", "skipped"))
    }
    report = (tmp_path / "out" / "check.md").read_text()
    assert "3 of 3 tests finished" in report
    assert "| all | 1 | 1 | 1 |" in report
    assert "E   AssertionError: three is not four" in report and "E   assert 3 == 4" in report
    assert "## Benchmarks\n\n(not run)" in report


def test_a_run_stopped_by_its_limit_reports_what_finished(tmp_path):
    slow = OUTCOMES + "\n    def test_sleeps():\n        time.sleep(60)\n"
    opts = accelerator_check.CheckOptions(
        tests=(_tests(tmp_path, slow),), workers=1, test_minutes=0.25, bench_minutes=0
    )
    result = accelerator_check.run(opts, tmp_path / "out", log=lambda line: None)
    assert result["tests"]["timed_out"]
    assert len(accelerator_check.outcomes(result["tests"]["records"])) == 3  # all but the sleeper
    report = (tmp_path / "out" / "check.md").read_text()
    assert "3 of 4 tests finished" in report and "stopped at its limit of 0.25 minutes" in report


def test_every_test_of_the_library_alone_is_in_a_group():
    """A test file that imports the library and not `experiments` tests the library: the check
    runs it. The groups name only paths that exist."""
    grouped = [path for paths in accelerator_check.GROUPS.values() for path in paths]
    assert len(set(grouped)) == len(grouped)
    assert all((ROOT / path).exists() for path in grouped), grouped
    for path in (ROOT / "tests").rglob("test_*.py"):
        name = str(path.relative_to(ROOT))
        imports = {
            alias.name.split(".")[0]
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
        }
        # tests/multidevice needs 8 devices (test_multidevice.py runs it on host CPU devices).
        library_alone = "linear_transformers" in imports and "experiments" not in imports
        if library_alone and not name.startswith("tests/multidevice/"):
            group = accelerator_check.group_of(name)
            assert group != "other", f"{name} tests the library but is in no group of the check"


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"unknown test groups \['op'\]"):
        accelerator_check.CheckOptions(groups=("op",))
    with pytest.raises(ValueError, match="nothing to test"):
        accelerator_check.CheckOptions(groups=())
    with pytest.raises(ValueError, match=r"unknown benchmark parts \['attn'\]"):
        accelerator_check.CheckOptions(bench_parts=("attn",))


def test_the_command_names_its_backend_first_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.check_accelerator",
            f"--tests={_tests(tmp_path)}",
            "--workers=1",
            "--bench_minutes=0",
            f"--out_dir={out}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-2000:]
    assert process.stdout.splitlines()[0].startswith("JAX backend: cpu, 1 device")
    assert "| all | 1 | 1 | 1 |" in (out / "check.md").read_text()
