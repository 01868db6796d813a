"""A trained workdir's model, for the commands that use one (sampling, transcribing):
`load_config`, `restore_trainer`."""

from __future__ import annotations

import json
import pathlib

import jax
import ml_collections

from experiments.training import mesh as mesh_lib
from experiments.training import schemas
from experiments.training.checkpoints import Checkpointer, CheckpointError, DamagedCheckpointError
from experiments.training.trainer import Task, Trainer
from linear_transformers.finite import nonfinite_parameters


def load_config(workdir) -> ml_collections.ConfigDict:
    """The config a workdir was trained with (its config.json)."""
    workdir = pathlib.Path(workdir).expanduser()
    if not workdir.is_dir():
        raise FileNotFoundError(
            f"workdir {workdir} is not a directory: --workdir must be a "
            f"directory written by python -m experiments.train."
        )
    path = workdir / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: --workdir must be a directory written by python -m experiments.train."
        )
    try:
        saved = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(
            f"{path} is not a valid config ({e}); it is written by "
            f"python -m experiments.train when training starts: restore it, or "
            f"re-run training with the run's config to rewrite it."
        ) from None
    return ml_collections.ConfigDict(schemas.upgrade_saved_config(saved))


def restore_trainer(workdir, config: ml_collections.ConfigDict, task: Task, *, step: int | None = None):
    """(trainer on one device holding checkpoint `step` of `workdir` (default: the latest),
    that step). Refuses a damaged checkpoint (naming the others) and non-finite parameters."""
    trainer = Trainer(config, task, mesh_lib.mesh_from_shape((1, 1), jax.devices()[:1]))
    checkpointer = Checkpointer(pathlib.Path(workdir).expanduser() / "checkpoints")
    try:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"there is no checkpoint in {checkpointer.directory}.")
        trainer.state = checkpointer.restore(trainer.state, step)
    except DamagedCheckpointError as e:
        others = [s for s in checkpointer.all_steps() if s != step]
        raise DamagedCheckpointError(
            f"{e} Use another checkpoint with --step (steps: {others}), or resume training to replace it."
        ) from None
    finally:
        checkpointer.close()
    bad = nonfinite_parameters(trainer.eval_model())
    if bad:  # NaN would come out as black pixels or empty transcripts, with no error
        raise FloatingPointError(
            f"the model's parameters are not finite (step {step}): {len(bad)} arrays hold NaN or "
            f"inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})."
        )
    return trainer, step
