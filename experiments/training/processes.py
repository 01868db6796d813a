"""One training run over several processes (JAX's multi-controller runtime): joining, agreeing,
stopping together, and failing fast.

`config.distributed=True` makes every process call `join(config)` before any JAX computation:
`jax.distributed.initialize`, with the coordinator, process count and process id of
`config.coordinator_address` / `num_processes` / `process_id` where given, JAX's cluster
detection (SLURM, Open MPI, Kubernetes, Cloud TPU) for those left unset. Then:

- joining is bounded: a process that has not joined every other one within
  `config.coordinator_timeout` seconds ends with one line naming the coordinator (JAX alone
  would abort with a stack trace, or wait five minutes);
- every process must run the same config (`check_same_config`: the keys that differ are named);
- each process beats a heartbeat into the coordination service; a process whose heartbeat stops
  for `config.peer_timeout` seconds (SIGKILL, a crash, a lost host), or that fails with an error
  (`failing`), makes every other one end within moments, naming it, with exit status 1 —
  never a hang in a collective that will not complete. Where the coordinator is named, process
  0 runs the coordination service in a process of its own (coordinator.py), so that process 0's
  own death is reported the same way; otherwise (JAX's cluster detection) the service lives in
  process 0, and when it dies JAX ends the others at once with its own message, "the leader task
  ... died", exit status 134.
- a SIGTERM or SIGINT reaching any process stops all of them after the same step
  (`StopVote`): each step, every process votes with the signal it has received (0: none);
  the vote's maximum, read a step later (so it never waits on the step in flight), is the same
  on every process, which then all save that step together and exit with 128 + that signal.

Why the coordination service's key-value store (`jax._src.distributed.global_state.client`, not
a public API): JAX offers no other way to learn that a peer is gone without a collective that
then never returns, and its own failure handling ends the process with an abort.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from experiments.training import coordinator
from experiments.training.config_diff import config_differences, format_difference

# Prefix of this library's keys in the coordination service's key-value store.
_KEY = "linear_transformers"
# How often a process beats and looks at the others: a twentieth of peer_timeout, within these
# bounds (every process reads every heartbeat: a thousand processes at 3 s is ~330 reads a second
# at the coordinator).
_BEAT_SECONDS = (0.25, 3.0)
# JAX's own heartbeat timeout exceeds ours by this much, so that a dead peer is reported here,
# with its name, before JAX's failure handling aborts the process.
_JAX_MARGIN_SECONDS = 30
SETTINGS = ("coordinator_address", "num_processes", "process_id")


def _program() -> str:
    return os.path.basename(sys.argv[0]).removesuffix(".py") or "experiments"


def _end_now(message: str, status: int = 1) -> None:
    """Print `<program>: error: message` and end the process at once (no exit handlers: JAX's
    would wait on a shutdown barrier for processes that are gone)."""
    print(f"{_program()}: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_values(config) -> None:
    """The distributed keys of `config` (schemas.devices), else a ValueError naming the first
    bad one: settings only with config.distributed=True, an address HOST:PORT, 1 <= processes,
    0 <= process_id < num_processes, timeouts positive whole seconds."""
    if not isinstance(config.distributed, bool):
        raise ValueError(f"config.distributed must be True or False, got {config.distributed!r}.")
    given = [key for key in SETTINGS if config[key] is not None]
    if given and not config.distributed:
        raise ValueError(
            f"config.{given[0]}={config[given[0]]!r} is given but config.distributed is False; set "
            f"--config.distributed=True to train with several processes (or drop "
            f"{', '.join('config.' + k for k in given)})."
        )
    for key in ("coordinator_timeout", "peer_timeout"):
        if not (_is_int(config[key]) and config[key] >= 1):
            raise ValueError(f"config.{key} must be a whole number of seconds >= 1, got {config[key]!r}.")
    address = config.coordinator_address
    if address is not None:
        host, _, port = str(address).rpartition(":")
        if not (host and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(
                f"config.coordinator_address must be HOST:PORT (process 0's host name or address "
                f"and a free port, e.g. 10.0.0.1:12345), got {address!r}."
            )
    count, index = config.num_processes, config.process_id
    if count is not None and not (_is_int(count) and count >= 1):
        raise ValueError(f"config.num_processes must be an int >= 1, got {count!r}.")
    if index is not None and not (_is_int(index) and index >= 0):
        raise ValueError(f"config.process_id must be an int >= 0, got {index!r}.")
    if count is not None and index is not None and index >= count:
        raise ValueError(
            f"config.process_id={index} with config.num_processes={count}: process ids run from 0 "
            f"to {count - 1}."
        )


class _Cluster:
    """This process's place in the run, once joined."""

    def __init__(self, client, index: int, count: int, peer_timeout: int, coordinator_timeout: int):
        self.client, self.index, self.count = client, index, count
        self.peer_timeout, self.coordinator_timeout = peer_timeout, coordinator_timeout
        self.failed = False  # this process has told the others it failed
        self.service: subprocess.Popen | None = None  # process 0's coordinator.py, if started
        self.beat_seconds = min(max(_BEAT_SECONDS[0], peer_timeout / 20), _BEAT_SECONDS[1])
        self.leaving = threading.Event()
        self.watch = _PeerWatch(self)
        if count > 1:
            self.watch.start()
            atexit.register(self.leave)  # before JAX's own exit handler (registered earlier)

    def leave(self) -> None:
        """At exit: tell the others this process is done (they stop watching its heartbeat, so a
        peer still busy, e.g. process 0 writing samples, is not taken for dead), then stop the
        watch: a thread inside the service's client when the interpreter ends aborts it."""
        try:
            self.client.key_value_set(f"{_KEY}/ended/{self.index}", "exit", allow_overwrite=True)
        except Exception:
            pass
        self.leaving.set()
        self.watch.join(timeout=5 * self.beat_seconds)
        if self.service is not None:  # JAX's exit barrier needs the service: first, then end it
            jax.distributed.shutdown()
            self.end_service()

    def end_service(self) -> None:
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(coordinator.STOP)  # it removes its pid file and ends
            try:
                self.service.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()

    def end_service_after_exit(self) -> None:
        """Let the service end as soon as this process has (killing it first would abort this
        process's own client before it has said why it ends)."""
        if self.service is not None and self.service.poll() is None:
            try:
                self.service.stdin.write("end\n")
                self.service.stdin.flush()
            except OSError:
                pass


