"""Faults while a checkpoint is written and damaged metrics, made the way users make them: a disk
that really fills (the kernel's ENOSPC, on a small tmpfs), a real second SIGINT while a save is
in flight, real garbage bytes in metrics.jsonl."""

import errno
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from configs import digits
from experiments import tasks
from experiments.training import save_faults
from experiments.training.checkpoints import Checkpointer
from experiments.training.metrics import METRICS_FILE, read_metrics
from experiments.training.save_faults import CheckpointSaveError

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = "smoke,num_steps=4,log_every=1,checkpoint_every=2,eval_every=0,sample_every=0,progress_bar=False"


@pytest.fixture(scope="module")
def environment(tmp_path_factory):
    """The environment of the command-line runs: CPU, one compilation cache for all of them
    (a cached executable is the compiled one: the numbers do not change)."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A workdir of `SMOKE` trained to the end: checkpoints 2 and 4."""
    workdir = tmp_path_factory.mktemp("trained")
    config = digits.get_config(SMOKE)
    config.data_dir = str(data_dir)
    tasks.train_and_evaluate(config, workdir)
    return workdir


def _train_command(workdir, data_dir, variants=SMOKE):
    return [
        sys.executable,
        "-m",
        "experiments.train",
        f"--config=configs/digits.py:{variants}",
        f"--config.data_dir={data_dir}",
        f"--workdir={workdir}",
    ]


# ---- A full disk ----


def _can_mount_a_tmpfs(directory) -> bool:
    """Whether this user may mount a tmpfs in a new user and mount namespace (unshare -rm)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"', str(directory)],
        capture_output=True,
    )
    return probe.returncode == 0


def test_a_full_disk_during_a_save_is_one_line_naming_the_path_and_the_free_space(
    trained, data_dir, environment, tmp_path
):
    workdir = tmp_path / "run"
    checkpoint_dir = workdir / "checkpoints"
    checkpoint_dir.mkdir(parents=True)
    if not _can_mount_a_tmpfs(checkpoint_dir):
        pytest.skip("no small filesystem to fill: `unshare -rm` cannot mount a tmpfs here")
    # The checkpoints live on a tmpfs that holds step 2 and a file filling it to half of what
    # step 2 takes there: step 4 cannot fit, however much more than its final size Orbax's save
    # writes on the way (a CI run's save of a 172 KiB checkpoint failed in 260 KiB).
    disk = tmp_path / "disk"
    disk.mkdir()
    helper = tmp_path / "disk_helper.py"
    helper.write_text(
        "import pathlib, shutil, sys\n"
        "disk, checkpoints = map(pathlib.Path, sys.argv[2:4])\n"
        "taken = sum(p.lstat().st_blocks * 512 for p in (checkpoints / '2').rglob('*'))\n"
        "if sys.argv[1] == 'fill':\n"
        "    (disk / 'filler').write_bytes(bytes(shutil.disk_usage(disk).free - taken // 2))\n"
        "else:\n"
        "    print(shutil.disk_usage(checkpoints).free, taken)\n"
    )
    helper_command = f"{sys.executable} {helper} {{}} {disk} {checkpoint_dir}"
    script = (
        f"mount -t tmpfs -o size=16m tmpfs {disk} && mkdir {disk}/checkpoints && "
        f"mount --bind {disk}/checkpoints {checkpoint_dir} && "
        f"cp -a {trained}/checkpoints/2 {checkpoint_dir}/ && {helper_command.format('fill')} && "
        f'"$@"; status=$?; {helper_command.format("measure")}; '
        f"cp -a {checkpoint_dir}/. {tmp_path / 'left'}/; exit $status"
    )
    (tmp_path / "left").mkdir()
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *_train_command(workdir, data_dir)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    free, taken = map(int, result.stdout.split()[-2:])
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"train: error: cannot save checkpoint step 4 in {checkpoint_dir}: no space left on device "
        f"({save_faults.human_size(free)} free there; checkpoint step 2 takes "
        f"{save_faults.human_size(taken)}). Make room there, then run "
        f"the same command again to resume from checkpoint step 2."
    ]
    # The half-written step 4 is gone; step 2 is whole, and a run with room resumes from it.
    assert sorted(p.name for p in (tmp_path / "left").iterdir()) == ["2"]
    Checkpointer(tmp_path / "left").verify(2)
    shutil.copytree(tmp_path / "left", checkpoint_dir, dirs_exist_ok=True)
    config = digits.get_config(SMOKE)
    config.data_dir = str(data_dir)
    resumed = []
    tasks.train_and_evaluate(config, workdir, step_callback=lambda s, m: resumed.append(s))
    assert resumed == [3, 4]


def test_a_full_disk_when_the_checksums_are_written_is_the_same_one_error(trained, monkeypatch, tmp_path):
    # Where no tmpfs can be mounted (the test above skips), the same error from the one write
    # that is Python's own: checksums.json, after Orbax's commit.
    import jax

    shutil.copytree(trained / "checkpoints", tmp_path / "checkpoints")
    checkpointer = Checkpointer(tmp_path / "checkpoints", max_to_keep=3)
    state = {"step": jax.numpy.int32(6), "w": jax.numpy.arange(1000.0)}
    write_text = pathlib.Path.write_text

    def full_disk(path, *args, **kwargs):
        if path.name == "checksums.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    with pytest.raises(
        CheckpointSaveError,
        match=rf"^cannot save checkpoint step 6 in {tmp_path / 'checkpoints'}: no space left on "
        r"device \([0-9.]+ [KMGT]?i?B(ytes)? free there; checkpoint step 6 takes [0-9.]+ [KMG]iB\)\. "
        r"Make room there, then run the same command again to resume from checkpoint step 6\.$",
    ) as error:
        checkpointer.save(6, state)
    assert error.value.errno == errno.ENOSPC
    assert not (tmp_path / "checkpoints" / "6" / "checksums.tmp").exists()
    checkpointer.close()


# ---- A second Ctrl-C while a checkpoint is being written ----

# Runs `python -m experiments.train`'s main in this process and sends it two real SIGINTs: the first
# once a step is logged, the second once the main thread is inside Orbax's save of the
# checkpoint the first one asked for. Prints to stdout whether the main thread was still saving
# when the second had been sent.
_SECOND_SIGINT_IN_A_SAVE = """
import os, runpy, signal, sys, threading, time
from experiments.training import checkpoints, save_faults

