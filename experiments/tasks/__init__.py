"""The experiments the trainer runs, one `Task` each (experiments/training/trainer.py);
`config.task` picks one:

  image_generation  image_generation.py  the paper's image generator (MNIST, CIFAR-10, digits)
  copy              copy.py              the copy task, decoder-only or encoder-decoder
  progressions      progressions.py      the demo: arithmetic progressions, continued as an RNN
  speech            speech.py            speech recognition with CTC: phoneme error rate
  mqar              mqar.py              multi-query associative recall (Zoology)

Beside them, what only tasks use: `images.py` (PNG sample grids, for image generation and
image_sampling.py) and `greedy_recompute.py` (greedy decoding of models without a recurrent
form, for copy).
"""

from __future__ import annotations

import ml_collections

from experiments.tasks.copy import Copy
from experiments.tasks.image_generation import ImageGeneration
from experiments.tasks.mqar import Mqar
from experiments.tasks.progressions import Progressions
from experiments.tasks.speech import Speech
from experiments.training import trainer

TASKS = {task.name: task for task in (ImageGeneration, Copy, Progressions, Speech, Mqar)}


def task_class(config: ml_collections.ConfigDict) -> type[trainer.Task]:
    """The Task of `config.task`; a ValueError lists the tasks otherwise."""
    name = config.get("task")
    if name not in TASKS:
        raise ValueError(f"config.task {name!r} is not one of {sorted(TASKS)}.")
    return TASKS[name]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir, **kwargs) -> dict:
    """Run `config`'s task in `workdir` with the trainer (`trainer.train_and_evaluate`)."""
    return trainer.train_and_evaluate(config, workdir, task_class(config), **kwargs)
