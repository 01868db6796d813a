"""On resume, refuse a config whose model is not the one the checkpoint was trained as.

A checkpoint restores into any model with the same parameter names and shapes, so switching
`config.model.attention` from "linear" to "softmax" (or its feature map, dtype, temperature...)
would otherwise go on training the saved weights as another function, silently. The workdir's
config.json records the model the weights were trained as; every difference from it is one
error naming each key (old -> new), unless `config.allow_model_change=True` says it is meant
(fine-tuning a trained model as another kind): then training goes on and config.json is
rewritten with the new config.
"""

from __future__ import annotations

import json
import pathlib

import ml_collections
from absl import logging

from experiments.training.config_diff import differences, format_difference
from experiments.training.schemas import upgrade_saved_config

# The keys that define the model's function: groups of fields (the stack; the copy task's
# encoder) and single keys (the copy task's architecture, the image head's mixture size).
MODEL_GROUPS = ("model", "encoder")
MODEL_KEYS = ("architecture", "num_mixtures")

# Fields of a model group that do not change the function a checkpoint computes: dropout is
# applied only in training (evaluation, sampling and the recurrent forms run without it), so a
# new rate changes how the saved weights go on being trained, as a new learning rate does, not
# what they compute. Every other field counts, options and dtype included.
TRAINING_ONLY_FIELDS = ("dropout", "attention_dropout")
# Fields that change how the same function is compiled, not the function: how many of the
# stack's layers one scan iteration runs.
COMPILATION_FIELDS = ("unroll_layers",)
# Attention options that choose how a kind computes its function, not which function: the form
# (every form of a kind gives the same outputs, tests/ops) and the chunked form's chunk length.
# LSH's chunk_size is not among them: its chunks are what attends to what.
_FORMS = ("implementation", "impl", "chunk_size")
FORM_OPTIONS = {
    **dict.fromkeys(("linear", "causal-linear", "retention", "simple-gla", "gla"), _FORMS),
    "softmax": ("implementation",),
}


class ModelChangeError(ValueError):
    """A resumed run whose config changes the model its checkpoint was trained as."""


def model_changes(saved: dict, config: dict) -> list[str]:
    """'key: old -> new' for every model-defining key (`MODEL_GROUPS`' fields, `MODEL_KEYS`)
    whose value differs between a saved config (config.json, any layout) and `config` (both as
    JSON dicts). A key the saved config does not record (written before the key existed) is not
    compared: nothing says what it was."""
    saved = upgrade_saved_config(saved)
    old, new = {}, {}  # the compared keys, dotted, with their values
    ignored = set(TRAINING_ONLY_FIELDS) | set(COMPILATION_FIELDS)
    for group in MODEL_GROUPS:
        group_old, group_new = saved.get(group), config.get(group)
        if not isinstance(group_old, dict) or not isinstance(group_new, dict):
            continue
        group_old, group_new = _without_form_options(group_old), _without_form_options(group_new)
        for name in sorted(set(group_old) & set(group_new) - ignored):
            old[f"{group}.{name}"], new[f"{group}.{name}"] = group_old[name], group_new[name]
    for key in MODEL_KEYS:
        if key in saved and key in config:
            old[key], new[key] = saved[key], config[key]
    return [format_difference(*d) for d in differences(old, new)]


def _without_form_options(group: dict) -> dict:
    """A model group with the attention options of `FORM_OPTIONS` left out (of self- and
    cross-attention, each by its own kind)."""
    group = dict(group)
    for kind_key, options_key in (
        ("attention", "attention_options"),
        ("cross_attention", "cross_attention_options"),
    ):
        options = group.get(options_key)
        if isinstance(options, dict):
            form = FORM_OPTIONS.get(group.get(kind_key), ())
            group[options_key] = {k: v for k, v in options.items() if k not in form}
    return group


def check_resumed_model(workdir, config: ml_collections.ConfigDict, step: int) -> None:
    """Raise ModelChangeError if `config`'s model differs from the one recorded in `workdir`'s
    config.json (resuming checkpoint `step`), unless config.allow_model_change, which logs the
    differences instead. A config.json that is absent, unreadable or not a config is not
    compared (a damaged one is rewritten when training starts)."""
    path = pathlib.Path(workdir).expanduser() / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict):
        return
    changes = model_changes(saved, json.loads(config.to_json_best_effort()))
    if not changes:
        return
    if config.get("allow_model_change", False):
        logging.warning(
            "resuming checkpoint step %d with a changed model (config.allow_model_change): %s; "
            "%s is rewritten with this config.",
            step,
            "; ".join(changes),
            path,
        )
        return
    raise ModelChangeError(
        f"checkpoint step {step} in {path.parent} was trained as another model than this "
        f"config's: {'; '.join(changes)} ({path} records the saved run). Resume with that "
        f"model, train this config in another workdir, or pass --config.allow_model_change=True "
        f"to go on training the saved weights as this model (fine-tuning)."
    )
