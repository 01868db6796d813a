"""tests/multidevice on 8 host CPU devices, in a subprocess (the device count is fixed when JAX
starts, so this process cannot provide them); every test there must pass, none skip."""

import os
import pathlib
import re
import subprocess
import sys

import experiments

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_DEVICES = 8


def _tail(text, chars=6000):
    return text if len(text) <= chars else "...\n" + text[-chars:]


def test_multidevice_tests_pass_on_eight_host_devices():
    env = dict(os.environ, XLA_FLAGS=experiments.with_host_devices(NUM_DEVICES), JAX_PLATFORMS="cpu")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "tests/multidevice",
    ]
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise AssertionError(f"tests/multidevice timed out after {e.timeout} s:\n{_tail(out)}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"tests/multidevice on {NUM_DEVICES} devices exited with {proc.returncode}:\n{_tail(output)}"
    )
    # The summary line, e.g. "57 passed, 2 warnings in 40.1s". A vacuous run (nothing collected,
    # or everything skipped because the devices were missing) must not pass.
    summaries = [line for line in proc.stdout.splitlines() if re.search(r"\d+ passed", line)]
    assert summaries, f"no test passed in tests/multidevice:\n{_tail(output)}"
    summary = summaries[-1]
    for word in ("skipped", "failed", "error", "xfailed", "xpassed"):
        assert word not in summary, f"tests/multidevice: {summary!r}\n{_tail(output)}"
