"""A trainer's workdir for one run: checked before any work, locked, resumed, checkpointed.

    with RunDirectory(workdir, config) as run:
        state, step = run.resume(initial_state)   # newest intact checkpoint, or (initial, 0)
        run.write_config(config)                  # only once everything has been accepted
        ... run.save(state) ...

The checkpoint of a state is labelled by the state's own "step" entry, so the label and the
weights it holds cannot disagree however the run is stopped.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile

import jax
from absl import logging

from experiments.training import interrupts, processes
from experiments.training.checkpoints import Checkpointer, restore_newest_intact
from experiments.training.metrics import drop_records_after
from experiments.training.model_change import check_resumed_model
from experiments.training.workdir_lock import WorkdirInUseError, WorkdirLock


def _check_directory(path: pathlib.Path, what: str) -> None:
    """Create `path` if needed and prove it is a writable directory, else one clear error."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"{what} {path} is a file, not a directory; pass a directory (it is created if missing)."
        )
    for action, attempt in (
        ("created", lambda: path.mkdir(parents=True, exist_ok=True)),
        ("read", lambda: os.listdir(path)),
        ("written", lambda: tempfile.TemporaryFile(dir=path).close()),
    ):
        try:
            attempt()
        except OSError as e:
            raise PermissionError(
                f"{what} {path} cannot be {action} ({e.strerror or e}); "
                f"training reads and writes it: fix its permissions or "
                f"choose another."
            ) from None


class RunDirectory:
    """`workdir` checked and locked for one run (context manager), with its checkpoints."""

    def __init__(self, workdir, config):
        self.path = pathlib.Path(workdir).expanduser()
        _check_directory(self.path, "workdir")
        _check_directory(self.path / "checkpoints", "checkpoint directory")
        self.config = config
        self._lock = WorkdirLock(self.path)
        self.checkpointer: Checkpointer | None = None

    def __enter__(self):
        # One lock per run, whatever its number of processes: process 0 takes it and tells the
        # others whether it could.
        refusal = ""
        if jax.process_index() == 0:
            try:
                self._lock.acquire()
            except WorkdirInUseError as e:
                refusal = str(e)
        refusal = processes.from_process_0("workdir_lock", refusal)
        if refusal:
            raise WorkdirInUseError(refusal)
        try:
            self.checkpointer = Checkpointer(
                self.path / "checkpoints", max_to_keep=self.config.keep_checkpoints
            )
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc):
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            self._lock.release()

    def resume(self, state):
        """(state, step) of the newest intact checkpoint, or (state, 0). A checkpoint of
        another model is refused: by its shapes (restore_newest_intact), else by config.json's
        model section (model_change.check_resumed_model; config.allow_model_change lets it
        through). Metrics recorded after that step (by a run killed before it could
        checkpoint) are dropped, so the metrics file reads as one uninterrupted run."""
        state, step = restore_newest_intact(self.checkpointer, state, self.path, self.config)
        if step > 0:
            check_resumed_model(self.path, self.config, step)
        if jax.process_index() == 0:
            drop_records_after(self.path, step)
        return state, step

    def write_config(self, config) -> None:
        """Record the run's config (call once config, data, model and checkpoint are accepted:
        a run that fails earlier leaves the workdir's config.json as it was)."""
        if jax.process_index() == 0:
            (self.path / "config.json").write_text(config.to_json_best_effort(indent=2))

    def save(self, state) -> int:
        """Checkpoint `state` under its own step; return that step."""
        step = int(jax.device_get(state["step"]))
        self.checkpointer.save(step, state)
        return step

    def latest_step(self) -> int | None:
        return self.checkpointer.latest_step()

    @contextlib.contextmanager
    def stopping_at_step_boundaries(self, state_in_hand):
        """The training loop's context: yields the SignalFlag of `interrupts.deferred_signals`
        (stop with `stop` between steps); a KeyboardInterrupt raised inside (a second Ctrl-C, a
        callback) checkpoints `state_in_hand()` under its own step, on a single process (with
        several, the processes could not agree on the step: the newest checkpoint stands)."""
        with interrupts.deferred_signals() as signals:
            try:
                yield signals
            except interrupts.Interrupted:
                raise
            except KeyboardInterrupt:
                if not processes.multiprocess():
                    save_state_in_hand(self, state_in_hand())
                raise

    def stop(self, signum: int, state) -> None:
        """After a step, on signal `signum` (SIGINT/SIGTERM): checkpoint `state`, raise
        Interrupted."""
        raise interrupts.Interrupted(signum, self.save(state), self.checkpointer.directory)


def save_state_in_hand(run: RunDirectory, state) -> None:
    """Checkpoint `state` on an abrupt stop (a KeyboardInterrupt raised mid-step). The state
    carries its own step, so whatever it holds is labelled right; if the stop came while the
    step's inputs were being handed over, its buffers are gone and nothing is written; None
    (a state whose last step was not finite) is not written either."""
    if state is None:
        logging.warning(
            "stopped without a new checkpoint (the last step was not finite); the latest is step %s in %s.",
            run.latest_step(),
            run.checkpointer.directory,
        )
        return
    try:
        step = run.save(state)
    except Exception as e:  # deleted (donated) buffers: jax raises RuntimeError, or others
        logging.warning(
            "stopped without a new checkpoint (%s); the latest is step %s in %s.",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
            run.latest_step(),
            run.checkpointer.directory,
        )
    else:
        logging.warning("stopped: checkpoint step %d saved in %s.", step, run.checkpointer.directory)