_cluster: _Cluster | None = None


def multiprocess() -> bool:
    """Whether this run has more than one process."""
    return _cluster is not None and _cluster.count > 1


def join(config) -> None:
    """Join the run's other processes when config.distributed (see the module docstring); a
    no-op otherwise. Call before any JAX computation. Where the caller has already called
    `jax.distributed.initialize` (its own launcher), the run uses it, whatever
    config.distributed says: the settings given must then match it."""
    global _cluster
    if _cluster is not None:
        return
    if jax.distributed.is_initialized():
        _cluster = _adopt(config)
        return
    if not config.distributed:
        return
    named = {key: config[key] for key in SETTINGS}
    timer = threading.Timer(config.coordinator_timeout, _end_now, (_late_message(config),))
    timer.daemon = True
    # JAX's preemption service catches SIGTERM itself; the trainer's signal handling and
    # StopVote replace it (SIGINT included).
    jax.config.update("jax_enable_preemption_service", False)
    timer.start()
    service, bind = None, {}
    if named["process_id"] == 0 and (named["num_processes"] or 1) > 1 and named["coordinator_address"]:
        service = _start_service(config)
        # JAX starts a service in process 0 whatever it is told: an idle one, on a port of its own.
        bind = {"coordinator_bind_address": f"127.0.0.1:{_free_port()}"}
    try:
        jax.distributed.initialize(
            **named,
            **bind,
            initialization_timeout=config.coordinator_timeout + _JAX_MARGIN_SECONDS,
            heartbeat_timeout_seconds=config.peer_timeout + _JAX_MARGIN_SECONDS,
            shutdown_timeout_seconds=config.peer_timeout + _JAX_MARGIN_SECONDS,
        )
    except ValueError as e:
        if all(v is None for v in named.values()):
            raise ValueError(
                f"config.distributed=True found no cluster to join ({e}); JAX detects SLURM, Open "
                f"MPI, Kubernetes and Cloud TPU. Elsewhere name the run with "
                f"--config.coordinator_address=HOST:PORT --config.num_processes=N "
                f"--config.process_id=I."
            ) from None
        raise ValueError(f"config.distributed: {e}") from None
    finally:
        timer.cancel()
    _cluster = _adopt(config)
    _cluster.service = service


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_service(config) -> subprocess.Popen:
    """Process 0's coordination service in a process of its own (coordinator.py), listening on
    config.coordinator_address's port, once a service a previous run left there is ended;
    retried while the port is taken, up to coordinator_timeout."""
    port = int(config.coordinator_address.rpartition(":")[2])
    command = [
        sys.executable,
        "-m",
        "experiments.training.coordinator",
        str(port),
        str(config.num_processes),
        str(config.peer_timeout + _JAX_MARGIN_SECONDS),
        str(config.peer_timeout + _JAX_MARGIN_SECONDS),
        str(os.getpid()),
        str(config.peer_timeout + 10),
    ]
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    coordinator.end_lingering(port)
    deadline = time.monotonic() + config.coordinator_timeout
    while True:
        service = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.PIPE,
            env=env,
            text=True,
        )
        line = service.stdout.readline().strip()
        if line == coordinator.READY:
            return service
        service.wait()
        if time.monotonic() > deadline:
            _end_now(
                f"process 0 could not start the coordination service on port {port} within "
                f"{config.coordinator_timeout} s (config.coordinator_timeout): {line or 'it exited'}; "
                f"choose another port in config.coordinator_address."
            )
        time.sleep(1.0)


