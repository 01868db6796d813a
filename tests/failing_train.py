"""`python tests/failing_train.py <experiments.train flags>`: the training command, except that
the process whose id is in $FAIL_PROCESS raises RuntimeError when it is about to run step
$FAIL_AT_STEP: how the multi-process tests make one process fail with an error."""

import os
import sys

import jax
from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import train  # noqa: E402
from experiments.config_cli import parse_flags  # noqa: E402
from experiments.training import trainer  # noqa: E402

_train = trainer.Trainer.train


def failing_train(self, batch):
    step = int(jax.device_get(self.state["step"]))
    if jax.process_index() == int(os.environ["FAIL_PROCESS"]) and step == int(os.environ["FAIL_AT_STEP"]):
        raise RuntimeError(f"injected failure before step {step}")
    return _train(self, batch)


if __name__ == "__main__":
    trainer.Trainer.train = failing_train
    train.define_flags("configs/digits.py", "workdirs/default")
    app.run(train.main, flags_parser=parse_flags)
