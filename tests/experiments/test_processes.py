"""One run over several processes, tested as a cluster breaks it: two trainer processes on this
machine (a loopback coordinator, two host devices each) stopped by real SIGTERM / SIGINT at
seeded random moments, to both or to one; one of them SIGKILLed or failing with an error; a
second run on the same workdir; a coordinator that is not there; processes whose configs
differ. After a stop, re-running the same commands must resume exactly: the per-step losses equal
the uninterrupted run's.

The runs are the `slow` group's (.ci/run runs this file on its own); the config checks at the end
run in the default group.
"""

import json
import pathlib
import random
import signal
import subprocess
import time

import pytest
from process_group import ROOT, ProcessGroup, environment, free_port, train_command

from configs import digits
from experiments.training import interrupts, processes
from experiments.training.metrics import read_metrics

CONFIG = "configs/digits.py:smoke"
# Per-step losses (log_every=1), a checkpoint every 5 steps, one evaluation mid-run.
RUN = {
    "num_steps": 20,
    "log_every": 1,
    "checkpoint_every": 5,
    "eval_every": 10,
    "sample_every": 10,
    "peer_timeout": 5,
    "coordinator_timeout": 60,
}
slow = pytest.mark.slow


def _train_records(workdir) -> list[dict]:
    return [r for r in read_metrics(workdir) if "loss" in r]


def _losses(workdir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _train_records(workdir)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


def _group(workdir, cache, overrides=None, **kwargs) -> ProcessGroup:
    workdir.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("env", environment(2, cache))
    return ProcessGroup(workdir, CONFIG, {**RUN, **(overrides or {})}, **kwargs)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache):
    """The uninterrupted two-process run: its workdir."""
    workdir = tmp_path_factory.mktemp("runs") / "straight"
    group = _group(workdir, cache).start()
    assert group.wait(300) == [0, 0], group.output(0)[-3000:] + group.output(1)[-3000:]
    assert not _services(group.port)  # process 0 ended its coordination service
    return workdir


def _wait_for_training(workdir, group, timeout=120) -> None:
    """Until the run has logged its first step."""
    deadline = time.monotonic() + timeout
    while not _train_records(workdir):
        assert time.monotonic() < deadline, group.output(0)[-3000:]
        assert all(p.poll() is None for p in group.procs), group.output(0)[-3000:] + group.output(1)[-3000:]
        time.sleep(0.005)


def _resume_and_compare(workdir, straight, cache, port=None) -> None:
    group = _group(workdir, cache, port=port).start()
    assert group.wait(300) == [0, 0], group.output(0)[-3000:] + group.output(1)[-3000:]
    assert _losses(workdir) == _losses(straight)


def _services(port: int) -> list[int]:
    """The pids of coordination services (experiments.training.coordinator) on `port`."""
    pids = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"experiments.training.coordinator" in words and str(port).encode() in words:
            pids.append(int(cmdline.parent.name))
    return pids


def _last_line(group, i) -> str:
    lines = [line for line in group.output(i).splitlines() if line.startswith(("train:", "failing_train:"))]
    return lines[-1] if lines else group.output(i)[-2000:]


@slow
def test_two_processes_train_as_one_process_with_their_devices_and_write_once(straight, tmp_path, cache):
    one = tmp_path / "one_process"
    one.mkdir()
    command = train_command(one, CONFIG, {**RUN, "peer_timeout": 60, "progress_bar": False})
    done = subprocess.run(command, cwd=ROOT, env=environment(4, cache), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    two, single = _losses(straight), _losses(one)
    assert [s for s, _ in two] == [s for s, _ in single] == list(range(1, RUN["num_steps"] + 1))
    # The same 4-device data parallelism: only the order of the gradient sum differs (Gloo).
    assert [loss for _, loss in two] == pytest.approx([loss for _, loss in single], rel=1e-5)
    # Every line once: process 0 alone writes metrics, config and samples.
    lines = (straight / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines)) == RUN["num_steps"] + 2  # + two evaluations
    assert json.loads((straight / "config.json").read_text())["num_processes"] == 2
    assert sorted(p.name for p in (straight / "samples").iterdir()) == [
        "step_0000010.png",
        "step_0000020.png",
    ]


