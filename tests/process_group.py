"""Start one training run as several trainer processes on this machine (loopback coordinator,
host devices per process): how the multi-process tests run `python -m experiments.train`."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import experiments

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(workdir, config: str, overrides: dict, program=("-m", "experiments.train")) -> list[str]:
    args = [f"--config.{key}={value}" for key, value in overrides.items()]
    return [sys.executable, *program, f"--config={config}", f"--workdir={workdir}", *args]


def environment(devices: int, cache_dir=None, **extra) -> dict:
    """CPU with `devices` host devices and the caller's other XLA flags (the tests' compiler
    flags, tests/conftest.py); a compilation cache shared by the runs when `cache_dir` (a cached
    executable is the compiled one: the numbers do not change).

    The compiler flags matter most here: on the CPU only process 0 of a run is served by the
    compilation cache. JAX writes entries from process 0 alone, and the other processes' keys
    differ from its own (XLA:CPU's topology fingerprint is not the same in each process), so
    every other process compiles every program of every run."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=experiments.with_host_devices(devices))
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    if cache_dir is not None:
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(cache_dir),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1",
        )
    env.update({k: str(v) for k, v in extra.items()})
    return env


class ProcessGroup:
    """`count` trainer processes of one run, `devices` host devices each (`env`: the processes'
    environment instead); `start()` launches them, `wait()` returns their exit statuses. Each
    one's output goes to `<workdir>_process_<i>.log` beside the workdir."""

    def __init__(
        self,
        workdir,
        config: str,
        overrides: dict,
        *,
        count: int = 2,
        devices: int = 2,
        port=None,
        program=("-m", "experiments.train"),
        env=None,
    ):
        self.workdir, self.count = pathlib.Path(workdir), count
        self.port = port or free_port()
        self.logs = [self.workdir.parent / f"{self.workdir.name}_process_{i}.log" for i in range(count)]
        self.commands = [
            train_command(
                workdir,
                config,
                {
                    "distributed": True,
                    "coordinator_address": f"127.0.0.1:{self.port}",
                    "num_processes": count,
                    "process_id": i,
                    "progress_bar": False,
                    **overrides,
                },
                program,
            )
            for i in range(count)
        ]
        self.env = env or environment(devices)
        self.procs: list[subprocess.Popen] = []

    def start(self, only=None) -> ProcessGroup:
        """Launch every process (or those in `only`)."""
        for i, command in enumerate(self.commands):
            if only is None or i in only:
                with open(self.logs[i], "ab") as log:
                    process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log, stderr=log)
                self.procs.append(process)
        return self

    def wait(self, timeout: float = 300) -> list[int]:
        """Exit statuses; a process still running at `timeout` is killed and reported as None."""
        deadline = time.monotonic() + timeout
        statuses = []
        for p in self.procs:
            try:
                statuses.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                statuses.append(None)
        return statuses

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
