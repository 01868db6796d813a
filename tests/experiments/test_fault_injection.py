"""`python -m experiments.train` killed at seeded random moments by SIGINT, SIGTERM and SIGKILL,
re-run each time until it finishes: its per-step losses equal the uninterrupted run's.

The runs share a persistent compilation cache, so only the first one compiles (the cached
executables are the compiled ones, so the numbers are the same).
"""

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEED = 20261123
# A signal lands within half a second of a run's first new step (about 25 steps at ~20 ms a
# step on the 2-core CPU machine), so the three stops come well before step 120; the runs pass
# checkpoints (every 40 steps) to resume from and an evaluation (step 60) on the way.
NUM_STEPS = 120
CONFIG = (
    f"configs/digits.py:smoke,num_steps={NUM_STEPS},log_every=1,checkpoint_every=40,eval_every=60,"
    "sample_every=0,dropout=0.1"
)
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax_cache")
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def _command(workdir, data_dir):
    return [
        sys.executable,
        "-m",
        "experiments.train",
        f"--config={CONFIG}",
        f"--config.data_dir={data_dir}",
        f"--workdir={workdir}",
    ]


def _steps_logged(workdir) -> int:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _losses(workdir) -> list[tuple[int, float]]:
    records = [
        json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    ]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_runs_killed_at_random_moments_resume_to_the_uninterrupted_losses(tmp_path, environment):
    data_dir = tmp_path / "tfds"
    straight = subprocess.run(
        _command(tmp_path / "straight", data_dir),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    rng = random.Random(SEED)
    workdir = tmp_path / "interrupted"
    signals = [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    rng.shuffle(signals)
    delivered = []
    for signum in signals:
        logged = _steps_logged(workdir)
        process = subprocess.Popen(
            _command(workdir, data_dir),
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 300
        while _steps_logged(workdir) <= logged and process.poll() is None:
            assert time.monotonic() < deadline, "the run never started training"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))  # somewhere in a step, a checkpoint, an evaluation
        process.send_signal(signum)
        out, err = process.communicate(timeout=300)
        if process.returncode == 0:
            break  # finished before the signal landed: nothing left to interrupt
        assert process.returncode == EXIT_STATUS[signum], err[-3000:]
        if signum != signal.SIGKILL:
            assert f"{signum.name} received: stopped after step" in err.splitlines()[-1]
        delivered.append((signum.name, _steps_logged(workdir)))
    print("delivered (signal, steps logged):", delivered)
    assert len(delivered) == 3, delivered

    final = subprocess.run(
        _command(workdir, data_dir), cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600
    )
    assert final.returncode == 0, final.stderr[-3000:]
    expected = _losses(tmp_path / "straight")
    assert [step for step, _ in expected] == list(range(1, NUM_STEPS + 1))
    assert _losses(workdir) == expected, delivered
