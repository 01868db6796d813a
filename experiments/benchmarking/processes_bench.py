"""Training step time of one run as several processes against one process (experiments.train
launched as subprocesses on this machine, CPU host devices, a loopback coordinator).

Each setup trains the same config for `num_steps` steps, logging every `log_every`; a setup's
step time is the median over its log lines after the first (which holds the compile) of
1 / steps_per_sec, the trainer's own timing of the steps between two log lines.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile

import experiments
from experiments.benchmarking import report

ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Setup:
    processes: int
    devices_per_process: int

    @property
    def name(self) -> str:
        plural = "es" if self.processes > 1 else ""
        return f"{self.processes} process{plural} x {self.devices_per_process} devices"

    def __str__(self) -> str:
        return f"{self.processes}x{self.devices_per_process}"

    @classmethod
    def parse(cls, text: str) -> Setup:
        """ "PxD" (e.g. "2x2"): P processes of D devices each."""
        count, _, devices = text.partition("x")
        if not (count.isdigit() and devices.isdigit() and int(count) >= 1 and int(devices) >= 1):
            raise ValueError(f"a setup is PROCESSESxDEVICES like 2x2, got {text!r}.")
        return cls(int(count), int(devices))


@dataclasses.dataclass(frozen=True)
class ProcessesBenchOptions:
    """What `run` measures.

    config: The config file each setup trains.
    num_steps: Steps per setup.
    log_every: Steps per log window (one timing each).
    setups: PROCESSESxDEVICES, first = the reference.
    """

    config: str = "configs/digits.py"
    num_steps: int = 300
    log_every: int = 25
    setups: tuple[Setup, ...] = dataclasses.field(
        default=(Setup(1, 4), Setup(2, 2), Setup(1, 2)), metadata={"parse": Setup.parse}
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_setup(opts: ProcessesBenchOptions, setup: Setup, workdir: pathlib.Path) -> dict:
    """Train `opts.config` as `setup`; its row (step time in ms, steps/s)."""
    overrides = {
        "num_steps": opts.num_steps,
        "log_every": opts.log_every,
        "eval_every": 0,
        "checkpoint_every": 0,
        "sample_every": 0,
        "progress_bar": False,
    }
    port = _free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": experiments.with_host_devices(setup.devices_per_process),
    }
    procs = []
    for i in range(setup.processes):
        args = dict(overrides)
        if setup.processes > 1:
            args.update(
                distributed=True,
                coordinator_address=f"127.0.0.1:{port}",
                num_processes=setup.processes,
                process_id=i,
            )
        command = [
            sys.executable,
            "-m",
            "experiments.train",
            f"--config={opts.config}",
            f"--workdir={workdir}",
            *(f"--config.{k}={v}" for k, v in args.items()),
        ]
        procs.append(
            subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    outputs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"{setup.name}: a process exited {p.returncode}: {err.decode()[-2000:]}")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["steps_per_sec"] for r in records if "steps_per_sec" in r][1:]
    step_ms = statistics.median(1000.0 / r for r in rates)
    return {
        "setup": setup.name,
        "processes": setup.processes,
        "devices": setup.processes * setup.devices_per_process,
        "step_ms": step_ms,
        "steps_per_sec": 1000.0 / step_ms,
        "windows": len(rates),
    }


def run(opts: ProcessesBenchOptions, *, log=print) -> list[dict]:
    """Every setup, one after the other."""
    rows = []
    for setup in opts.setups:
        with tempfile.TemporaryDirectory() as workdir:
            rows.append(run_setup(opts, setup, pathlib.Path(workdir)))
        log(f"{rows[-1]['setup']}: {rows[-1]['step_ms']:.2f} ms/step")
    return rows


def summarize(opts: ProcessesBenchOptions, rows: list[dict], machine: dict) -> report.Report:
    rows = [{**row, "vs_first": row["step_ms"] / rows[0]["step_ms"]} for row in rows]
    return report.Report(rows, ("setup", "devices", "step_ms", "steps_per_sec", "vs_first"))


def run_and_report(
    opts: ProcessesBenchOptions, out_dir, *, log=functools.partial(print, flush=True)
) -> list[dict]:
    """Every setup; prints a table, writes processes.csv/json to `out_dir`; returns the rows."""
    return report.run_and_report("processes", opts, out_dir, run, summarize, log=log)["rows"]
