"""The copy task (paper section 4.1): copy n random symbols (of 10) after a separator.

Paper setting (the default): decoder-only, sequences of 128, 4 layers, 8 heads, width 256,
batch 64, RAdam 1e-3 dropping to 1e-4 after 3000 updates, 10,000 updates.

  python -m experiments.train --config configs/copy.py:attention=linear --workdir workdirs/copy
  python -m experiments.train --config configs/copy.py:attention=softmax --workdir workdirs/c_sm
  python -m experiments.train --config configs/copy.py:lsh4 --workdir workdirs/c_lsh4
  python -m experiments.train --config configs/copy.py:performer --workdir workdirs/c_favor

Replication setting (`encoder_decoder`): 4 encoder + 4 decoder layers, 8 heads, width 512,
constant 1e-3; `linformer` puts Linformer attention in the encoder (the decoder keeps
`attention`, as Linformer has no causal form):

  python -m experiments.train --config configs/copy.py:encoder_decoder,attention=linear
  python -m experiments.train --config configs/copy.py:encoder_decoder,linformer

`long` trains on 32768-token sequences with time split over 8 devices (`long` in experiments/tasks/copy.py):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train \\
      --config configs/copy.py:long --workdir workdirs/copy_long

`variable_length` (after the size) draws copies of 1 to (max_length - 1) // 2 - 1 symbols and
packs several to a row (segment ids and positions per example, each computed alone; accuracies
per example); `packed=false` trains on the same examples one per row, for comparison
(measured: BENCHMARKS.md, "The linear-attention family"):

  python -m experiments.train --config configs/copy.py:cpu,variable_length --workdir workdirs/c_packed
  python -m experiments.train --config configs/copy.py:cpu,variable_length,packed=false \
      --workdir workdirs/c_padded

`--config.mesh.sequence=P` splits time over P devices for any config (data parallel over the
rest, `--config.mesh.data`).

`cpu` shrinks any of them to run in minutes on a laptop CPU (sequences of 64, 2 layers, width
128, batch 32, 3000 steps, learning rate 3e-3 then 3e-4 from step 2000). Variants apply left
to right, so put the model and size first: `configs/copy.py:encoder_decoder,cpu,lsh4` (lsh and
linformer sizes follow max_length); `key=value` overrides a key (`mesh.sequence=8` a nested
one, `attention=softmax` the field of config.model, the decoder). config.encoder holds the
encoder's fields where they differ from config.model (`encoder.attention=linformer`).

Expected (the paper, Figure 2, full size): linear reaches softmax's loss, LSH does not. Not run
at full size here (CPU only); the `cpu` variant's results (`python -m experiments.copy_comparison`)
are in BENCHMARKS.md, "Copy task".

The keys and defaults are the task's (`experiments.tasks.copy.schema`), the variants too
(`experiments.tasks.copy.VARIANTS`: the copy comparison runs the same ones).
"""

import ml_collections

from experiments.tasks import copy as copy_task
from experiments.training import variants


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """The paper's setting (`experiments.tasks.copy.schema`), then the variants in `arg`."""
    return variants.apply(copy_task.schema(), arg, copy_task.VARIANTS)
