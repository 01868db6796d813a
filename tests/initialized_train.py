"""`python tests/initialized_train.py <experiments.train flags>`: the training command in a process
that has called `jax.distributed.initialize` itself ($COORDINATOR, $NUM_PROCESSES, $PROCESS_ID),
as a user's own launcher does: how the multi-process tests check that the trainer uses that
runtime without config.distributed."""

import os
import sys

import jax
from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import train  # noqa: E402
from experiments.config_cli import parse_flags  # noqa: E402

if __name__ == "__main__":
    jax.distributed.initialize(
        os.environ["COORDINATOR"], int(os.environ["NUM_PROCESSES"]), int(os.environ["PROCESS_ID"])
    )
    train.define_flags("configs/digits.py", "workdirs/default")
    app.run(train.main, flags_parser=parse_flags)
