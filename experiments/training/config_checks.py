"""Reject config keys a trainer does not know and values it cannot use, before any work.

The values checked here are those of the groups every task shares (experiments/training/
schemas.py: optimisation, bookkeeping, devices, model); no task's own keys. A task checks those
in its `Task.check()`, sizes with `check_sizes(config, positive=..., non_negative=...)`.
"""

from __future__ import annotations

import difflib

import ml_collections

from experiments.training import mesh as mesh_lib
from experiments.training import processes
from experiments.training.optimizer import OPTIMIZERS, SCHEDULES
from linear_transformers.attention import (
    attention_class,
    check_attention_options,
    registered_attention_kinds,
    sequence_parallel_kinds,
)
from linear_transformers.transformer import TransformerConfig

# Sizes of the shared groups (experiments/training/schemas.py); a task checks its own keys' sizes
# in its Task.check() with `check_sizes`.
_POSITIVE = ("batch_size", "keep_checkpoints")
_NON_NEGATIVE = (
    "num_steps",
    "warmup_steps",
    "log_every",
    "eval_every",
    "checkpoint_every",
    "weight_decay",
    "grad_clip",
    "decay_steps",
    "decay_factor",
)
_WHY = {"keep_checkpoints": " (0 would leave no checkpoint to resume from)"}


def check_sizes(
    config: ml_collections.ConfigDict, *, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()
) -> None:
    """config[key] >= 1 for every key in `positive` and >= 0 for every key in `non_negative`,
    else a ValueError naming the first key that is not and its value."""
    for key in positive:
        if not config[key] >= 1:
            raise ValueError(f"config.{key} must be >= 1, got {config[key]!r}{_WHY.get(key, '')}.")
    for key in non_negative:
        if not config[key] >= 0:
            raise ValueError(f"config.{key} must be >= 0, got {config[key]!r}.")


def check_keys(
    config: ml_collections.ConfigDict,
    defaults: ml_collections.ConfigDict,
    where: str,
    prefix: str = "config.",
) -> None:
    """Every key of `defaults` and no other, in every group of keys (a group whose default is
    empty, like `attention_options`, is free-form: its kind checks it), else a ValueError
    naming the difference; then the value types (`check_types`)."""
    unknown = sorted(set(config) - set(defaults))
    missing = sorted(set(defaults) - set(config))
    if unknown or missing:
        close = {k: difflib.get_close_matches(k, list(defaults), n=1) for k in unknown}
        hints = [f"{prefix}{m[0]} (for {prefix}{k})" for k, m in close.items() if m]
        raise ValueError(
            f"{prefix[:-1]} keys not understood: {unknown}; missing: {missing}."
            + (f" Did you mean {', '.join(hints)}?" if hints else "")
            + f" The keys of {prefix[:-1]} are {sorted(defaults)} ({where})."
        )
    for key, default in defaults.items():
        value = config[key]
        if (
            isinstance(default, ml_collections.ConfigDict)
            and default
            and isinstance(value, ml_collections.ConfigDict)
        ):
            check_keys(value, default, where, f"{prefix}{key}.")
    if prefix == "config.":
        check_types(config, defaults)


class ConfigTypeError(TypeError, ValueError):
    """A config value of the wrong type (a ValueError too: every config error is one)."""


_TYPE_NAMES = {bool: "a bool", int: "an int", float: "a number", str: "a string"}


def check_types(
    config: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict, prefix: str = "config."
) -> None:
    """Every value has its default's type (ints are not bools, numbers are not None), else a
    ConfigTypeError naming the key. ConfigDict itself refuses most wrong types, but lets a bool into
    an int field and None into any field."""
    for key, default in defaults.items():
        value = config[key]
        if isinstance(default, ml_collections.ConfigDict):
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigTypeError(
                    f"{prefix}{key} must be a group of keys like {sorted(default)}, got {value!r}."
                )
            check_types(value, default, f"{prefix}{key}.")
            continue
        kind = type(default)
        if kind not in _TYPE_NAMES:
            continue
        allowed = (int, float) if kind is float else (kind,)
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, allowed):
            raise ConfigTypeError(
                f"{prefix}{key} must be {_TYPE_NAMES[kind]}, got {value!r} ({type(value).__name__})."
            )


