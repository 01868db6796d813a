"""The default: scikit-learn's 8x8 handwritten digits (1,797 images, 17 grey levels), no download.

Command (the README's first command):
  python -m experiments.train --config configs/digits.py --workdir workdirs/digits
Variants: `configs/digits.py:attention=softmax`, `configs/digits.py:smoke` (a few steps, tests).

Expected: see README ("What the default reaches"); measured on this 2-core CPU machine.
"""

from configs import base, variants


def get_config(arg: str = ""):
    c = base.get_config()
    c.dataset = "digits"
    c.num_layers = 4
    c.num_heads = 4
    c.model_dim = 64
    c.feed_forward_dim = 256
    c.dropout = 0.0
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
    return variants.apply(c, arg)
