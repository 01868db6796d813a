"""Orbax checkpoints of the whole training state, with clear errors for unusable ones."""

from __future__ import annotations

import json
import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Save and restore `{"params", "opt_state", "rest"}` pytrees by step in `directory`.

    Saves are synchronous: a checkpoint on disk is complete before training goes on, so an
    interrupt or a NaN never leaves only a half-written latest checkpoint.
    """

    def __init__(self, directory, *, max_to_keep: int = 2):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be an int >= 1 (the newest "
                             f"checkpoint is always kept), got {max_to_keep!r}.")
        self.directory = pathlib.Path(directory).expanduser().absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                                 enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state) -> None:
        """Write `state` as checkpoint `step` (a no-op if that step is already saved)."""
        if step in self._manager.all_steps():
            return
        self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._manager.wait_until_finished()

    def restore(self, target, step: int | None = None):
        """Restore checkpoint `step` (default: latest) into the structure, shapes and shardings
        of `target`; a checkpoint that does not fit (another model, a corrupt file) raises."""
        step = self.latest_step() if step is None else step
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        try:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # orbax raises many types; the user needs the path and the cause
            raise ValueError(
                f"cannot restore checkpoint step {step} from {self.directory}: {e}. It is "
                f"corrupt or was written by a different model/optimizer config; use another "
                f"workdir, or delete {self.directory / str(step)} to fall back to an older "
                f"checkpoint.") from e

    def close(self) -> None:
        """Release the manager's resources."""
        self._manager.close()


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_differences(saved: dict, config: dict) -> list[str]:
    """'key: saved -> new' for every (dotted) key whose value differs between two configs."""
    old, new = _flatten(saved), _flatten(config)
    return [f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def restore_run(checkpointer: Checkpointer, target, step: int, workdir, config):
    """`checkpointer.restore(target, step)` for a trainer resuming in `workdir` with `config`.

    When the checkpoint does not fit and the workdir's config.json (the run that wrote it)
    differs from `config`, the error names the keys that differ instead of blaming the files.
    """
    try:
        return checkpointer.restore(target, step)
    except ValueError as e:
        path = pathlib.Path(workdir).expanduser() / "config.json"
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            raise e from e.__cause__
        differences = config_differences(saved, json.loads(config.to_json_best_effort()))
        if not differences:
            raise e from e.__cause__
        raise ValueError(
            f"cannot restore checkpoint step {step} from {checkpointer.directory}: it was written "
            f"by the run configured in {path}, and this config differs in "
            f"{'; '.join(differences)}. Resume with that run's config, or train this one in "
            f"another workdir.") from e.__cause__