def check_attention(
    group: ml_collections.ConfigDict, key: str = "attention", prefix: str = "config."
) -> None:
    """group[key] is a registered kind and group[key + "_options"] are options it takes, with
    usable values: the kind's options class is built from them (the rules the layers apply), so
    a bad option fails here, naming the key, rather than when the model is built."""
    if group[key] not in registered_attention_kinds():
        raise ValueError(
            f"{prefix}{key} {group[key]!r} is not a registered attention kind; "
            f"registered: {registered_attention_kinds()}."
        )
    try:
        check_attention_options(group[key], dict(group[key + "_options"] or {}))
    except ValueError as e:
        raise ValueError(f"{prefix}{key}_options: {e}") from None


COMPUTE_DTYPES = ("float32", "bfloat16")


def model_config(
    group: ml_collections.ConfigDict, prefix: str = "config.model.", **fields
) -> TransformerConfig:
    """`TransformerConfig(**group, **fields)` (`fields`: what the trainer sets, e.g.
    sequence_axis), its errors prefixed with where the values came from."""
    check_attention(group, "attention", prefix)
    if group.get("cross_attention") is not None:
        check_attention(group, "cross_attention", prefix)
    if group.get("dtype") not in COMPUTE_DTYPES:
        raise ValueError(
            f"{prefix}dtype must be one of {COMPUTE_DTYPES} (the computation dtype; "
            f"parameters are stored in float32), got {group.get('dtype')!r}."
        )
    try:
        return TransformerConfig(**{**group.to_dict(), **fields})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{prefix[:-1]}: {e}") from None


def check_values(config: ml_collections.ConfigDict) -> None:
    """The checks of the groups every task shares (schemas.py): sizes, rates, optimizer,
    schedule, model, mesh, processes. A task's own keys are its Task.check()'s."""
    check_sizes(config, positive=_POSITIVE, non_negative=_NON_NEGATIVE)
    if not config.learning_rate > 0:
        raise ValueError(f"config.learning_rate must be > 0, got {config.learning_rate!r}.")
    if config.optimizer not in OPTIMIZERS:
        raise ValueError(f"config.optimizer must be one of {OPTIMIZERS}, got {config.optimizer!r}.")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"config.schedule must be one of {SCHEDULES}, got {config.schedule!r}.")
    model_config(config.model)
    mesh_lib.check_mesh_values(config.mesh)
    processes.check_values(config)


def check_mesh(
    config: ml_collections.ConfigDict,
    *,
    kinds: dict[str, str],
    sequence_length: int | None = None,
    device_count: int | None = None,
) -> None:
    """config.mesh fits the run: with mesh.sequence > 1 every attention kind in `kinds`
    ({config key: kind}) has a sequence-parallel form and `sequence_length` (when given: the
    trainer does not pad time itself) divides by mesh.sequence; then data x sequence must equal
    the device count (default: all devices). Each failure is a ValueError naming the values."""
    mesh_lib.check_mesh_values(config.mesh)
    sequence = config.mesh.sequence
    if sequence > 1:
        for key, kind in kinds.items():
            if not attention_class(kind).has_sequence_parallel_form:
                raise ValueError(
                    f"config.mesh.sequence={sequence} splits time over devices, but config.{key}"
                    f"={kind!r} has no sequence-parallel form; use one of "
                    f"{sequence_parallel_kinds()}, or config.mesh.sequence=1."
                )
        if sequence_length is not None and sequence_length % sequence:
            raise ValueError(
                f"config.mesh.sequence={sequence} must divide the sequence length "
                f"{sequence_length} (each device holds an equal block of time); choose a divisor "
                f"of {sequence_length}."
            )
    data, _ = mesh_lib.mesh_shape(config.mesh, device_count)
    for key in ("batch_size",):
        if config[key] % data:
            raise ValueError(
                f"config.{key}={config[key]} must be a multiple of the {data} "
                f"data-parallel replicas it is split over (config.mesh.data={data}"
                f", sequence={sequence})."
            )