@slow
def test_sigterm_to_both_at_random_moments_stops_them_at_one_step_and_resumes_exactly(
    straight, tmp_path, cache
):
    rng = random.Random(0)
    workdir = tmp_path / "run"
    group = _group(workdir, cache).start()
    _wait_for_training(workdir, group)
    for i in rng.sample([0, 1], 2):
        time.sleep(rng.uniform(0.0, 0.15))
        group.procs[i].send_signal(signal.SIGTERM)
    assert group.wait(120) == [143, 143], group.output(0)[-3000:] + group.output(1)[-3000:]
    assert not _services(group.port)  # a stop ends process 0's coordination service too
    lines = {_last_line(group, i) for i in range(2)}
    assert len(lines) == 1 and "SIGTERM received: stopped after step" in lines.pop()
    stopped = int(_last_line(group, 0).split("after step ")[1].split()[0])
    assert 0 < stopped < RUN["num_steps"]
    _resume_and_compare(workdir, straight, cache)


@slow
@pytest.mark.parametrize(
    ("signum", "target"), [(signal.SIGTERM, 1), (signal.SIGINT, 0)], ids=["SIGTERM-1", "SIGINT-0"]
)
def test_a_signal_to_one_process_stops_every_process_after_the_same_step(
    straight, tmp_path, cache, signum, target
):
    workdir = tmp_path / "run"
    group = _group(workdir, cache).start()
    _wait_for_training(workdir, group)
    time.sleep(random.Random(target).uniform(0.0, 0.1))
    group.procs[target].send_signal(signum)
    assert group.wait(120) == [128 + signum] * 2, group.output(0)[-3000:] + group.output(1)[-3000:]
    assert _last_line(group, 0) == _last_line(group, 1)
    assert f"{signal.Signals(signum).name} received: stopped after step" in _last_line(group, 1 - target)
    _resume_and_compare(workdir, straight, cache)


@slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_ends_the_other_within_the_bound_and_the_run_resumes_exactly(
    straight, tmp_path, cache, victim
):
    workdir = tmp_path / "run"
    group = _group(workdir, cache).start()
    _wait_for_training(workdir, group)
    time.sleep(0.1)
    group.procs[victim].kill()
    killed_at = time.monotonic()
    survivor = group.procs[1 - victim]
    status = survivor.wait(RUN["peer_timeout"] + 30)  # TimeoutExpired: a hang
    took = time.monotonic() - killed_at
    # Named after peer_timeout seconds without its heartbeat, exit status 1; when process 0 dies
    # its coordination service (a process of its own) lives on until the other has read that.
    assert status == 1, group.output(1 - victim)[-3000:]
    assert f"process {victim} of 2 stopped responding (5 s without a heartbeat" in _last_line(
        group, 1 - victim
    )
    assert took < RUN["peer_timeout"] + 10
    group.wait(10)
    # A service whose process 0 was killed lingers (peer_timeout + 10 s); the next run on the same
    # port ends it before starting its own (gRPC would let both listen there).
    _resume_and_compare(workdir, straight, cache, port=group.port)
    assert not _services(group.port)


@slow
@pytest.mark.parametrize("failing", [1, 0])
def test_an_error_in_one_process_ends_the_other_at_once_naming_it(tmp_path, cache, failing):
    workdir = tmp_path / "run"
    group = _group(
        workdir,
        cache,
        {"peer_timeout": 120},
        program=("tests/failing_train.py",),
        env=environment(2, cache, FAIL_PROCESS=failing, FAIL_AT_STEP=7),
    ).start()
    started = time.monotonic()
    assert group.wait(120) == [1, 1], group.output(0)[-3000:] + group.output(1)[-3000:]
    assert "RuntimeError: injected failure before step 7" in group.output(failing)
    other = 1 - failing
    assert _last_line(group, other).startswith(
        f"failing_train: error: process {failing} of 2 failed: RuntimeError: injected failure before "
        f"step 7; process {other} stops too."
    )
    # Told, not found by a heartbeat gone quiet: well within peer_timeout (120 s).
    assert time.monotonic() - started < 60
    assert "leader task" not in group.output(other)
    assert max(s for s, _ in _losses(workdir)) <= 7


