"""A resumed run is the same run in metrics.jsonl and samples/: its train records equal the
uninterrupted run's (the logging window travels in the checkpoint), and an evaluation or a
sample grid due at the checkpoint's step that the stopped run never wrote is written on resume,
never twice. Stops are real: a SIGKILLed `python -m experiments.train`, SIGTERM and a double
SIGINT delivered to this process, an exception. `steps_per_sec` and `wall_time` are timings,
the only fields compared loosely.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from configs import copy as copy_config
from configs import digits
from experiments import tasks
from experiments.training import interrupts
from experiments.training.checkpoints import MANIFEST, _file_hashes
from experiments.training.metrics import TRAIN_RECORD_KEYS, read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A checkpoint at step 6 is mid-window (log lines at 4 and 8) and step 6 evaluates and samples.
KILLED = "smoke,num_steps=8,log_every=4,checkpoint_every=6,eval_every=3,sample_every=6,dropout=0.1"


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """One persistent compilation cache for this module's subprocesses (a cached executable is
    the compiled one: the numbers do not change). Not for this process: a long-lived test
    worker that loads executables from a persistent cache has crashed (a segfault in JAX's
    cache read) after many other compilations."""
    return tmp_path_factory.mktemp("jax_cache")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _digits(data_dir, arg):
    config = digits.get_config(arg)
    config.data_dir = data_dir
    return config


def _exact(records):
    """The records without their timings."""
    return [{k: v for k, v in r.items() if k not in TRAIN_RECORD_KEYS} for r in records]


def _check_timings(records):
    for r in records:
        if "wall_time" in r:
            assert r["steps_per_sec"] > 0 and r["wall_time"] > 0, r
    wall = [r["wall_time"] for r in records if "wall_time" in r]
    assert wall == sorted(wall), wall  # carried over the resume, never restarted


# Python's SIGKILL of itself right after checkpoint KILL_AFTER_CHECKPOINT is saved: before that
# step's evaluation and samples, with no cleanup of any kind.
_KILLED_AFTER_CHECKPOINT = """
import os, runpy, signal, sys
from experiments.training import checkpoints

save = checkpoints.Checkpointer.save

def save_then_die(self, step, state):
    save(self, step, state)
    if step == int(os.environ["KILL_AFTER_CHECKPOINT"]):
        os.kill(os.getpid(), signal.SIGKILL)

