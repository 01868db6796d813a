"""The pieces every task's config is made of, with their defaults.

A task's schema (`experiments/tasks/*.py`, `schema()`) is its own keys plus these groups; a
config holds exactly the schema's keys (the trainer rejects any other, so a typo in a config or
an override fails loudly instead of being ignored) with values of the defaults' types.

`config.model` holds exactly `TransformerConfig`'s fields: the model's stack is
`TransformerConfig(**config.model)`. A field whose default is None ("derive it", e.g.
`softmax_temp` = 1/sqrt(query_dim)) is an ml_collections placeholder of the field's type, so
`--config.model.softmax_temp=0.5` sets it and leaving it alone keeps the library's default.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing

import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from linear_transformers.transformer import TransformerConfig

# Model fields set by the trainer, never by a config (it derives them from config.mesh).
TRAINER_SET_FIELDS = ("sequence_axis",)


def _field_type(hint) -> type:
    """The ConfigDict type of a TransformerConfig field: `int | None` -> int, a mapping ->
    ConfigDict, dtypes (`Any`) -> str (configs name them: "float32", "bfloat16")."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kind = typing.get_origin(hint) or hint
    if kind in (int, float, bool, str):
        return kind
    if isinstance(kind, type) and issubclass(kind, collections.abc.Mapping):
        return ml_collections.ConfigDict
    return str


def _config_value(value):
    if isinstance(value, dict):
        return ml_collections.ConfigDict(value)
    if isinstance(value, (type, jnp.dtype)) or hasattr(value, "dtype"):
        return jnp.dtype(value).name
    return value


def model_fields() -> dict[str, type]:
    """{field: ConfigDict type} of every TransformerConfig field a config may set."""
    hints = typing.get_type_hints(TransformerConfig)
    return {
        f.name: _field_type(hints[f.name])
        for f in dataclasses.fields(TransformerConfig)
        if f.name not in TRAINER_SET_FIELDS
    }


def model(**overrides) -> ml_collections.ConfigDict:
    """TransformerConfig's fields with its defaults, then `overrides`; None defaults become
    typed placeholders (settable from the command line). `dtype` defaults to "float32" (a
    trainer computes in float32 or bfloat16, named)."""
    overrides = {"dtype": "float32", **overrides}
    defaults = TransformerConfig()
    fields = model_fields()
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"not TransformerConfig fields: {unknown}; fields: {sorted(fields)}.")
    c = ml_collections.ConfigDict()
    for name, kind in fields.items():
        value = overrides.get(name, getattr(defaults, name))
        c[name] = config_dict.placeholder(kind) if value is None else _config_value(value)
    return c


def model_overrides() -> ml_collections.ConfigDict:
    """TransformerConfig's fields, all unset: a second stack's differences from config.model
    (the copy task's encoder). `attention_options` is a group (empty: no options)."""
    c = ml_collections.ConfigDict()
    for name, kind in model_fields().items():
        c[name] = (
            ml_collections.ConfigDict() if name == "attention_options" else config_dict.placeholder(kind)
        )
    return c


def optimisation(c: ml_collections.ConfigDict) -> None:
    """The optimizer's keys (experiments/training/optimizer.py)."""
    c.optimizer = "radam"  # radam | adamw
    c.learning_rate = 1e-4
    c.schedule = "constant"  # constant | cosine (to 0 at num_steps) | step
    c.decay_steps = 0  # schedule "step": multiply the rate by decay_factor from here
    c.decay_factor = 0.1
    c.warmup_steps = 0
    c.weight_decay = 0.01
    c.grad_clip = 1.0  # global norm; 0 = off
    c.batch_size = 16
    c.num_steps = 1000


def bookkeeping(c: ml_collections.ConfigDict) -> None:
    """When the trainer logs, evaluates and checkpoints (0 = never, except at the end), and
    whether a resumed run may change the model."""
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 500
    c.keep_checkpoints = 2
    c.progress_bar = True
    # Resuming a workdir with another model (config.json's model section differs: attention
    # kind, options, dtype, ...) is an error unless this is True (fine-tuning the saved weights
    # as the new model; config.json is then rewritten). experiments/training/model_change.py.
    c.allow_model_change = False


def devices(c: ml_collections.ConfigDict) -> None:
    """The device mesh (experiments/training/mesh.py)."""
    # A ("data", "sequence") mesh whose sizes multiply to the device count. sequence > 1 splits
    # every example's time axis over that many devices (sequence parallelism: every attention
    # kind of the model must have a sequence-parallel form); data = batch split (data
    # parallel), -1 = the devices left over. E.g. on 8 devices --config.mesh.sequence=4 gives
    # data=2 x sequence=4.
    c.mesh = ml_collections.ConfigDict({"data": -1, "sequence": 1})
    # Several processes (one per host, or several on one machine) training as one run
    # (experiments/training/processes.py): True joins them with jax.distributed.initialize,
    # which detects SLURM, Open MPI, Kubernetes and Cloud TPU; elsewhere name process 0's
    # HOST:PORT, the number of processes and this process's id (0 .. num_processes - 1).
    c.distributed = False
    c.coordinator_address = config_dict.placeholder(str)
    c.num_processes = config_dict.placeholder(int)
    c.process_id = config_dict.placeholder(int)
    c.coordinator_timeout = 120  # seconds for every process to join, else one clear error
    c.peer_timeout = 60  # seconds without a peer's heartbeat before the others stop, naming it
    # JAX's persistent compilation cache: a run whose programs were compiled before (a resume,
    # the next run of a sweep) loads them instead of compiling (experiments/training/mesh.py,
    # use_compilation_cache). "" turns it off; JAX_COMPILATION_CACHE_DIR, when set, wins.
    c.compilation_cache_dir = "~/.cache/linear_transformers/jax"


# The flat layout of configs written before config.model existed: {old key: new dotted key}.
_FLAT_KEYS = {
    **{
        name: f"model.{name}"
        for name in (
            "attention",
            "attention_options",
            "num_layers",
            "num_heads",
            "model_dim",
            "feed_forward_dim",
            "dropout",
            "attention_dropout",
            "softmax_temp",
            "dtype",
            "cross_attention",
        )
    },
    "encoder_attention": "encoder.attention",
    "encoder_attention_options": "encoder.attention_options",
}


def upgrade_saved_config(saved: dict) -> dict:
    """A workdir's config.json in the current layout: one written with the flat layout (model
    keys at the top level, `softmax_temp = 0.0` and `""` for "unset", the copy task's
    architecture in `model`) is moved into `model` / `encoder` / `architecture`; a current one
    is returned as it is."""
    if isinstance(saved.get("model"), dict):
        return saved
    upgraded = {}
    for key, value in saved.items():
        if key == "model":  # the copy task's "decoder" | "encoder_decoder"
            upgraded["architecture"] = value
            continue
        if key not in _FLAT_KEYS:
            upgraded[key] = value
            continue
        if (key == "softmax_temp" and value == 0.0) or value == "":
            value = None
        group, name = _FLAT_KEYS[key].split(".")
        upgraded.setdefault(group, {})[name] = value
    return upgraded