def saving():
    frame = sys._current_frames().get(threading.main_thread().ident)
    in_orbax = False
    while frame is not None:
        code = frame.f_code
        if code.co_filename == checkpoints.__file__ and code.co_name == "save":
            return in_orbax
        in_orbax = in_orbax or "orbax" in code.co_filename
        frame = frame.f_back
    return False

def send(metrics):
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)
    while not saving():
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGINT)
    print("second SIGINT sent while saving:", saving(), flush=True)

workdir = [a for a in sys.argv if a.startswith("--workdir=")][0].split("=", 1)[1]
threading.Thread(target=send, args=(os.path.join(workdir, "metrics.jsonl"),), daemon=True).start()
runpy.run_module("experiments.train", run_name="__main__", alter_sys=True)
"""


def _losses(workdir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(workdir) if "loss" in r]


def test_a_second_sigint_during_a_save_is_one_line_and_resumes_exactly(data_dir, environment, tmp_path):
    variants = SMOKE.replace("num_steps=4", "num_steps=20")
    variants = variants.replace("checkpoint_every=2", "checkpoint_every=0")
    straight = subprocess.run(
        _train_command(tmp_path / "straight", data_dir, variants),
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]

    workdir = tmp_path / "run"
    command = _train_command(workdir, data_dir, variants)
    interrupted = subprocess.run(
        [sys.executable, "-c", _SECOND_SIGINT_IN_A_SAVE, *command[3:]],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "second SIGINT sent while saving: True" in interrupted.stdout, interrupted.stderr[-3000:]
    assert interrupted.returncode == 130, interrupted.stderr[-3000:]
    saved = Checkpointer(workdir / "checkpoints").latest_step()
    assert saved is not None and 0 < saved < 20
    assert interrupted.stderr.splitlines() == [
        f"train: SIGINT received: stopped after step {saved} with a checkpoint of it in "
        f"{workdir / 'checkpoints'}; run the same command again to resume."
    ]
    assert [p.name for p in (workdir / "checkpoints").iterdir()] == [str(saved)]

    resumed = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(workdir) == _losses(tmp_path / "straight")


# In a process of its own (.ci/run runs the slow tests of this file with -n 0): in a shared
# xdist worker, after other modules, the SIGINT it sends during the save has raised nothing
# (seen three times); not yet explained.
@pytest.mark.slow
def test_a_sigint_during_a_save_outside_training_lets_it_finish_then_raises(tmp_path, monkeypatch):
    # The Python API's saves, outside the trainer's signal handling: Ctrl-C is a
    # KeyboardInterrupt as usual, raised once the checkpoint is complete. The SIGINT is sent
    # while Orbax's asynchronous write is under way (as its wait begins), from the process to
    # itself: a thread polling for Orbax frames missed short saves on a loaded machine.
    import jax.numpy as jnp

    checkpointer = Checkpointer(tmp_path)
    state = {"step": jnp.int32(1), "w": jnp.arange(200_000.0)}
    manager = checkpointer._manager
    wait, sent = manager.wait_until_finished, []

    def signal_then_wait():
        if not sent:  # The first wait: the save's own (Orbax may wait again inside it).
            os.kill(os.getpid(), signal.SIGINT)
            sent.append(True)
        wait()

    monkeypatch.setattr(manager, "wait_until_finished", signal_then_wait)
    # Python's usual Ctrl-C whatever this process inherited: a background job of a shell
    # without job control starts with SIGINT ignored, and Python then keeps it ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpointer.save(1, state)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert sent == [True], "the SIGINT was not sent during the save"
    assert checkpointer.all_steps() == [1]
    checkpointer.verify(1)
    assert not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))
    checkpointer.close()


# ---- Damaged metrics ----


def test_garbage_lines_in_metrics_are_kept_in_a_copy_and_counted_on_resume(
    trained, data_dir, tmp_path, caplog
):
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    path = workdir / METRICS_FILE
    records = path.read_bytes().splitlines(keepends=True)
    # Half a record, then bytes that are not even UTF-8, between good records.
    garbage = [b'{"step": 3, "loss": 2.\n', b"\x00\xff\xfe\x80garbage\n"]
    damaged = b"".join(records[:2] + garbage + records[2:])
    path.write_bytes(damaged)

    config = digits.get_config(SMOKE)
    config.data_dir = str(data_dir)
    with caplog.at_level("WARNING"):
        tasks.train_and_evaluate(config, workdir)  # resumes at the end: nothing left to train
    copies = list(workdir.glob(f"{METRICS_FILE}.corrupt-*"))
    assert len(copies) == 1 and copies[0].read_bytes() == damaged
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"{path}: dropped 2 unreadable lines (not JSON records with a step); the file as it was "
        f"is kept in {copies[0]}."
    ]
    # Every good record is still there, in order; nothing else.
    assert read_metrics(workdir)[: len(records)] == [json.loads(r) for r in records]
    assert all(r["step"] <= 4 for r in read_metrics(workdir))
