"""Learning-rate schedule and optimizer from a config (optax), and the guarded update step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from linear_transformers.attention import NO_WEIGHT_DECAY

SCHEDULES = ("constant", "cosine", "step")
OPTIMIZERS = ("radam", "adamw")


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warm-up over `warmup_steps`, then constant, cosine decay to 0 at `num_steps`, or
    "step": multiplied by `decay_factor` from step `decay_steps` on (the paper's copy task:
    1e-3, then 1e-4 after 3000 updates)."""
    if config.schedule not in SCHEDULES:
        raise ValueError(f"config.schedule must be one of {SCHEDULES}, got {config.schedule!r}.")
    lr, warmup = config.learning_rate, config.warmup_steps
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(config.num_steps, warmup + 1))
    if config.schedule == "step":
        if not config.decay_steps > warmup:
            raise ValueError(
                f"config.schedule='step' needs config.decay_steps > warmup_steps "
                f"({warmup}), got {config.decay_steps}."
            )
        after = optax.piecewise_constant_schedule(lr, {config.decay_steps - warmup: config.decay_factor})
    else:
        after = optax.constant_schedule(lr)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def weight_decay_mask(params):
    """True for each parameter weight decay applies to: all but those named in
    `attention.NO_WEIGHT_DECAY` (the delta rule's decay rates), wherever they sit."""

    def applies(path, _):
        names = {getattr(key, "key", getattr(key, "name", None)) for key in path}
        return not names & NO_WEIGHT_DECAY

    return jax.tree_util.tree_map_with_path(applies, params)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Global-norm clipping, then RAdam (the paper's) or Adam, decoupled weight decay (not of the
    parameters `weight_decay_mask` leaves out), schedule."""
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"config.optimizer must be one of {OPTIMIZERS}, got {config.optimizer!r}.")
    scale = optax.scale_by_radam() if config.optimizer == "radam" else optax.scale_by_adam()
    parts = []
    if config.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(config.grad_clip))
    parts.append(scale)
    if config.weight_decay > 0:
        parts.append(optax.add_decayed_weights(config.weight_decay, mask=weight_decay_mask))
    parts.append(optax.scale_by_learning_rate(make_schedule(config)))
    return optax.chain(*parts)


def apply_if_finite(tx: optax.GradientTransformation, state: dict, loss, grads):
    """One optimizer update of `state` {"step", "params", "opt_state", "rest"}, applied only if
    the loss and every gradient are finite; returns (new_state, finite). The update advances
    "step" by one; a non-finite step changes nothing, so the state in memory stays the last
    good one.

    Not `optax.apply_if_finite`: that wrapper checks the gradients but not the loss, applies
    the update anyway after `max_consecutive_errors`, and adds its counters to the optimizer
    state, which would change the layout of every existing checkpoint. Here a non-finite step
    is never applied, and the step counter and state stay those of the last good step."""
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    finite = jnp.isfinite(loss) & jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
    )
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rest": state["rest"]}
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state), finite
