"""The command-line programs and the trainer refuse bad input in one line naming it: unknown or
ill-typed flags and config fields, training data outside a task's classes; a checkpointer keeps the
newest checkpoint whatever it is told."""

import re
import subprocess
import sys

import numpy as np
import pytest
from commands import ROOT, assert_one_line, run_module

from configs import digits
from experiments import tasks
from experiments.tasks import copy, speech
from experiments.training import variants

SMOKE = "configs/digits.py:smoke,num_steps=2,eval_every=0,sample_every=0"


@pytest.mark.parametrize(
    "module, args, message",
    [
        ("experiments.sample", ["--workdir=w", "extra"], "sample: error: unexpected arguments ['extra']"),
        ("experiments.copy_comparison", ["--runs=decoder/nope"], "copy_comparison: error: "),
        (
            "experiments.mqar_comparison",
            ["--num_kv_pairs=50"],
            "mqar_comparison: error: --num_kv_pairs=50: config.seq_len=128 must hold the 50 pairs",
        ),
    ],
)
def test_every_command_refuses_a_stray_argument_or_a_bad_flag_in_one_line(module, args, message):
    """A positional argument was ignored by the commands that do not read one; the comparisons
    printed a traceback for a bad run name."""
    assert_one_line(*run_module(module, *args), message)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A workdir with checkpoints 2 and 4 (the digits ship with scikit-learn: no download)."""
    workdir = tmp_path_factory.mktemp("trained")
    config = digits.get_config("smoke,num_steps=4,checkpoint_every=2,eval_every=0,sample_every=0")
    config.data_dir = str(tmp_path_factory.mktemp("tfds"))
    tasks.train_and_evaluate(config, workdir)
    return workdir


B, T, S, H, D = 2, 5, 7, 2, 4


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
    # The model's keys explain the mismatch; data_dir (changed too) may change on a resume.
    assert "differs in model.model_dim: 16 -> 32." in last and "data_dir" not in last
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


def test_the_image_trainer_refuses_data_outside_the_classes(monkeypatch):
    from configs import digits
    from experiments.data import pipeline
    from experiments.tasks.image_generation import load_split

    images = np.zeros((4, 8, 8, 1), np.uint16)
    images[2, 3, 3, 0] = 300
    monkeypatch.setattr(pipeline, "load_images", lambda *args, **kwargs: images)
    config = digits.get_config("smoke")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "split 'train' of 'digits' has sub-pixel values in [0, 300]; the model takes [0, 17)"
        ),
    ):
        load_split(config, "train")
    images[2, 3, 3, 0] = 16
    assert load_split(config, "train").shape == (4, 64)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_checkpointer_always_keeps_the_newest_checkpoint(tmp_path, bad):
    from experiments.training.checkpoints import Checkpointer

    with pytest.raises(
        ValueError,
        match=re.escape(
            f"max_to_keep must be an int >= 1 (the newest checkpoint is always kept), got {bad!r}"
        ),
    ):
        Checkpointer(tmp_path / "checkpoints", max_to_keep=bad)


def test_an_attention_kind_given_to_the_lstm_is_refused_not_ignored():
    config = variants.apply(speech.schema(), "smoke,lstm", speech.VARIANTS)
    speech.Speech(config).check()  # the LSTM as its variant makes it
    config.model.attention = "gla"
    with pytest.raises(
        ValueError, match=r"config.model.attention='gla' .* does nothing with config.architecture='lstm'"
    ):
        speech.Speech(config).check()


def test_a_size_named_after_the_variant_that_read_it_is_refused_not_silently_stale():
    after = variants.apply(copy.schema(), "smoke,variable_length", copy.VARIANTS)
    assert after.examples_per_step == 51  # 85% of the smoke size's rows
    for late in ("smoke", "max_length=32"):
        with pytest.raises(
            ValueError, match=rf"config variant '{late}' changes .* which 'variable_length' before"
        ):
            variants.apply(copy.schema(), f"variable_length,{late}", copy.VARIANTS)
