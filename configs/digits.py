"""The default: scikit-learn's 8x8 handwritten digits (1,797 images, 17 grey levels), no download.

Command (the README's first command):
  python -m experiments.train --config configs/digits.py --workdir workdirs/digits
Variants: `configs/digits.py:attention=softmax`, `configs/digits.py:smoke` (a few steps, tests).

What it reaches (bits/dim, time, with and without dropout): BENCHMARKS.md, section 7.
"""

from configs import image_base
from experiments.tasks import image_generation


def get_config(arg: str = ""):
    c = image_generation.schema()
    c.dataset = "digits"
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.model_dim = 64
    c.model.feed_forward_dim = 256
    c.model.dropout = 0.1  # without it the model overfits its 1,500 training images (BENCHMARKS.md)
    c.num_mixtures = 4
    c.learning_rate = 2e-3
    c.schedule = "cosine"
    c.warmup_steps = 100
    c.weight_decay = 0.0
    c.batch_size = 32
    c.num_steps = 3000
    c.log_every = 100
    c.eval_every = 1000
    c.eval_batch_size = 300
    c.checkpoint_every = 1000
    c.sample_every = 1000
    c.num_samples = 64
    return image_base.apply(c, arg)
