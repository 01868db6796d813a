"""Reject config keys the trainer does not know and values it cannot use, before any work."""

from __future__ import annotations

import ml_collections

from configs import base
from experiments.training.optimizer import OPTIMIZERS, SCHEDULES
from linear_transformers.attention import check_attention_options, registered_attention_kinds

_POSITIVE = ("num_layers", "num_heads", "model_dim", "feed_forward_dim", "num_mixtures",
             "batch_size", "eval_batch_size", "num_samples")
_NON_NEGATIVE = ("num_steps", "warmup_steps", "log_every", "eval_every", "checkpoint_every",
                 "sample_every", "keep_checkpoints", "max_train_examples", "max_eval_examples",
                 "weight_decay", "grad_clip", "dropout", "attention_dropout", "softmax_temp")


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError naming every unknown key or unusable value of a trainer config."""
    known = set(base.get_config())
    unknown = sorted(set(config) - known)
    missing = sorted(known - set(config))
    if unknown or missing:
        raise ValueError(f"config keys not understood: {unknown}; missing: {missing}. The "
                         f"trainer's keys are listed in configs/base.py.")
    for key in _POSITIVE:
        if not config[key] >= 1:
            raise ValueError(f"config.{key} must be >= 1, got {config[key]!r}.")
    for key in _NON_NEGATIVE:
        if not config[key] >= 0:
            raise ValueError(f"config.{key} must be >= 0, got {config[key]!r}.")
    if not config.learning_rate > 0:
        raise ValueError(f"config.learning_rate must be > 0, got {config.learning_rate!r}.")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"config.optimizer must be one of {OPTIMIZERS}, got {config.optimizer!r}.")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"config.schedule must be one of {SCHEDULES}, got {config.schedule!r}.")
    if config.attention not in registered_attention_kinds():
        raise ValueError(f"config.attention {config.attention!r} is not a registered attention "
                         f"kind; registered: {registered_attention_kinds()}.")
    check_attention_options(config.attention, dict(config.attention_options))
    if config.model_dim % 4:
        raise ValueError(f"config.model_dim must be a multiple of 4 (half embedding, half "
                         f"sine/cosine position encoding), got {config.model_dim}.")
