"""A pytest plugin that appends each test's outcome to a JSON-lines file as the test ends.

Why not `--junitxml`: a run stopped by its time limit writes no XML, and the check of a lent
GPU (`accelerator_check`) must report whatever finished before its lease ran out. Loaded with
`-p experiments.benchmarking.pytest_results`; writes to the file named by RESULTS_VARIABLE (none
set: nothing is written). Under pytest-xdist only the controller writes (its workers' reports
reach it).
"""

from __future__ import annotations

import json
import os

RESULTS_VARIABLE = "LT_TEST_RESULTS"
MESSAGE_CHARS = 4000  # the end of a failure's report: the assertion and the lines that led to it

_controller = True


def pytest_configure(config):
    global _controller
    _controller = not hasattr(config, "workerinput")


def _write(record: dict) -> None:
    path = os.environ.get(RESULTS_VARIABLE)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    """How many tests were collected, written once: by the run's only process, or by xdist's
    first worker (each worker collects them all; the controller none)."""
    config = session.config
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker == "gw0" or (worker is None and not config.pluginmanager.hasplugin("dsession")):
        _write({"collected": len(session.items)})


def pytest_runtest_logreport(report):
    if not _controller or (report.when != "call" and report.passed):
        return
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration_s": round(report.duration, 3),
    }
    if report.failed:
        record["message"] = report.longreprtext[-MESSAGE_CHARS:]
    elif report.skipped:
        longrepr = report.longrepr
        record["message"] = longrepr[-1] if isinstance(longrepr, tuple) else str(longrepr)
    _write(record)
