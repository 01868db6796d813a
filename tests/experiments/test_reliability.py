"""The trainers' guarantees, broken the way users break them: real signals delivered while a
step is in flight, a real second process holding the workdir, real damaged checkpoint bytes.

(tests/experiments/test_fault_injection.py adds SIGKILL and signals at random moments, in subprocesses.)
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from signal_senders import SignalWhileWaiting

from configs import digits
from experiments import tasks
from experiments.tasks.image_generation import ImageGeneration
from experiments.training import interrupts, trainer
from experiments.training import mesh as mesh_lib
from experiments.training.checkpoints import Checkpointer, CheckpointError, DamagedCheckpointError
from experiments.training.config_checks import ConfigTypeError
from experiments.training.metrics import read_metrics
from experiments.training.workdir_lock import WorkdirInUseError

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _smoke(data_dir, extra=""):
    config = digits.get_config(
        "smoke,num_steps=12,log_every=1,checkpoint_every=0,eval_every=0,"
        "sample_every=0,dropout=0.1,batch_size=64" + ("," + extra if extra else "")
    )
    config.data_dir = data_dir
    return config


@pytest.fixture(scope="module")
def straight(data_dir, tmp_path_factory):
    """The uninterrupted run of `_smoke`: (per-step losses, metrics records). Checkpointing
    options change neither, so every test compares with this one run."""
    workdir = tmp_path_factory.mktemp("straight")
    losses = []
    tasks.train_and_evaluate(
        _smoke(data_dir), workdir, step_callback=lambda s, m: losses.append(float(m["loss"]))
    )
    return losses, read_metrics(workdir)


@pytest.mark.parametrize(
    "signals",
    [(signal.SIGINT,), (signal.SIGTERM,), (signal.SIGINT, signal.SIGINT)],
    ids=["SIGINT", "SIGTERM", "SIGINT-twice"],
)
def test_a_signal_while_a_step_is_in_flight_resumes_exactly(data_dir, straight, tmp_path, signals):
    config = _smoke(data_dir)

    losses = []
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    sender = SignalWhileWaiting(signals, after=3, counter=losses)
    sender.start()
    expected = interrupts.Interrupted if len(signals) == 1 else KeyboardInterrupt
    try:
        with pytest.raises(expected):
            tasks.train_and_evaluate(
                # The loss array, not its value: reading it here would wait on the step in
                # flight in this callback, where the sender does not look.
                config,
                tmp_path / "run",
                step_callback=lambda s, m: losses.append(m["loss"]),
            )
    finally:
        sender.stop = True
    assert sender.sent_at_step is not None, "the signal was never sent while a step was in flight"
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the caller's, restored

    # The checkpoint's label and the step it holds agree, whatever moment the signal hit.
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints")
    saved = checkpointer.latest_step()
    assert saved is not None and saved >= 3
    run = trainer.Trainer(config, ImageGeneration(config), mesh_lib.make_mesh(config))
    assert int(checkpointer.restore(run.state)["step"]) == saved
    checkpointer.close()

    resumed = []
    tasks.train_and_evaluate(
        config, tmp_path / "run", step_callback=lambda s, m: resumed.append(float(m["loss"]))
    )
    # Bit-identical: no step applied twice or lost.
    assert [float(x) for x in losses[:saved]] + resumed == straight[0]


def test_the_copy_trainer_resumes_exactly_after_sigterm_mid_step(tmp_path):
    from configs import copy as copy_config

    config = copy_config.get_config(
        "smoke,num_steps=12,log_every=1,checkpoint_every=0,eval_every=0,dropout=0.1"
    )
    straight = []
    straight_result = tasks.train_and_evaluate(
        config, tmp_path / "straight", step_callback=lambda s, m: straight.append(float(m["loss"]))
    )
    losses = []
    sender = SignalWhileWaiting((signal.SIGTERM,), 3, losses)
    sender.start()
    try:
        with pytest.raises(interrupts.Interrupted, match="SIGTERM received: stopped after step"):
            tasks.train_and_evaluate(
                # The loss array, not its value: reading it here would wait on the step in
                # flight in this callback, where the sender does not look.
                config,
                tmp_path / "run",
                step_callback=lambda s, m: losses.append(m["loss"]),
            )
    finally:
        sender.stop = True
    assert sender.sent_at_step is not None
    saved = Checkpointer(tmp_path / "run" / "checkpoints").latest_step()
    resumed = []
    result = tasks.train_and_evaluate(
        config, tmp_path / "run", step_callback=lambda s, m: resumed.append(float(m["loss"]))
    )
    assert [float(x) for x in losses[:saved]] + resumed == straight
    assert result["eval_loss"] == straight_result["eval_loss"]


def test_metrics_past_the_resumed_checkpoint_are_dropped(data_dir, straight, tmp_path):
    # A run killed between checkpoints has logged steps the resumed run will log again.
    config = _smoke(data_dir, "checkpoint_every=4")

    def stop_at_9(step, metrics):
        if step == 9:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tasks.train_and_evaluate(config, tmp_path, step_callback=stop_at_9)
    # What a SIGKILL right after step 9's log line leaves: no checkpoint 9, a cut-off line.
    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "9")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 10, "loss": 1.')
    tasks.train_and_evaluate(config, tmp_path)
    drop = ("steps_per_sec", "wall_time")
    assert [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(tmp_path)] == [
        {k: v for k, v in r.items() if k not in drop} for r in straight[1]
    ]


# ---- A workdir belongs to one run ----

_HOLD_LOCK = """
import sys, time
from experiments.training.workdir_lock import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_locked_workdir_names_its_holder_and_a_dead_holder_does_not_block(data_dir, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            WorkdirInUseError,
            match=rf"in use by another training run \(pid "
            rf"{holder.pid} on .*, started",
        ):
            tasks.train_and_evaluate(_smoke(data_dir), tmp_path)
        assert not (tmp_path / "config.json").exists() and not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the lock file stays with the dead pid in it
        holder.wait()
    assert str(holder.pid) in (tmp_path / "run.lock").read_text()
    assert tasks.train_and_evaluate(_smoke(data_dir), tmp_path)["step"] == 12
    assert str(os.getpid()) in (tmp_path / "run.lock").read_text()


