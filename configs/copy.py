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

`long` trains on 32768-token sequences with time split over 8 devices (see `long` below):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train \\
      --config configs/copy.py:long --workdir workdirs/copy_long

`--config.mesh.sequence=P` splits time over P devices for any config (data parallel over the
rest, `--config.mesh.data`).

`cpu` shrinks any of them to run in minutes on a laptop CPU (sequences of 64, 2 layers, width
128, batch 32, 3000 steps, learning rate 3e-3 then 3e-4 from step 2000). Variants apply left
to right, so put the model and size first: `configs/copy.py:encoder_decoder,cpu,lsh4` (lsh and
linformer sizes follow max_length); `key=value` overrides a key (`mesh.sequence=8` a nested
one, `attention=softmax` the field of config.model, the decoder). config.encoder holds the
encoder's fields where they differ from config.model (`encoder.attention=linformer`).

Expected (the paper, Figure 2, full size): linear reaches softmax's loss, LSH does not. Not run
at full size here (CPU only). Measured with the `cpu` variant, 3000 steps on one core of the
2-core CPU machine (`python -m experiments.copy_comparison`; BENCHMARKS.md, "Copy task"),
held-out loss / exact copies: decoder softmax 0.0002 / 100%, linear 0.004 / 95%, performer
0.09 / 51%, lsh1 0.45 / 5%, lsh4 0.007 / 97%; encoder-decoder softmax, linear, linformer
encoder and lsh4 all < 2e-5 / 100%.
"""

import ml_collections

from configs import variants
from experiments.tasks import copy as copy_task


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """The paper's setting (`experiments.tasks.copy.schema`), then the variants in `arg`."""
    return variants.apply(copy_task.schema(), arg, VARIANTS)


def encoder_decoder(c):
    """The replication: 4 + 4 layers, 8 heads, width 512, constant learning rate 1e-3."""
    c.architecture = "encoder_decoder"
    c.model.model_dim = 512
    c.model.feed_forward_dim = 2048
    c.schedule = "constant"


def linformer(c):
    """Linformer encoder (its max_length defaults to the longest source)."""
    c.encoder.attention = "linformer"
    c.encoder.attention_options = ml_collections.ConfigDict({"projected_length": max(4, c.max_length // 8)})


def performer(c):
    """Linear attention with FAVOR+ positive orthogonal random features (Performer)."""
    c.model.attention = "linear"
    c.model.attention_options = ml_collections.ConfigDict({"feature_map": "favor"})


def _lsh(rounds):
    def apply(c):
        c.model.attention = "reformer"
        c.model.attention_options = ml_collections.ConfigDict(
            {"num_rounds": rounds, "num_buckets": 8, "chunk_size": max(4, c.max_length // 8)}
        )

    apply.__doc__ = f"Reformer LSH attention, {rounds} hashing round(s), 8 buckets, chunks of max_length / 8."
    return apply


def cpu(c):
    """Minutes on a laptop CPU: sequences of 64, 2 layers, 4 heads, width 128, 3000 steps."""
    c.max_length = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.model_dim = 128
    c.model.feed_forward_dim = 256
    c.batch_size = 32
    c.num_steps = 3000
    c.learning_rate = 3e-3  # 1e-3 learns too slowly for 3000 steps at this size
    c.decay_steps = 2000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 1000


def smoke(c):
    """Seconds: short sequences, a tiny model; for tests."""
    c.max_length = 16
    c.num_symbols = 4
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.model_dim = 64
    c.model.feed_forward_dim = 128
    c.batch_size = 32
    c.num_steps = 10
    c.learning_rate = 3e-3
    c.schedule = "constant"
    c.log_every = 5
    c.eval_every = 10
    c.eval_batches = 2
    c.checkpoint_every = 5
    c.progress_bar = False


def long(c):
    """Sequences of 32768 tokens split over 8 devices (sequence parallelism, LASP-2): the
    decoder-only copy task (copies of 8192..16382 symbols), causal linear attention, 2 layers,
    4 heads, width 64, batch 1 (= the data-parallel replicas: mesh.data = 8 / 8 = 1), 20 steps
    at 3e-3, on an 8-device mesh (data=1 x sequence=8; the 32767 input tokens are padded to
    32768, 4096 per device). Fakes 8 devices on one CPU:

      XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train \\
          --config configs/copy.py:long --workdir workdirs/copy_long

    Measured on the 2-core CPU VM (jax 0.10.2, nothing else running): 0.68 s/step after the
    first 5 steps (2.1 s/step with compilation), i.e. ~48,000 tokens/s; training loss 2.72
    (steps 1-5 mean), 2.69, 2.62, 2.55 (steps 16-20 mean); held-out loss 2.49 (a uniform guess
    over the 10 symbols: 2.30); 31 s wall in all, 1.25 GB peak resident memory. Twenty steps
    show that it trains at this length, not that it learns to copy. Re-running the command
    resumes from the checkpoint (step 20: evaluates only).
    """
    c.max_length = 32768
    c.model.attention = "linear"
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.model_dim = 64
    c.model.feed_forward_dim = 128
    c.batch_size = 1
    c.num_steps = 20
    c.learning_rate = 3e-3
    c.schedule = "constant"
    c.log_every = 5
    c.eval_every = 0  # once, at the end
    c.eval_batches = 1
    c.checkpoint_every = 0  # once, at the end
    c.mesh.sequence = 8


VARIANTS = {
    "encoder_decoder": encoder_decoder,
    "linformer": linformer,
    "performer": performer,
    "lsh1": _lsh(1),
    "lsh4": _lsh(4),
    "lsh8": _lsh(8),
    "cpu": cpu,
    "smoke": smoke,
    "long": long,
}
