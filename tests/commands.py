"""Running the project's commands as users do, in a process of their own, and what a refused
command must print: one line, no traceback."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_module(*args, env_extra=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = result.stderr.strip().splitlines()
    return result.returncode, lines[-1] if lines else "", result.stderr


def assert_one_line(rc, last, stderr, message):
    assert rc == 1, stderr[-3000:]
    assert message in last, stderr[-3000:]
    assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr[-3000:]
