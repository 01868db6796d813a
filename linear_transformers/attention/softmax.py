"""`"softmax"` attention: softmax(q k^T * softmax_temp) v, recurrent with a KV cache.

Legend: B batch, T query time, S key time, H heads, D key/query features per head, M value
features per head.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers import ops
from linear_transformers.attention.base import AttentionCore, memory_queries, register_attention


def softmax_over_memory(q, k_BSHD, v_BSHM, *, key_lengths=None, scale=None, name):
    """Queries [B, H, D] or [B, T, H, D] over fixed keys/values (cross-attention memories)."""
    q_BTHD, one_step = memory_queries(q, name)
    out_BTHM = ops.softmax_attention_reference(q_BTHD, k_BSHD, v_BSHM, key_lengths=key_lengths, scale=scale)
    return out_BTHM[:, 0] if one_step else out_BTHM


class SoftmaxMemory(NamedTuple):
    k_BSHD: jax.Array
    v_BSHM: jax.Array
    key_lengths: jax.Array | None


@dataclasses.dataclass(frozen=True)
class SoftmaxOptions:
    """Options of `"softmax"` attention.

    Attributes:
      softmax_temp: logit scale, default 1/sqrt(head_dim).
      attention_dropout: dropout on the attention probabilities while training, in [0, 1).
      implementation: passed to `ops.softmax_attention` (None, "xla", "cudnn", "blocked", "reference").
      sow_weights: record the probabilities [B, H, T, S] as `nnx.Intermediate`
        "attention_weights" (read them with `nnx.capture`); uses the explicit-weights path.
    """

    softmax_temp: float | None = None
    attention_dropout: float = 0.0
    implementation: str | None = None
    sow_weights: bool = False

    def __post_init__(self):
        if self.implementation not in ops.softmax.IMPLEMENTATIONS:
            raise ValueError(
                f"softmax attention: unknown implementation {self.implementation!r}; "
                f"expected one of {ops.softmax.IMPLEMENTATIONS}."
            )
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {self.attention_dropout}.")


@register_attention("softmax")
class SoftmaxAttention(AttentionCore):
    """softmax(q k^T * softmax_temp) v; recurrent form with a preallocated KV cache.

    Options: `SoftmaxOptions`.

    With `sequence_axis` each device keeps its queries and all-gathers the keys and values
    (`ops.softmax_attention`); the explicit-weights path (sow_weights, attention dropout while
    training) has no sequence-parallel form and is refused.
    """

    options_class = SoftmaxOptions
    has_recurrent_form = True
    has_sequence_parallel_form = True
    supports_segments = True

    def __init__(self, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(rngs=rngs, **kwargs)
        options = self.options
        if options.sow_weights and self.sequence_axis is not None:
            raise ValueError(
                f"softmax attention: sow_weights records the whole [B, H, T, S] "
                f"matrix, which sequence_axis={self.sequence_axis!r} never forms; use "
                f"one or the other."
            )
        self.softmax_temp = options.softmax_temp
        self.implementation = options.implementation
        self.sow_weights = options.sow_weights
        self.attention_dropout = nnx.Dropout(options.attention_dropout, rngs=rngs)

    def __call__(
        self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None, segment_ids=None, key_segment_ids=None
    ):
        dropout_active = self.attention_dropout.rate > 0 and not self.attention_dropout.deterministic
        if not (self.sow_weights or dropout_active):
            return ops.softmax_attention(
                q_BTHD,
                k_BSHD,
                v_BSHM,
                causal=self.causal,
                key_lengths=key_lengths,
                mask=mask,
                scale=self.softmax_temp,
                implementation=self.implementation,
                segment_ids=segment_ids,
                key_segment_ids=key_segment_ids,
                sequence_axis=self.sequence_axis,
            )
        if self.sequence_axis is not None:
            raise ValueError(
                f"softmax attention: attention dropout drops entries of the whole "
                f"[B, H, T, S] matrix, which sequence_axis={self.sequence_axis!r} "
                f"never forms; train with attention_dropout=0 or without a "
                f"sequence axis."
            )
        key_lengths = ops.softmax.validate_softmax_inputs(
            q_BTHD, k_BSHD, v_BSHM, causal=self.causal, key_lengths=key_lengths
        )
        B, T, H, _ = q_BTHD.shape
        shape_BTS = (B, T, k_BSHD.shape[1])
        segment_ids, key_segment_ids = ops.softmax.check_segments(
            segment_ids, key_segment_ids, shape_BTS, name="softmax attention"
        )
        mask = ops.softmax.with_segments(mask, segment_ids, key_segment_ids, (B, H, T, k_BSHD.shape[1]))
        w_BHTS = ops.softmax_attention_weights(
            q_BTHD, k_BSHD, causal=self.causal, key_lengths=key_lengths, mask=mask, scale=self.softmax_temp
        )
        if self.sow_weights:
            self.sow(nnx.Intermediate, "attention_weights", w_BHTS)
        w_BHTS = self.attention_dropout(w_BHTS)
        out_BTHM = jnp.einsum("bhts,bshm->bthm", w_BHTS, v_BSHM.astype(w_BHTS.dtype))
        return out_BTHM.astype(v_BSHM.dtype)

    def init_state(self, batch, *, max_length=None, dtype=None):
        """A preallocated KV cache of `max_length` slots, in `dtype` (None: float32)."""
        self._require_causal("init_state")
        if max_length is None:
            raise ValueError(
                "softmax attention keeps a KV cache and needs max_length, the number of steps to allocate."
            )
        dtype = jnp.float32 if dtype is None else dtype
        return ops.init_kv_cache(batch, max_length, self.num_heads, self.head_dim, self.value_dim, dtype)

    def step(self, state, q_BHD, k_BHD, v_BHM):
        """Append k_t, v_t to the cache and attend over the filled slots."""
        self._require_causal("step")
        return ops.softmax_attention_step(state, q_BHD, k_BHD, v_BHM, scale=self.softmax_temp)

    def prefill(self, state, q_BTHD, k_BTHD, v_BTHM, *, key_lengths=None, segment_ids=None):
        """Write the block into cache slots [length, length + T) and attend causally over the
        filled slots of each query's segment (`ops.softmax_attention_prefill`).

        The cache keeps one length for the whole batch, so per-example `key_lengths` cannot be
        honoured: prefill the common prefix and `step` the rest, or use a linear kind. The block
        runs in the global view whatever `sequence_axis` is.
        """
        self._check_prefill(state, q_BTHD, k_BTHD, v_BTHM)
        if key_lengths is not None:
            raise ValueError(
                "softmax prefill: the KV cache keeps one length for the whole batch, "
                "so per-example key_lengths cannot be honoured; prefill the prefix "
                "every example shares and step the rest, or use a linear kind."
            )
        return ops.softmax_attention_prefill(
            state, q_BTHD, k_BTHD, v_BTHM, scale=self.softmax_temp, segment_ids=segment_ids
        )

    def init_memory(self, k_BSHD, v_BSHM, key_lengths=None):
        """The memory's projected keys and values, kept whole."""
        return SoftmaxMemory(k_BSHD, v_BSHM, key_lengths)

    def attend_memory(self, memory, q):
        """Softmax over all valid memory keys for one query step q [B, H, D] or a block
        q [B, T, H, D]."""
        return softmax_over_memory(
            q,
            memory.k_BSHD,
            memory.v_BSHM,
            key_lengths=memory.key_lengths,
            scale=self.softmax_temp,
            name="softmax attend_memory",
        )