@slow
def test_a_runtime_the_caller_initialized_is_used_without_config_distributed(straight, tmp_path, cache):
    workdir = tmp_path / "run"
    workdir.mkdir()
    port = free_port()
    procs = []
    for i in range(2):
        command = train_command(
            workdir, CONFIG, {**RUN, "progress_bar": False}, ("tests/initialized_train.py",)
        )
        env = environment(2, cache, COORDINATOR=f"127.0.0.1:{port}", NUM_PROCESSES=2, PROCESS_ID=i)
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors[0][-3000:] + errors[1][-3000:]
    # Written once, the same losses as the trainer's own two-process run.
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines)) == RUN["num_steps"] + 2
    assert _losses(workdir) == _losses(straight)


@slow
def test_sequence_parallel_within_each_process_and_data_parallel_across_them(tmp_path, cache):
    overrides = {"mesh.sequence": 2, "num_steps": 6, "sample_every": 0}
    two = tmp_path / "two"
    group = _group(two, cache, overrides).start()
    assert group.wait(300) == [0, 0], group.output(0)[-3000:] + group.output(1)[-3000:]
    one = tmp_path / "one"
    command = train_command(one, CONFIG, {**RUN, **overrides, "progress_bar": False})
    done = subprocess.run(command, cwd=ROOT, env=environment(4, cache), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_losses(two)) == 6
    assert [loss for _, loss in _losses(two)] == pytest.approx([loss for _, loss in _losses(one)], rel=1e-5)


@slow
def test_a_second_run_on_the_workdir_is_refused_on_every_process(tmp_path, cache):
    workdir = tmp_path / "run"
    first = _group(workdir, cache, {"num_steps": 100000, "checkpoint_every": 0}).start()
    try:
        _wait_for_training(workdir, first)
        second = ProcessGroup(workdir, CONFIG, RUN, env=environment(2, cache)).start()
        assert second.wait(120) == [1, 1], second.output(0)[-3000:] + second.output(1)[-3000:]
        for i in range(2):
            assert "is in use by another training run (pid" in _last_line(second, i)
        assert all(p.poll() is None for p in first.procs)  # the first run goes on
    finally:
        first.kill_all()


@slow
@pytest.mark.parametrize("process_id", [1, 0])
def test_a_process_alone_ends_within_the_coordinator_timeout_with_one_line(tmp_path, process_id):
    group = ProcessGroup(tmp_path / "run", CONFIG, {**RUN, "coordinator_timeout": 3})
    (tmp_path / "run").mkdir()
    group.commands = [group.commands[process_id]]
    started = time.monotonic()
    group.start()
    assert group.wait(60) == [1]
    assert time.monotonic() - started < 3 + 30
    line = _last_line(group, 0)
    address = f"127.0.0.1:{group.port}"
    if process_id:
        assert line.startswith(
            f"train: error: process 1 could not join the coordinator at {address} within 3 s"
        )
    else:
        assert line.startswith(
            f"train: error: not every process joined the coordinator at {address} within 3 s"
        )


@slow
def test_distributed_alone_where_no_cluster_is_detected_is_one_line(tmp_path):
    command = train_command(tmp_path / "run", CONFIG, {**RUN, "distributed": True})
    done = subprocess.run(command, cwd=ROOT, env=environment(2), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("train: error: config.distributed=True found no cluster to join")
    )
    assert "--config.coordinator_address=HOST:PORT --config.num_processes=N" in done.stderr


