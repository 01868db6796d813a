"""Demo: a tiny causal linear transformer learns arithmetic progressions, then generates as an RNN
(`experiments.tasks.progressions`).

Command:
  python -m experiments.demo --config configs/demo.py
  python -m experiments.demo --config configs/demo.py:attention=softmax --workdir workdirs/demo_sm

Each sequence is a, a+d, a+2d, ... (mod vocab_size) with random a and d; the model sees a
3-token prompt and must continue it. What it reaches (time, losses, continuation accuracy,
parallel vs recurrent logits): BENCHMARKS.md, section 7.
"""

import ml_collections

from experiments.tasks import progressions
from experiments.training import variants


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    return variants.apply(progressions.schema(), arg, {})