checkpoints.Checkpointer.save = save_then_die
sys.argv = ["experiments.train", *sys.argv[1:]]
runpy.run_module("experiments.train", run_name="__main__")
"""


@pytest.mark.usefixtures("float32_products")  # an identity; the child's precision is pinned below
def test_a_run_sigkilled_after_a_mid_window_checkpoint_logs_evaluates_and_samples_as_if_never_stopped(
    data_dir, compile_cache, tmp_path
):
    tasks.train_and_evaluate(_digits(data_dir, KILLED), tmp_path / "straight")
    straight = read_metrics(tmp_path / "straight")

    workdir = tmp_path / "run"
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            _KILLED_AFTER_CHECKPOINT,
            f"--config=configs/digits.py:{KILLED}",
            f"--config.data_dir={data_dir}",
            f"--workdir={workdir}",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "KILL_AFTER_CHECKPOINT": "6",
            "JAX_DEFAULT_MATMUL_PRECISION": "highest",
            "JAX_COMPILATION_CACHE_DIR": str(compile_cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # What the kill left: checkpoint 6, step 6 neither evaluated nor sampled.
    assert (workdir / "checkpoints" / "6").is_dir()
    assert [r["step"] for r in read_metrics(workdir)] == [3, 4]
    assert not (workdir / "samples" / "step_0000006.png").exists()

    tasks.train_and_evaluate(_digits(data_dir, KILLED), workdir)
    resumed = read_metrics(workdir)
    # Record by record: step 8's line is the mean over steps 5-8, not 7-8; step 6's evaluation
    # is there once.
    assert _exact(resumed) == _exact(straight)
    _check_timings(resumed)
    for step in (6, 8):
        name = f"samples/step_{step:07d}.png"
        assert (workdir / name).read_bytes() == (tmp_path / "straight" / name).read_bytes()


def _stop(how, at):
    """A step_callback that stops the run after step `at`: a real SIGTERM (the loop stops after
    the step with a checkpoint of it), a real SIGINT twice (the second raises in the callback:
    the state in hand is saved), or an exception (the last periodic checkpoint stays)."""

    def callback(step, metrics):
        if step != at:
            return
        if how == "crash":
            raise RuntimeError("crash")
        for signum in (signal.SIGTERM,) if how == "SIGTERM" else (signal.SIGINT, signal.SIGINT):
            os.kill(os.getpid(), signum)
            time.sleep(0.02)  # two signals sent at once could be handled as one

    return callback


# (config, how the run is stopped, after which step, the checkpoint it resumes from). Each
# resumed checkpoint is mid-window.
CASES = {
    "SIGTERM-log4": ("smoke,num_steps=8,log_every=4,checkpoint_every=0,eval_every=3", "SIGTERM", 5, 5),
    "SIGINT-twice-log4": ("smoke,num_steps=8,log_every=4,checkpoint_every=0,eval_every=3", "SIGINT2", 7, 7),
    # Checkpoint 3 evaluated before the crash: its record is kept, not written twice.
    "crash-log4-ckpt3-eval3": (
        "smoke,num_steps=8,log_every=4,checkpoint_every=3,eval_every=3",
        "crash",
        5,
        3,
    ),
    "crash-log3-ckpt2": ("smoke,num_steps=8,log_every=3,checkpoint_every=2,eval_every=0", "crash", 5, 4),
    "crash-log0-ckpt3-eval4": (
        "smoke,num_steps=8,log_every=0,checkpoint_every=3,eval_every=4",
        "crash",
        7,
        6,
    ),
}


@pytest.mark.parametrize("case", CASES, ids=CASES)
def test_a_run_resumed_mid_window_logs_the_uninterrupted_runs_metrics(
    data_dir, compile_cache, tmp_path, case
):
    arg, how, at, resumed_from = CASES[case]
    config = _digits(data_dir, arg + ",sample_every=0,dropout=0.1")
    tasks.train_and_evaluate(config, tmp_path / "straight")
    straight = read_metrics(tmp_path / "straight")

    stopped = {"crash": RuntimeError, "SIGTERM": interrupts.Interrupted, "SIGINT2": KeyboardInterrupt}[how]
    with pytest.raises(stopped):
        tasks.train_and_evaluate(config, tmp_path / "run", step_callback=_stop(how, at))
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == resumed_from
    tasks.train_and_evaluate(config, tmp_path / "run")
    resumed = read_metrics(tmp_path / "run")
    assert _exact(resumed) == _exact(straight)
    _check_timings(resumed)


def test_the_copy_tasks_window_sums_survive_a_mid_window_resume(compile_cache, tmp_path):
    # Its train_token_accuracy is a ratio of sums over the window: both sums travel.
    config = copy_config.get_config("smoke,num_steps=6,log_every=3,checkpoint_every=0,eval_every=0")
    tasks.train_and_evaluate(config, tmp_path / "straight")
    with pytest.raises(interrupts.Interrupted):
        tasks.train_and_evaluate(config, tmp_path / "run", step_callback=_stop("SIGTERM", 4))
    tasks.train_and_evaluate(config, tmp_path / "run")
    resumed = read_metrics(tmp_path / "run")
    assert _exact(resumed) == _exact(read_metrics(tmp_path / "straight"))
    assert all("train_token_accuracy" in r for r in resumed if "loss" in r)


def test_a_checkpoint_without_a_logging_window_still_resumes_with_a_warning(
    data_dir, compile_cache, tmp_path, caplog
):
    config = _digits(data_dir, "smoke,num_steps=8,log_every=4,checkpoint_every=3,eval_every=0,sample_every=0")
    losses = []
    tasks.train_and_evaluate(
        config, tmp_path / "straight", step_callback=lambda s, m: losses.append(float(m["loss"]))
    )
    with pytest.raises(RuntimeError):
        tasks.train_and_evaluate(config, tmp_path / "run", step_callback=_stop("crash", 5))
    # Checkpoint 3 as a version that saved no window wrote it, its checksums made to match.
    step_dir = tmp_path / "run" / "checkpoints" / "3"
    metadata_file = step_dir / "_CHECKPOINT_METADATA"
    metadata = json.loads(metadata_file.read_text())
    assert "log_window" in metadata["custom_metadata"]
    metadata["custom_metadata"] = {}
    metadata_file.write_text(json.dumps(metadata))
    (step_dir / MANIFEST).write_text(json.dumps(_file_hashes(step_dir)))

    resumed = []
    with caplog.at_level("WARNING"):
        tasks.train_and_evaluate(
            config, tmp_path / "run", step_callback=lambda s, m: resumed.append(float(m["loss"]))
        )
    assert "checkpoint step 3 in" in caplog.text
    assert "holds no logging window (written before checkpoints held it)" in caplog.text
    assert losses[:3] + resumed == losses  # the state itself restored exactly
    # Step 4's line covers step 4 alone, as the warning says; step 8's is whole again.
    train = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert train[4] == losses[3]
    assert train[8] == {r["step"]: r["loss"] for r in read_metrics(tmp_path / "straight") if "loss" in r}[8]