def _late_message(config) -> str:
    """What a process says when the others have not all joined within coordinator_timeout."""
    where = config.coordinator_address or "the coordinator JAX detects"
    index, count = config.process_id, config.num_processes
    if index == 0:
        return (
            f"not every process joined the coordinator at {where} within "
            f"{config.coordinator_timeout} s (config.coordinator_timeout); start all "
            f"{count or 'config.num_processes'} processes with the same config.coordinator_address "
            f"and config.num_processes, each with its own config.process_id."
        )
    return (
        f"process {index if index is not None else '?'} could not join the coordinator at {where} "
        f"within {config.coordinator_timeout} s (config.coordinator_timeout): process 0 must be "
        f"running there (HOST:PORT reachable from this host) and every process started."
    )


def _adopt(config) -> _Cluster:
    """This process's place in the initialized runtime, checked against the settings given."""
    from jax._src import distributed  # the coordination service's client (module docstring)

    state = distributed.global_state
    actual = {
        "coordinator_address": state.coordinator_address,
        "num_processes": state.num_processes,
        "process_id": state.process_id,
    }
    for key, value in actual.items():
        if config[key] is not None and config[key] != value:
            raise ValueError(
                f"config.{key}={config[key]!r}, but jax.distributed was initialized in this process "
                f"with {key}={value!r}; leave config.{key} unset or give the same value."
            )
    return _Cluster(
        state.client, state.process_id, state.num_processes, config.peer_timeout, config.coordinator_timeout
    )


def _comparable(config) -> dict:
    saved = json.loads(config.to_json_best_effort())
    saved.pop("process_id", None)
    return saved


