"""`"linformer"` attention: keys and values projected along time to J rows (`ops.linformer`).

Legend: B batch, T query time, S key time, H heads, D key/query features per head, M value
features per head, L the most keys the layer accepts, J projected rows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers import ops
from linear_transformers.attention.base import AttentionCore, integer_option, register_attention
from linear_transformers.attention.softmax import softmax_over_memory


class LinformerMemory(NamedTuple):
    k_BJHD: jax.Array
    v_BJHM: jax.Array


_MAX_LENGTH_NOTE = " (it is required: the most keys the layer accepts)"


def _linformer_size_error(name: str, value) -> ValueError:
    return ValueError(
        f"linformer attention: {name} must be an integer >= 1, got {value!r}"
        + (_MAX_LENGTH_NOTE if name == "max_length" else "")
        + "."
    )


@dataclasses.dataclass(frozen=True)
class LinformerOptions:
    """Options of `"linformer"` attention.

    Attributes:
      max_length: L, the most keys the layer accepts; shorter inputs are padded. Required to
        build the layer; None here means not given yet (a trainer may fill it in from its
        data), so a config without it is valid until a layer is built from it.
      projected_length: J, the rows keys and values are projected to (default 64).
      share_kv: one projection for keys and values (the paper's "shared" variant).
      softmax_temp: logit scale, default 1/sqrt(head_dim).
    """

    max_length: int | None = None
    projected_length: int = 64
    share_kv: bool = False
    softmax_temp: float | None = None

    def __post_init__(self):
        if self.max_length is not None:
            integer_option(self, "max_length", where="linformer attention", note=_MAX_LENGTH_NOTE)
        integer_option(self, "projected_length", where="linformer attention")


@register_attention("linformer")
class LinformerAttention(AttentionCore):
    """Linformer: keys and values projected along time to `projected_length` rows (see
    `ops.linformer`). Non-causal only (an encoder, or cross-attention).

    Options: `LinformerOptions` (`max_length` required).

    As cross-attention it has a memory form: the memory is reduced once to its J projected
    keys and values (`init_memory`), queried per decoding step (`attend_memory`).
    """

    options_class = LinformerOptions
    no_recurrent_form_reason = "it is non-causal: every projected row mixes every position"

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        # No sequence-parallel form (not implemented): the base class rejects a sequence_axis.
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        options = self.options
        if self.causal:
            raise ValueError(
                "attention kind 'linformer' has no causal form (each projected row "
                "mixes every position, future ones included); use it in an encoder "
                "or for cross-attention, and 'linear' or 'softmax' for causal "
                "self-attention."
            )
        if options.max_length is None:
            raise _linformer_size_error("max_length", None)
        # fan-in L: a projected row keeps the scale of one key.
        init = nnx.initializers.lecun_normal()
        shape = (options.max_length, options.projected_length)
        self.key_projection = nnx.Param(init(rngs.params(), shape, param_dtype))
        self.value_projection = (
            None if options.share_kv else nnx.Param(init(rngs.params(), shape, param_dtype))
        )
        self.softmax_temp = options.softmax_temp

    def _projections(self):
        # The ops cast them to the keys' dtype and accumulate in float32.
        e_LJ = self.key_projection[...]
        return e_LJ, (e_LJ if self.value_projection is None else self.value_projection[...])

    def __call__(self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None):
        if mask is not None:
            raise ValueError(
                f"{self.kind!r} attention cannot honour an arbitrary [T, S] mask (its "
                "keys are mixtures of positions); use key_lengths for padding."
            )
        return ops.linformer_attention(
            q_BTHD, k_BSHD, v_BSHM, *self._projections(), key_lengths=key_lengths, scale=self.softmax_temp
        )

    def init_memory(self, k_BSHD, v_BSHM, key_lengths=None):
        """The memory's J projected keys and values, computed once."""
        return LinformerMemory(
            *ops.linformer_project(k_BSHD, v_BSHM, *self._projections(), key_lengths=key_lengths)
        )

    def attend_memory(self, memory, q):
        """Softmax of one query step q [B, H, D], or a block q [B, T, H, D], over the J
        projected rows."""
        out = softmax_over_memory(
            q.astype(memory.k_BJHD.dtype),
            memory.k_BJHD,
            memory.v_BJHM,
            scale=self.softmax_temp,
            name="linformer attend_memory",
        )
        return out.astype(q.dtype)
