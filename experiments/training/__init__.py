"""The trainer and what it is made of, in small pieces.

`trainer.py` is the one training loop and the `Task` interface (tasks live in
experiments/tasks/); `schemas.py` the config groups every task shares and `config_checks.py`
their checks; `variants.py` applies `name,key=value` strings to a config; `optimizer.py`,
`checkpoints.py` (verified Orbax checkpoints), `run_dir.py` and `workdir_lock.py` (the
workdir), `interrupts.py` (signals), `metrics.py`, `mesh.py` (device mesh); `config_diff.py`
names what differs between two configs (a checkpoint's, process 0's, the resumed model's).
"""