def check_same_config(config, workdir) -> None:
    """Every process runs `config` (all but process_id) in `workdir`, else a ValueError on every
    process naming the keys whose values differ from process 0's."""
    if not multiprocess():
        return
    mine = {"config": _comparable(config), "workdir": os.path.abspath(os.path.expanduser(str(workdir)))}
    client, index = _cluster.client, _cluster.index
    client.key_value_set(f"{_KEY}/config/{index}", json.dumps(mine))
    wait_ms = _cluster.coordinator_timeout * 1000
    reference = json.loads(client.blocking_key_value_get(f"{_KEY}/config/0", wait_ms))
    differences = config_differences(reference["config"], mine["config"])
    if reference["workdir"] != mine["workdir"]:
        differences.append(format_difference("workdir", reference["workdir"], mine["workdir"]))
    client.key_value_set(f"{_KEY}/config_differs/{index}", "; ".join(differences))
    reports = {
        p: client.blocking_key_value_get(f"{_KEY}/config_differs/{p}", wait_ms) for p in range(_cluster.count)
    }
    differing = {p: text for p, text in reports.items() if text}
    if differing:
        raise ValueError(
            "every process must run the same config (only config.process_id differs) in the same "
            "workdir; "
            + "; ".join(f"process {p} differs from process 0 in {text}" for p, text in differing.items())
            + "."
        )


def from_process_0(name: str, value: str | None = None) -> str:
    """Process 0's `value` (a string) on every process, under the one-off `name`; `value` on a
    single process."""
    if not multiprocess():
        return value
    key = f"{_KEY}/from_0/{name}"
    if _cluster.index == 0:
        _cluster.client.key_value_set(key, value)
        return value
    return _cluster.client.blocking_key_value_get(key, _cluster.coordinator_timeout * 1000)


def barrier(name: str, timeout_seconds: int | None = None) -> None:
    """Wait until every process reaches `name` (a no-op on a single process), at most
    `timeout_seconds` (default: config.coordinator_timeout); a peer that dies meanwhile ends
    this process through the watch."""
    if multiprocess():
        timeout = _cluster.coordinator_timeout if timeout_seconds is None else timeout_seconds
        _cluster.client.wait_at_barrier(f"{_KEY}/{name}", timeout * 1000)


class _PeerWatch(threading.Thread):
    """Beats this process's heartbeat; ends the process, naming the peer, when a peer's heartbeat
    stops for peer_timeout seconds or a peer reports that it failed."""

    def __init__(self, cluster: _Cluster):
        super().__init__(daemon=True, name="peer-watch")
        self.cluster = cluster

    def run(self):
        c = self.cluster
        beat, last_change = 0, {}
        while not c.leaving.wait(c.beat_seconds):
            beat += 1
            try:
                c.client.key_value_set(f"{_KEY}/alive/{c.index}", str(beat), allow_overwrite=True)
                failed = c.client.key_value_dir_get(f"{_KEY}/failed/")
                alive = dict(c.client.key_value_dir_get(f"{_KEY}/alive/"))
                ended = {int(k.rsplit("/", 1)[-1]) for k, _ in c.client.key_value_dir_get(f"{_KEY}/ended/")}
            except Exception:  # the service is going away: JAX ends the process itself
                continue
            if c.failed or c.leaving.is_set():
                continue
            now = time.monotonic()
            for key, message in failed:
                peer = int(key.rsplit("/", 1)[-1])
                if peer != c.index:
                    self._end_process(f"process {peer} of {c.count} failed: {message}")
            for peer in range(c.count):
                if peer == c.index or peer in ended:
                    continue
                value = alive.get(f"{_KEY}/alive/{peer}")
                seen = last_change.get(peer)
                if seen is None or seen[0] != value:
                    last_change[peer] = (value, now)
                elif now - seen[1] > c.peer_timeout:
                    self._end_process(
                        f"process {peer} of {c.count} stopped responding ({c.peer_timeout} s without "
                        f"a heartbeat, config.peer_timeout): it was killed, crashed or lost its host"
                    )

    def _end_process(self, why: str) -> None:
        c = self.cluster
        try:
            c.client.key_value_set(f"{_KEY}/ended/{c.index}", "1", allow_overwrite=True)
        except Exception:
            pass
        if c.count == 2:  # the only other process is gone (or going): no one needs the service
            c.end_service_after_exit()
        _end_now(
            f"{why}; process {c.index} stops too. Start every process again with the same command "
            f"to resume from the newest checkpoint."
        )


