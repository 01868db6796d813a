"""The trainers and what they share, in small pieces.

`experiments.train` is the command line; `config.task` picks the trainer: `loop.py` (image
generators) or `copy_loop.py` (the copy task). Shared: `optimizer.py`, `checkpoints.py`
(verified Orbax checkpoints), `run_dir.py` and `workdir_lock.py` (the workdir), `interrupts.py`
(signals), `metrics.py`, `mesh.py` (device mesh), `config_checks.py`; `sampling.py` generates
from a workdir or from the authors' models.
"""
