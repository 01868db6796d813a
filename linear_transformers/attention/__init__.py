"""Attention cores, one file per kind, and their registry (`base.py`: the interface, the
return-order rule and how a kind is added).

  base.py       AttentionCore, register_attention, make_attention_core, option checking
  softmax.py    "softmax"                      (ops/softmax.py)
  linear.py     "linear", "causal-linear"      (ops/linear.py, ops/causal_linear.py)
  reformer.py   "reformer"                     (ops/lsh.py)
  linformer.py  "linformer"                    (ops/linformer.py)
  gated.py      what the gated kinds share     (ops/gated_linear/)
  retention.py  "retention" (RetNet)
  gla.py        "simple-gla", "gla"
  delta.py      "deltanet", "gated-deltanet", "kda"   (ops/delta_rule/)

Importing the package registers every kind above.
"""

from linear_transformers.attention.base import (
    AttentionCore,
    CausalFormOptions,
    NoOptions,
    attention_class,
    attention_options,
    check_attention_options,
    check_inference_mode,
    check_sequence_axis,
    kinds_with,
    make_attention_core,
    register_attention,
    registered_attention_kinds,
    sequence_parallel_kinds,
    unregister_attention,
)
from linear_transformers.attention.delta import (
    NO_WEIGHT_DECAY,
    DeltaNet,
    DeltaNetOptions,
    DeltaRuleCore,
    DeltaState,
    GatedDeltaNet,
    GatedDeltaNetOptions,
    KimiDeltaAttention,
)
from linear_transformers.attention.gated import GatedLinearCore, GatedOptions, GatedState, HeadNorm
from linear_transformers.attention.gla import GLA, GLAOptions, SimpleGLA, SimpleGLAOptions
from linear_transformers.attention.linear import (
    CausalLinearAttention,
    FeatureProjection,
    LinearAttention,
    LinearOptions,
)
from linear_transformers.attention.linformer import LinformerAttention, LinformerMemory, LinformerOptions
from linear_transformers.attention.reformer import HashRotations, ReformerAttention, ReformerOptions
from linear_transformers.attention.retention import Retention, RetentionOptions, retention_log_decay
from linear_transformers.attention.softmax import SoftmaxAttention, SoftmaxMemory, SoftmaxOptions

__all__ = [
    "NO_WEIGHT_DECAY",
    "AttentionCore",
    "CausalFormOptions",
    "NoOptions",
    "attention_class",
    "attention_options",
    "check_attention_options",
    "check_inference_mode",
    "check_sequence_axis",
    "kinds_with",
    "make_attention_core",
    "register_attention",
    "registered_attention_kinds",
    "sequence_parallel_kinds",
    "unregister_attention",
    "DeltaNet",
    "DeltaNetOptions",
    "DeltaRuleCore",
    "DeltaState",
    "GatedDeltaNet",
    "GatedDeltaNetOptions",
    "KimiDeltaAttention",
    "GatedLinearCore",
    "GatedOptions",
    "GatedState",
    "HeadNorm",
    "GLA",
    "GLAOptions",
    "SimpleGLA",
    "SimpleGLAOptions",
    "Retention",
    "RetentionOptions",
    "retention_log_decay",
    "CausalLinearAttention",
    "FeatureProjection",
    "LinearAttention",
    "LinearOptions",
    "LinformerAttention",
    "LinformerMemory",
    "LinformerOptions",
    "HashRotations",
    "ReformerAttention",
    "ReformerOptions",
    "SoftmaxAttention",
    "SoftmaxMemory",
    "SoftmaxOptions",
]
