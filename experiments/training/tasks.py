"""One entry point for every experiment: `config.task` picks the trainer."""

from __future__ import annotations

import ml_collections

from experiments.training import copy_loop, loop

TRAINERS = {"image_generation": loop.train_and_evaluate, "copy": copy_loop.train_and_evaluate}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir, **kwargs) -> dict:
    """Run the trainer of `config.task` (see TRAINERS) on `config` in `workdir`."""
    task = config.get("task")
    if task not in TRAINERS:
        raise ValueError(f"config.task {task!r} is not one of {sorted(TRAINERS)}.")
    return TRAINERS[task](config, workdir, **kwargs)
