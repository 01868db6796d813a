"""CIFAR-10 as in the paper (Table 2): 16 layers, 8 heads x 32 dims, feed-forward 1024,
10 logistics, RAdam lr 2e-4, batch 10; sub-pixels in RGB-interleaved raster order (3072 per
image). Paper: linear 3.40 bits/dim, softmax 3.47 (7 GPU-days each on a P40).

Command:
  python -m experiments.train --config configs/cifar10.py --workdir workdirs/cifar10 \
      --config.manual_dir=/path/with/cifar-10-batches-py
"""

from configs import image_base
from experiments.tasks import image_generation


def get_config(arg: str = ""):
    c = image_generation.paper_config("cifar10")  # 16 layers
    c.learning_rate = 2e-4
    c.batch_size = 10
    c.num_steps = 500000
    c.log_every = 100
    c.eval_every = 20000
    c.checkpoint_every = 5000
    c.sample_every = 20000
    c.eval_batch_size = 50
    return image_base.apply(c, arg)
