"""Train any experiment: the paper's image generator, the copy task, speech recognition, or the demo.

  python -m experiments.train --config configs/digits.py --workdir workdirs/digits
  python -m experiments.train --config configs/mnist.py:attention=softmax --workdir workdirs/m \
      --config.manual_dir=/path/to/idx --config.num_steps=2000
  python -m experiments.train --config configs/copy.py:attention=linear --workdir workdirs/copy
  python -m experiments.train --config configs/speech.py:cpu,linear --workdir workdirs/speech

`config.task` picks the task (experiments/tasks/); one trainer runs them all
(experiments/training/trainer.py). Re-running with the same workdir resumes from its newest
intact checkpoint. Ctrl-C or SIGTERM stops after the step in flight with a checkpoint of it (exit
status 130 / 143); a second Ctrl-C stops at once (in a checkpoint save: once it is complete). A
task's keys and defaults are its `schema()`
(`config.model` holds TransformerConfig's fields); `--config.key=value` overrides one
(`--config.model.attention=softmax`, `--config.model.attention_options.feature_map=favor`, or a
group whole as JSON: `--config.model.attention_options='{"feature_map": "favor"}'`). Resuming
with another model (config.json's model section differs) is an error unless
`--config.allow_model_change=True`. A mistake on the command line ends in one line, exit 1.
"""

from absl import app, flags

from experiments import tasks
from experiments.cli import check_config_file, one_line_errors
from experiments.config_cli import define_config_flag, parse_flags


def define_flags(config: str, workdir: str) -> None:
    """--config (a config file, `path:variants`) and --workdir, with these defaults."""
    define_config_flag(config)
    flags.DEFINE_string("workdir", workdir, "Checkpoints, metrics, samples.")


@one_line_errors
def main(argv):
    del argv  # `one_line_errors` refused any positional argument.
    check_config_file()
    result = tasks.train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    define_flags("configs/digits.py", "workdirs/default")
    app.run(main, flags_parser=parse_flags)
