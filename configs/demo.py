"""Demo: a tiny causal linear transformer learns arithmetic progressions, then generates as an RNN
(`experiments.tasks.progressions`).

Command:
  python -m experiments.demo --config configs/demo.py
  python -m experiments.demo --config configs/demo.py:attention=softmax --workdir workdirs/demo_sm

Each sequence is a, a+d, a+2d, ... (mod vocab_size) with random a and d; the model sees a
3-token prompt and must continue it. MEASURED_PLACEHOLDER
"""

import ml_collections

from configs import variants
from experiments.tasks import progressions


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    return variants.apply(progressions.schema(), arg, {})