@slow
@pytest.mark.parametrize(
    ("argument", "named"), [("--config.seed=7", "seed: 0 -> 7"), ("--workdir={other}", "workdir: ")]
)
def test_processes_with_different_configs_are_refused_naming_the_keys(tmp_path, cache, argument, named):
    group = _group(tmp_path / "run", cache)
    group.commands[1] = group.commands[1] + [argument.format(other=tmp_path / "other")]
    group.start()
    assert group.wait(120) == [1, 1], group.output(0)[-3000:] + group.output(1)[-3000:]
    for i in range(2):
        assert f"process 1 differs from process 0 in {named}" in _last_line(group, i)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# The config checks: before any process starts anything.


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"coordinator_address": "127.0.0.1:1234"},
            "config.coordinator_address='127.0.0.1:1234' is given but",
        ),
        ({"distributed": True, "coordinator_address": "localhost"}, "must be HOST:PORT"),
        ({"distributed": True, "coordinator_address": "h:99999"}, "must be HOST:PORT"),
        ({"distributed": True, "num_processes": 0}, "config.num_processes must be an int >= 1, got 0"),
        ({"distributed": True, "process_id": -1}, "config.process_id must be an int >= 0, got -1"),
        (
            {"distributed": True, "num_processes": 2, "process_id": 2},
            "config.process_id=2 with config.num_processes=2: process ids run from 0 to 1",
        ),
        (
            {"distributed": True, "peer_timeout": 0},
            "config.peer_timeout must be a whole number of seconds >= 1",
        ),
        ({"coordinator_timeout": True}, "config.coordinator_timeout must be a whole number of seconds >= 1"),
    ],
)
def test_distributed_settings_are_checked_by_name(overrides, message):
    config = digits.get_config("smoke")
    for key, value in overrides.items():
        config[key] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        processes.check_values(config)


def test_the_default_config_runs_as_one_process():
    config = digits.get_config("smoke")
    processes.check_values(config)
    assert not config.distributed and config.coordinator_address is None
    assert not processes.multiprocess()


def test_with_several_processes_a_second_sigint_is_only_recorded():
    """Processes must stop at the same step: a second Ctrl-C neither raises at once nor, held in
    a save, stops the run after it; a block inside keeps the outer block's signal."""
    with interrupts.deferred_signals(stop_at_once=False) as outer:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # raised KeyboardInterrupt with stop_at_once=True
        assert outer.signum == signal.SIGINT
        with interrupts.deferred_signals() as inner:
            assert inner.signum == signal.SIGINT and not inner.stop_at_once
            with interrupts.completing_save(3, "checkpoints"):
                signal.raise_signal(signal.SIGINT)  # raised Interrupted after the save before
            signal.raise_signal(signal.SIGTERM)
            assert inner.signum == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred_signals():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)


@slow
def test_the_processes_benchmark_times_each_setup(tmp_path, cache, straight, monkeypatch):
    from experiments.benchmarking import processes_bench

    # The setups and steps of the runs above (their learning-rate schedule and mesh): their
    # training steps come from the compilation cache.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    opts = processes_bench.ProcessesBenchOptions(
        config=CONFIG,
        num_steps=RUN["num_steps"],
        log_every=5,
        setups=(processes_bench.Setup(1, 4), processes_bench.Setup(2, 2)),
    )
    rows = processes_bench.run_and_report(opts, tmp_path)
    assert [(r["processes"], r["devices"], r["windows"]) for r in rows] == [(1, 4, 3), (2, 4, 3)]
    assert all(r["step_ms"] > 0 for r in rows) and rows[0]["vs_first"] == 1.0
    assert (tmp_path / "processes.csv").read_text().splitlines()[0].startswith("setup,processes,devices")


def test_only_a_collective_that_lost_its_peer_is_blamed_on_the_peer():
    import jax

    gone = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection reset by peer")
    own = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 12 GiB")
    assert processes._collective_failure(gone)
    assert not processes._collective_failure(own)
    assert not processes._collective_failure(RuntimeError("Connection reset by peer"))
