"""The default: scikit-learn's 8x8 handwritten digits (1,797 images, 17 grey levels), no download.

Command (the README's first command):
  python -m experiments.train --config configs/digits.py --workdir workdirs/digits
Variants: `configs/digits.py:attention=softmax`, `configs/digits.py:smoke` (a few steps, tests).

Measured on the 2-core CPU machine (jax 0.10.2), 3000 steps in ~4 to 5 minutes (10 to 15 steps/s):
train 1.80 bits/dim, test 1.81; samples are recognisable digits. With dropout 0.0 instead: train
1.54, test 1.93 (best 1.87 at step 2000), i.e. it overfits.
"""

from configs import base, variants


def get_config(arg: str = ""):
    c = base.get_config()
    c.dataset = "digits"
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.model_dim = 64
    c.model.feed_forward_dim = 256
    c.model.dropout = 0.1  # without it test bits/dim rises after step 2000 (1,500 training images)
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
