"""The command lines end a user's mistake with one line saying what is wrong and what to do."""

import os
import pathlib
import subprocess
import sys

import pytest

from configs import digits
from experiments import tasks

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE = "configs/digits.py:smoke,num_steps=2,eval_every=0,sample_every=0"


def run_module(*args, env_extra=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env_extra or {})}
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = result.stderr.strip().splitlines()
    return result.returncode, lines[-1] if lines else "", result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir with checkpoints 2 and 4 (the digits ship with scikit-learn: no download)."""
    workdir = tmp_path_factory.mktemp("trained")
    config = digits.get_config("smoke,num_steps=4,checkpoint_every=2,eval_every=0,sample_every=0")
    config.data_dir = str(tmp_path_factory.mktemp("tfds"))
    tasks.train_and_evaluate(config, workdir)
    return workdir


def assert_one_line(rc, last, stderr, message):
    assert rc == 1, stderr[-3000:]
    assert message in last, stderr[-3000:]
    assert "Traceback" not in stderr and "Event loop is closed" not in stderr, stderr[-3000:]


def test_a_missing_config_file(tmp_path):
    rc, last, err = run_module("experiments.train", "--config=configs/nope.py:smoke", f"--workdir={tmp_path}")
    assert_one_line(
        rc,
        last,
        err,
        "train: error: config file 'configs/nope.py' (--config) does not exist; the configs are configs/{",
    )


def test_a_workdir_that_is_a_file(tmp_path):
    (tmp_path / "w").write_text("")
    rc, last, err = run_module("experiments.train", f"--config={SMOKE}", f"--workdir={tmp_path / 'w'}")
    assert_one_line(rc, last, err, "is a file, not a directory; pass a directory")


def test_a_config_value_of_the_wrong_sign(tmp_path):
    rc, last, err = run_module(
        "experiments.train", f"--config={SMOKE}", "--config.batch_size=-3", f"--workdir={tmp_path}"
    )
    assert_one_line(rc, last, err, "train: error: config.batch_size must be >= 1, got -3.")


def test_a_workdir_in_use_by_another_run(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from experiments.training.workdir_lock import WorkdirLock\n"
            "WorkdirLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\n"
            "time.sleep(120)",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, last, err = run_module("experiments.train", f"--config={SMOKE}", f"--workdir={tmp_path}")
    finally:
        holder.kill()
        holder.wait()
    assert_one_line(rc, last, err, f"is in use by another training run (pid {holder.pid} on ")


def test_damaged_checkpoints_without_checksums(trained, tmp_path):
    # Orbax itself reads the damaged bytes here (no manifest to check them against first).
    import shutil

    workdir = tmp_path / "w"
    shutil.copytree(trained, workdir)
    for step_dir in (workdir / "checkpoints").iterdir():
        if step_dir.name.isdigit():
            (step_dir / "checksums.json").unlink()
            for path in step_dir.rglob("d/*"):
                path.write_bytes(path.read_bytes()[:20])
    config = "configs/digits.py:smoke,num_steps=4,checkpoint_every=2,eval_every=0,sample_every=0"
    rc, last, err = run_module(
        "experiments.train",
        f"--config={config}",
        f"--config.data_dir={tmp_path / 'tfds'}",
        f"--workdir={workdir}",
    )
    assert_one_line(rc, last, err, "train: error: no intact checkpoint in ")
    assert "checkpoint step 4" in last and "checkpoint step 2" in last and "moved to" in last


def test_resuming_with_another_model_names_the_keys_that_differ_and_nothing_else(trained, tmp_path):
    import shutil

    workdir = tmp_path / "w"
    shutil.copytree(trained, workdir)
    config = "configs/digits.py:smoke,num_steps=4,checkpoint_every=2,eval_every=0,sample_every=0"
    rc, last, err = run_module(
        "experiments.train",
        f"--config={config}",
        "--config.model.model_dim=32",
        f"--config.data_dir={tmp_path / 'tfds'}",
        f"--workdir={workdir}",
    )
    assert_one_line(rc, last, err, "train: error: cannot restore checkpoint step 4 ")
    assert "differs in data_dir: " in last and "model.model_dim: 16 -> 32" in last
    # No reports of array reads left behind (the mismatch is found before any is read).
    assert "Exception ignored" not in err and "TensorStore" not in err, err[-3000:]


def test_sampling_a_step_that_does_not_exist(trained):
    rc, last, err = run_module("experiments.sample", f"--workdir={trained}", "--step=7")
    assert_one_line(rc, last, err, "sample: error: there is no checkpoint step 7 in ")
    assert "its steps are [2, 4]" in last


def test_sampling_a_workdir_with_a_broken_config_json(trained, tmp_path):
    import shutil

    workdir = tmp_path / "w"
    shutil.copytree(trained, workdir)
    (workdir / "config.json").write_text('{"dataset": "digits", ')
    rc, last, err = run_module("experiments.sample", f"--workdir={workdir}")
    assert_one_line(rc, last, err, "config.json is not a valid config (")
    assert "re-run training with the run's config to rewrite it" in last
    rc, last, err = run_module("experiments.sample", f"--workdir={tmp_path / 'nowhere'}")
    assert_one_line(rc, last, err, "is not a directory: --workdir must be a directory written by")
