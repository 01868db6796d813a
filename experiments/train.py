"""Train any experiment: the paper's autoregressive image generator or the copy task.

  python -m experiments.train --config configs/digits.py --workdir workdirs/digits
  python -m experiments.train --config configs/mnist.py:attention=softmax --workdir workdirs/m \
      --config.manual_dir=/path/to/idx --config.num_steps=2000
  python -m experiments.train --config configs/copy.py:attention=linear --workdir workdirs/copy

`config.task` picks the trainer (experiments/training/tasks.py).
Re-running with the same workdir resumes from its newest intact checkpoint. Ctrl-C or SIGTERM
stops after the step in flight with a checkpoint of it (exit status 130 / 143); a second Ctrl-C
stops at once. Every config key is listed in configs/base.py (images) or configs/copy.py;
`--config.key=value` overrides one.
"""

from absl import app, flags
from ml_collections import config_flags

from experiments.cli import check_config_file, one_line_errors
from experiments.training.tasks import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/digits.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/default", "Checkpoints, metrics, samples.")


@one_line_errors
def main(argv):
    del argv
    check_config_file()
    result = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    app.run(main)
