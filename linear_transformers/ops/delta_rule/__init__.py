"""The delta rule (DeltaNet, Gated DeltaNet, KDA): `op.py` the public op; `reference.py` the
recurrence step by step, `scan.py` the same in one `lax.scan`, `chunked.py` the WY form per chunk
(its triangular inverse in `triangular.py`); `nonfinite.py` the guard every form carries."""

from linear_transformers.ops.delta_rule.op import (
    delta_rule_attention,
    delta_rule_attention_prefill,
    delta_rule_attention_step,
    l2_normalize,
)

__all__ = [
    "delta_rule_attention",
    "delta_rule_attention_prefill",
    "delta_rule_attention_step",
    "l2_normalize",
]
