"""Metrics as JSON lines (always) and TensorBoard scalars (when tensorboardX is installed), and
the logging window of the steps since the last log line, which checkpoints carry."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

import jax
from absl import logging

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Append `{"step": s, **scalars}` lines to `workdir/metrics.jsonl` (process 0 of a run of
    several: every line once)."""

    def __init__(self, workdir):
        self.path = pathlib.Path(workdir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tensorboard = None
        self.writes = jax.process_index() == 0
        if not self.writes:
            return
        try:
            from tensorboardX import SummaryWriter  # optional
        except ImportError:
            pass
        else:
            self._tensorboard = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))

    def write(self, step: int, scalars: dict) -> None:
        """Record float scalars for `step`."""
        record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        if not self.writes:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, float(value), int(step))

    def close(self) -> None:
        """Flush TensorBoard if open."""
        if self._tensorboard is not None:
            self._tensorboard.close()


def read_metrics(workdir) -> list[dict]:
    """All records of `workdir/metrics.jsonl`, in order."""
    path = pathlib.Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drop_records_after(workdir, step: int) -> None:
    """Rewrite `workdir/metrics.jsonl` without the records of steps after `step` (logged by a
    run stopped before it could checkpoint them), so it reads as one uninterrupted run.

    A line that is not a record (cut off by a kill mid-write, or garbage) is dropped too, but
    not silently: the file as it was is first copied beside it, to
    `metrics.jsonl.corrupt-<time>`, and one warning names the copy and the number of lines.
    """
    path = pathlib.Path(workdir) / METRICS_FILE
    if not path.exists():
        return
    # Bytes, not text: a line of bytes that are not UTF-8 is one unreadable line, not a crash.
    lines = path.read_bytes().splitlines(keepends=True)
    steps = [_step_of(line) for line in lines]
    unreadable = sum(s is None and bool(line.strip()) for s, line in zip(steps, lines))
    kept = [line for s, line in zip(steps, lines) if s is not None and s <= step]
    if len(kept) == len(lines):
        return
    if unreadable:
        copy = path.with_name(f"{METRICS_FILE}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while copy.exists():
            n += 1
            copy = copy.with_name(f"{METRICS_FILE}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        shutil.copyfile(path, copy)
        logging.warning(
            "%s: dropped %d unreadable line%s (not JSON records with a step); the file as it "
            "was is kept in %s.",
            path,
            unreadable,
            "" if unreadable == 1 else "s",
            copy,
        )
    partial = path.with_suffix(".tmp")
    partial.write_bytes(b"".join(kept))
    os.replace(partial, path)


def _step_of(line: bytes) -> int | None:
    """A metrics line's step; None for a blank line or one that is not a record."""
    try:
        return int(json.loads(line.decode("utf-8"))["step"])
    except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
        return None


# Keys of every record of a logging window (and of no evaluation's record): what tells the two
# kinds of record apart in metrics.jsonl.
TRAIN_RECORD_KEYS = ("steps_per_sec", "wall_time")


def evaluated_steps(records: list[dict]) -> set[int]:
    """The steps that have an evaluation record (one without TRAIN_RECORD_KEYS)."""
    return {r["step"] for r in records if not any(k in r for k in TRAIN_RECORD_KEYS)}


# Metrics of a step that are not summed over a logging window.
STEP_METRICS = ("loss", "grad_norm", "finite")


class LogWindow:
    """The training metrics of the steps after `start` (the last logged step): how many, their
    summed loss and task sums, the last grad norm, and the seconds they took.

    A checkpoint holds `saved(step)` and a resumed run continues from `restored(...)`, so a log
    line after a resume covers the same steps with the same sums, added in the same order, as
    the uninterrupted run's: its loss, grad norm and task scalars are bit for bit the same.
    Its seconds are the time the window's steps took in each process: a timing, never equal.

    Device arrays are read in groups (a long window, e.g. log_every=0, does not keep every
    step's arrays alive).
    """

    FOLD_EVERY = 256  # steps whose metrics are read at once

    def __init__(self, start: int, *, sums: dict | None = None):
        # Why the task sums start with the previous window's names at 0: every checkpoint of a
        # run then holds the same tree (0.0 + x == x, so the sums do not change).
        self.start, self.pending, self.steps, self.loss_sum = start, [], 0, 0.0
        self.sums = {k: 0.0 for k in sums or {}}
        self.grad_norm, self.seconds = float("nan"), 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Count the window's seconds from now (they have been spent elsewhere: evaluating)."""
        self.clock = time.perf_counter()

    def elapsed(self) -> float:
        return self.seconds + time.perf_counter() - self.clock

    @property
    def end(self) -> int:
        """The step of the last metrics added."""
        return self.start + self.steps + len(self.pending)

    def add(self, metrics: dict) -> None:
        self.pending.append(metrics)
        if len(self.pending) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        steps, loss_sum, sums, grad_norm = self.steps, self.loss_sum, dict(self.sums), self.grad_norm
        for m in jax.device_get(self.pending):
            steps += 1
            loss_sum += float(m["loss"])
            grad_norm = float(m["grad_norm"])
            for k, v in m.items():
                if k not in STEP_METRICS:
                    sums[k] = sums.get(k, 0.0) + float(v)
        # One statement: a KeyboardInterrupt lands before or after it, never half way.
        self.steps, self.loss_sum, self.sums, self.grad_norm, self.pending = (
            steps,
            loss_sum,
            sums,
            grad_norm,
            [],
        )

    def read(self) -> tuple[int, float, dict, float]:
        """(steps, mean loss, summed aux metrics, last grad norm)."""
        self._fold()
        return self.steps, self.loss_sum / max(self.steps, 1), self.sums, self.grad_norm

    def next(self, step: int) -> LogWindow:
        """The window after a log line at `step`."""
        return LogWindow(step, sums=self.sums)

    def __bool__(self) -> bool:
        return bool(self.pending) or self.steps > 0

    def saved(self, step: int | None) -> dict:
        """What a checkpoint of the state after `step` holds of the window, as JSON values
        (Python floats: exact). `steps` is -1 when the window does not end at `step` (a state in
        hand saved while its step's metrics were being handed over: that window is lost)."""
        try:
            self._fold()
            known = step == self.end
        except Exception:  # the arrays of a step stopped mid-way: its window is lost
            known = False
        return {
            "steps": self.steps if known else -1,
            "loss_sum": self.loss_sum,
            "grad_norm": self.grad_norm,
            "seconds": self.elapsed(),
            "sums": dict(self.sums),
        }

    @classmethod
    def restored(cls, saved: dict | None, step: int) -> LogWindow:
        """The window of a checkpoint at `step` (its `saved(step)`); an empty one when the
        checkpoint holds none or an unknown one (`lost(saved)`)."""
        window = cls(step, sums=(saved or {}).get("sums"))
        if cls.lost(saved):
            return window
        steps = int(saved["steps"])
        window.start, window.steps = step - steps, steps
        window.loss_sum, window.grad_norm = float(saved["loss_sum"]), float(saved["grad_norm"])
        window.seconds = float(saved["seconds"])
        window.sums = {k: float(v) for k, v in saved["sums"].items()}
        return window

    @staticmethod
    def lost(saved: dict | None) -> bool:
        """Whether a checkpoint's window (None: a checkpoint from before windows were saved) is
        unknown."""
        return saved is None or int(saved["steps"]) < 0
