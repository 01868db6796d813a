"""The options object an attention core is built with, from the hyperparameters a layer or a
stack is given: `core_options`.

`MultiHeadAttention` takes a kind's options and, beside them, `attention_dropout` and
`softmax_temp` (as the authors' layers do); `TransformerConfig` holds the same three for a
whole stack. Both build the core's options by this one rule, so a layer and a config accept and
refuse the same things with the same messages.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from linear_transformers.attention.base import check_attention_options


def core_options(
    kind: str,
    attention_options: Mapping[str, Any] | Any | None = None,
    *,
    attention_dropout: float = 0.0,
    softmax_temp: float | None = None,
):
    """The options object of the core of `kind` that `MultiHeadAttention` builds from the same
    arguments: `attention_options` (a mapping, or an instance of the kind's options class) with
    `attention_dropout` and `softmax_temp` added where set (non-zero, not None), built into the
    kind's options class (`attention.check_attention_options`), so validated once.

    An instance without additions is returned as it is; a configuration that builds many layers
    (`TransformerConfig`) calls this once and hands each layer the instance.
    """
    extra = {"attention_dropout": attention_dropout} if attention_dropout else {}
    if softmax_temp is not None:
        extra["softmax_temp"] = softmax_temp
    options = {} if attention_options is None else attention_options
    if extra:
        if not isinstance(options, Mapping):  # An options instance (else the error): its values.
            options = check_attention_options(kind, options)
            options = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.init}
        options = {**options, **extra}
    return check_attention_options(kind, options)