# What a collective's error says when the process at the other end has gone.
_PEER_GONE = ("connection reset", "connection closed", "connection refused", "broken pipe", "gloo", "nccl")


def _collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because a peer went away (JAX's runtime
    error from Gloo or NCCL, e.g. 'Connection reset by peer'), not this process's own failure
    (out of memory, say)."""
    text = str(error).lower()
    return isinstance(error, jax.errors.JaxRuntimeError) and any(word in text for word in _PEER_GONE)


def failing(error: BaseException) -> None:
    """Tell the other processes that this one fails with `error` (they end within moments, naming
    it). A collective that failed because a peer went away is that peer's failure: wait for the
    watch to name it (it ends the process) rather than blame this one."""
    if not multiprocess() or _cluster.failed:
        return
    if _collective_failure(error):
        time.sleep(_cluster.peer_timeout + 4 * _cluster.beat_seconds)  # the watch ends it first
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    message = re.sub(r"\s+", " ", f"{type(error).__name__}: {first_line}")[:500].rstrip(".")
    _cluster.failed = True
    try:
        _cluster.client.key_value_set(f"{_KEY}/failed/{_cluster.index}", message)
    except Exception:
        pass


def _peers_done(c: _Cluster) -> set[int]:
    """The other processes that have ended or failed (all of them when the service is gone)."""
    try:
        keys = [k for kind in ("ended", "failed") for k, _ in c.client.key_value_dir_get(f"{_KEY}/{kind}/")]
    except Exception:
        return set(range(c.count)) - {c.index}
    return {int(k.rsplit("/", 1)[-1]) for k in keys} - {c.index}


def exit_process(status: int) -> None:
    """End a command that called `failing`: at once, without JAX's shutdown barrier (the others
    are gone or going). Process 0 first waits (up to peer_timeout) until the others have read
    the failure, since the coordination service ends with it. Returns when there is nothing to
    do (single process, or no failure)."""
    if not multiprocess() or not _cluster.failed:
        return
    c = _cluster
    if c.index == 0:
        deadline = time.monotonic() + c.peer_timeout
        while time.monotonic() < deadline and len(_peers_done(c)) < c.count - 1:
            time.sleep(c.beat_seconds)
    c.end_service_after_exit()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class StopVote:
    """Agree, across processes, on the step after which a signal stops the run.

    `cast(signum)` after dispatching each step; `agreed()` then returns the largest signal any
    process had received when it cast the previous vote (0: none), read without waiting for the
    step in flight, and the same on every process: all stop after the same step. On a single
    process it is the local signal, at once.
    """

    def __init__(self, signals):
        self.signals = signals
        self.pending = self.previous = None  # the votes of this boundary and the one before
        if multiprocess():
            mesh = Mesh(np.array(jax.devices()), ("processes",))
            self._sharding = NamedSharding(mesh, PartitionSpec("processes"))
            self._max = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def _vote(self):
        local = np.full(jax.local_device_count(), self.signals.signum or 0, np.int32)
        votes = jax.make_array_from_process_local_data(self._sharding, local, (jax.device_count(),))
        return self._max(votes)

    def cast(self) -> None:
        if multiprocess():
            self.pending, self.previous = self._vote(), self.pending

    def agreed(self) -> int:
        """The signal that stops the run after the step just dispatched (0: go on)."""
        if not multiprocess():
            return self.signals.signum or 0
        return 0 if self.previous is None else int(self.previous)

    def now(self) -> int:
        """A vote cast and read at once (before the first step: nothing is in flight)."""
        if not multiprocess():
            return self.signals.signum or 0
        return int(self._vote())
