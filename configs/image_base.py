"""What the image-generation configs (`digits.py`, `mnist.py`, `cifar10.py`) share; not a config
itself.

Each starts from the task's keys and defaults (`experiments.tasks.image_generation`: `schema()`,
or `paper_config(dataset)` for the paper's architectures), changes what differs, and ends with
`apply(c, arg)`: the variants after the colon (`configs/digits.py:smoke,attention=softmax`), a
name from `VARIANTS` below or `key=value`. The trainer rejects keys that are not in the schema,
so a typo in a config or an override fails loudly instead of being ignored. The attention kind's
options are the kind's own names (`attention_options.feature_map=favor` after the colon, or
`--config.model.attention_options.feature_map=favor`); the kind refuses those it does not take.
"""

import ml_collections

from experiments.training import variants


def smoke(c: ml_collections.ConfigDict) -> None:
    """A tiny model and a handful of steps: for tests and a quick check of an install."""
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.model_dim = 16
    c.model.feed_forward_dim = 32
    c.num_mixtures = 2
    c.model.dropout = 0.0
    c.batch_size = 8
    c.num_steps = 6
    c.warmup_steps = 0
    c.log_every = 2
    c.eval_every = 3
    c.eval_batch_size = 16
    c.max_eval_examples = 20
    c.checkpoint_every = 3
    c.sample_every = 6
    c.num_samples = 4
    c.progress_bar = False


VARIANTS = {"smoke": smoke}


def apply(c: ml_collections.ConfigDict, arg: str) -> ml_collections.ConfigDict:
    """`c` with the comma-separated variants of `arg` applied, left to right (`VARIANTS` or
    `key=value`: `experiments.training.variants.apply`)."""
    return variants.apply(c, arg, VARIANTS)