# ---- Checkpoints are verified ----


def _data_file(step_dir: pathlib.Path) -> pathlib.Path:
    """The largest array-data file of a checkpoint."""
    return max((p for p in step_dir.rglob("d/*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_a_byte(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_bytes_fall_back_to_the_newest_intact_checkpoint(data_dir, straight, tmp_path, caplog):
    config = _smoke(data_dir, "checkpoint_every=2,keep_checkpoints=3")

    losses = []

    def stop_at_6(step, metrics):
        losses.append(float(metrics["loss"]))
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tasks.train_and_evaluate(config, tmp_path / "run", step_callback=stop_at_6)
    _flip_a_byte(_data_file(tmp_path / "run" / "checkpoints" / "6"))

    resumed = []
    with caplog.at_level("WARNING"):
        tasks.train_and_evaluate(
            config, tmp_path / "run", step_callback=lambda s, m: resumed.append(float(m["loss"]))
        )
    log = caplog.text
    assert "checkpoint step 6" in log and "is damaged: files whose bytes changed" in log
    assert "resuming from checkpoint step 4, the newest intact one" in log
    assert (tmp_path / "run" / "damaged_checkpoints" / "6").is_dir()
    assert losses[:4] + resumed == straight[0]
    assert 12 in Checkpointer(tmp_path / "run" / "checkpoints").all_steps()


def _small_checkpoints(directory, steps=(1, 2)):
    state = {"step": jnp.int32(0), "w": jnp.arange(40_000.0), "b": jnp.ones((30, 40))}
    checkpointer = Checkpointer(directory, max_to_keep=5)
    for step in steps:
        checkpointer.save(step, {**state, "step": jnp.int32(step)})
    return checkpointer, state


def test_a_truncated_checkpoint_is_one_clear_error_without_event_loop_noise(tmp_path, capfd):
    checkpointer, state = _small_checkpoints(tmp_path)
    path = _data_file(tmp_path / "2")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(
        DamagedCheckpointError,
        match=r"checkpoint step 2 in .* is damaged: "
        r"files whose bytes changed",
    ):
        checkpointer.restore(state, 2)
    # Without its checksum manifest (a run killed right after Orbax's commit), the read itself
    # fails: still one error naming the step, and no "Event loop is closed" reports after it.
    (tmp_path / "2" / "checksums.json").unlink()
    with pytest.raises(
        DamagedCheckpointError,
        match=r"checkpoint step 2 in .* cannot be read: "
        r".*(byte range|OUT_OF_RANGE|DATA_LOSS)",
    ):
        checkpointer.restore(state, 2)
    time.sleep(1.0)  # the reads TensorStore still had in flight report after the failure
    assert "Event loop is closed" not in capfd.readouterr().err
    np.testing.assert_array_equal(checkpointer.restore(state, 1)["w"], state["w"])
    with pytest.raises(
        CheckpointError,
        match=r"there is no checkpoint step 7 in .*; its steps "
        r"are \[1, 2\]",
    ):
        checkpointer.restore(state, 7)


def test_every_checkpoint_damaged_is_one_error_listing_them(data_dir, tmp_path):
    config = _smoke(data_dir, "checkpoint_every=6")
    tasks.train_and_evaluate(config, tmp_path)
    for step in (6, 12):
        _flip_a_byte(_data_file(tmp_path / "checkpoints" / str(step)))
    (tmp_path / "config.json").write_text('{"from": "the run that wrote them"}')
    with pytest.raises(
        CheckpointError,
        match=r"no intact checkpoint in .*checkpoint step 12 .* "
        r"damaged.*checkpoint step 6 .* damaged.*moved to",
    ):
        tasks.train_and_evaluate(config, tmp_path)
    assert (tmp_path / "config.json").read_text() == '{"from": "the run that wrote them"}'


def test_keep_checkpoints_zero_is_refused_before_any_work(data_dir, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"keep_checkpoints must be >= 1.*no checkpoint to "
        r"resume from",
    ):
        tasks.train_and_evaluate(_smoke(data_dir, "keep_checkpoints=0"), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


# ---- Config values of the wrong type ----


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("batch_size", True, r"config.batch_size must be an int, got True \(bool\)"),
        ("num_steps", None, r"config.num_steps must be an int, got None"),
        ("dataset", None, r"config.dataset must be a string, got None"),
    ],
)
def test_config_values_of_the_wrong_type_are_rejected_by_name(data_dir, tmp_path, key, value, message):
    config = _smoke(data_dir)
    config[key] = value
    with pytest.raises(ConfigTypeError, match=message):
        tasks.train_and_evaluate(config, tmp_path)
    config = _smoke(data_dir)
    config.mesh.sequence = True
    with pytest.raises(ValueError, match=r"config.mesh.sequence must be an int, got True"):
        tasks.train_and_evaluate(config, tmp_path)


def test_a_workdir_that_is_a_file_or_holds_a_file_for_checkpoints_fails_before_training(data_dir, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"workdir .*file is a file, not a directory"):
        tasks.train_and_evaluate(_smoke(data_dir), tmp_path / "file")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    with pytest.raises(NotADirectoryError, match=r"checkpoint directory .* is a file"):
        tasks.train_and_evaluate(_smoke(data_dir), tmp_path / "run")
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_checkpoint_directory_nothing_can_be_written_to_fails_before_training(data_dir, tmp_path):
    # /proc/self is a directory no one, root included, can create files in.
    (tmp_path / "checkpoints").symlink_to("/proc/self")
    with pytest.raises(PermissionError, match=r"checkpoint directory .* cannot be written \("):
        tasks.train_and_evaluate(_smoke(data_dir), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_an_exception_mid_run_resumes_exactly_from_the_last_checkpoint(data_dir, straight, tmp_path):
    config = _smoke(data_dir, "checkpoint_every=4")
    losses = []

    def fail_at_7(step, metrics):
        losses.append(float(metrics["loss"]))
        if step == 7:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        tasks.train_and_evaluate(config, tmp_path, step_callback=fail_at_7)
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 4
    resumed = []  # the lock was released: the next run starts
    tasks.train_and_evaluate(config, tmp_path, step_callback=lambda s, m: resumed.append(float(m["loss"])))
    assert losses[:4] + resumed == straight[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits")
def test_an_unwritable_checkpoint_directory_fails_before_training(data_dir, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints").chmod(0o500)
    try:
        with pytest.raises(PermissionError, match=r"checkpoint directory .* cannot be written"):
            tasks.train_and_evaluate(_smoke(data_dir), tmp_path)
    finally:
        (tmp_path / "checkpoints").chmod(0o700)
