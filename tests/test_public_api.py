"""Every public name the README documents exists under that name, with a docstring."""

import inspect

import pytest

import linear_transformers as lt
from linear_transformers import (
    attention,
    config,
    generation,
    image_generator,
    interop,
    lm,
    mixture,
    multi_head_attention,
    ops,
    seq2seq,
    transformer,
)
from linear_transformers.interop import builder_arguments, convert

PROMISED_OPS = [
    "softmax_attention",
    "softmax_attention_reference",
    "linear_attention",
    "linear_attention_reference",
    "causal_linear_attention",
    "delta_rule_attention",
    "delta_rule_attention_step",
    "delta_rule_attention_prefill",
    "init_linear_state",
    "linear_attention_step",
    "init_kv_cache",
    "softmax_attention_step",
    "softmax_attention_step_reference",
    "make_feature_map",
    "register_feature_map",
    "registered_feature_maps",
    "favor_projection",
    "elu_plus_one",
    "lsh_attention",
    "lsh_attention_reference",
    "lsh_rotations",
    "linformer_attention",
]
MODULES = [
    lt,
    ops,
    attention,
    generation,
    image_generator,
    lm,
    mixture,
    multi_head_attention,
    seq2seq,
    transformer,
    interop,
    builder_arguments,
    config,
    convert,
]


@pytest.mark.parametrize("name", PROMISED_OPS)
def test_promised_op_exists(name):
    assert callable(getattr(ops, name))


def _public_objects():
    for mod in MODULES:
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if not getattr(obj, "__module__", "").startswith("linear_transformers"):
                continue
            yield f"{mod.__name__}.{name}", obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if inspect.isfunction(member) and not attr.startswith("_"):
                        yield f"{obj.__module__}.{obj.__name__}.{attr}", member


def test_public_functions_classes_and_methods_have_docstrings():
    undocumented = sorted({name for name, obj in _public_objects() if not (obj.__doc__ or "").strip()})
    assert not undocumented, f"missing docstrings: {undocumented}"


def test_baseline_kinds_are_registered():
    assert {"softmax", "linear", "causal-linear", "reformer", "linformer"} <= set(
        lt.registered_attention_kinds()
    )
