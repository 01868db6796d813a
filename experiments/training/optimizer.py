"""Learning-rate schedule and optimizer from a config (optax, nothing hand-written)."""

from __future__ import annotations

import ml_collections
import optax

SCHEDULES = ("constant", "cosine")
OPTIMIZERS = ("radam", "adamw")


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warm-up over `warmup_steps`, then constant or cosine decay to 0 at `num_steps`."""
    if config.schedule not in SCHEDULES:
        raise ValueError(f"config.schedule must be one of {SCHEDULES}, got {config.schedule!r}.")
    lr, warmup = config.learning_rate, config.warmup_steps
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(config.num_steps, warmup + 1))
    if warmup == 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Global-norm clipping, then RAdam (the paper's) or Adam, decoupled weight decay, schedule."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"config.optimizer must be one of {OPTIMIZERS}, got {config.optimizer!r}.")
    scale = (optax.scale_by_radam() if config.optimizer == "radam" else optax.scale_by_adam())
    parts = []
    if config.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(config.grad_clip))
    parts.append(scale)
    if config.weight_decay > 0:
        parts.append(optax.add_decayed_weights(config.weight_decay))
    parts.append(optax.scale_by_learning_rate(make_schedule(config)))
    return optax.chain(*parts)
