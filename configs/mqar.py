"""Multi-query associative recall (Zoology's MQAR: `experiments.tasks.mqar`), CPU-sized: 2
layers of width 64, 2 heads, sequences of 128 with 16 key-value pairs over a vocabulary of 256,
batch 64, AdamW 3e-3, 3000 steps.

  python -m experiments.train --config configs/mqar.py:attention=gated-deltanet --workdir workdirs/mqar_gdn
  python -m experiments.train --config configs/mqar.py:attention=linear,num_kv_pairs=32 \\
      --workdir workdirs/mqar_linear_32

`key=value` overrides a key (`attention=...` the field of config.model). Each run reports the
held-out recall accuracy: the share of queries answered with their key's value.
"""

import ml_collections

from experiments.tasks import mqar
from experiments.training import variants


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """The CPU-sized setting (`experiments.tasks.mqar.schema`), then the overrides in `arg`."""
    return variants.apply(mqar.schema(), arg, {})
