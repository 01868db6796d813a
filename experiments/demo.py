"""Tiny end-to-end demo: train a causal transformer on arithmetic progressions, then continue
them with its recurrent form (experiments/tasks/progressions.py).

  python -m experiments.demo [--config configs/demo.py:attention=softmax] [--workdir DIR]

The same as `python -m experiments.train --config configs/demo.py --workdir workdirs/demo`;
re-running with the same workdir resumes (a finished run only evaluates).
"""

from absl import app

from experiments import train

if __name__ == "__main__":
    train.define_flags("configs/demo.py", "workdirs/demo")
    app.run(train.main, flags_parser=train.parse_flags)
