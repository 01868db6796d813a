"""`"linear"` and `"causal-linear"` attention: the paper's linear attention, with its RNN form.

Legend: B batch, T query time, S key time, H heads, D key/query features per head, M value
features per head.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from linear_transformers import ops
from linear_transformers.attention.base import (
    AttentionCore,
    CausalFormOptions,
    integer_option,
    memory_queries,
    prefill_axis,
    register_attention,
)


class FeatureProjection(nnx.Variable):
    """A fixed random matrix of a feature map (FAVOR+): state, not a trained parameter."""


@dataclasses.dataclass(frozen=True)
class LinearOptions(CausalFormOptions):
    """Options of `"linear"` and `"causal-linear"` attention: `CausalFormOptions` (the causal
    form: implementation, chunk_size) and

    Attributes:
      feature_map: "elu" (default), "relu", "favor" (FAVOR+, a random matrix drawn from the
        layer's `params` RNG stream and kept fixed until `redraw_features`), another name from
        `ops.registered_feature_maps()`, or a callable.
      num_features: F for "favor" (default head_dim); other feature maps do not take it.
      eps: added to the normaliser (>= 0).
    """

    feature_map: str | Callable = "elu"
    num_features: int | None = None
    eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        ops.input_checks.check_eps(self.eps, name="linear attention")
        if self.feature_map == "favor":
            integer_option(self, "num_features", where="linear attention", allow_none=True)
        else:
            if self.num_features is not None:
                raise ValueError(
                    f"num_features is the size of FAVOR+ random features; feature "
                    f"map {self.feature_map!r} does not take it."
                )
            ops.make_feature_map(self.feature_map)  # An unknown name fails here, where it is given.

    def op_kwargs(self, feature_map, *, causal_form: bool = True) -> dict:
        """`CausalFormOptions.op_kwargs` and the normaliser's eps."""
        return {**super().op_kwargs(feature_map, causal_form=causal_form), "eps": self.eps}


@register_attention("linear")
class LinearAttention(AttentionCore):
    """Linear attention phi(q) (sum phi(k) v^T) / (phi(q) . sum phi(k) + eps).

    Non-causal, or causal when the layer is causal (a decoder's self-attention); its recurrent
    state is `ops.LinearState` (s, z), constant in size whatever the length.

    Options: `LinearOptions`.

    Arbitrary [T, S] masks cannot be honoured without the T x S matrix; key_lengths is the
    supported padding mask. In causal form right-padded keys never reach a valid position; they
    are dropped anyway, so padded positions attend to the valid keys only, as in the authors'
    layer.

    With `sequence_axis` each device reduces its block to an (s, z) state: the causal form
    combines them by an exclusive prefix over devices (LASP-2), the non-causal one by a sum.
    """

    options_class = LinearOptions
    has_recurrent_form = True
    has_sequence_parallel_form = True
    supports_segments = True

    def __init__(self, *, rngs: nnx.Rngs, **kwargs):
        super().__init__(rngs=rngs, **kwargs)
        options = self.options
        if options.feature_map == "favor":
            self.feature_projection = FeatureProjection(
                ops.favor_projection(rngs.params(), options.num_features or self.head_dim, self.head_dim)
            )

    def redraw_features(self, key):
        """Draw a new FAVOR+ random matrix (no-op error for deterministic feature maps)."""
        if self.options.feature_map != "favor":
            raise ValueError(f"feature map {self.options.feature_map!r} has no random features.")
        f, d = self.feature_projection[...].shape
        self.feature_projection.set_value(ops.favor_projection(key, f, d))

    @property
    def feature_map(self) -> ops.FeatureMap:
        if self.options.feature_map == "favor":
            return ops.FavorFeatureMap(self.feature_projection[...])
        return ops.make_feature_map(self.options.feature_map)

    def __call__(
        self, q_BTHD, k_BSHD, v_BSHM, *, key_lengths=None, mask=None, segment_ids=None, key_segment_ids=None
    ):
        if mask is not None:
            raise ValueError(
                f"{self.kind!r} attention cannot honour an arbitrary [T, S] mask (that needs the "
                "T x S matrix linear attention avoids); use key_lengths for padding, segment_ids "
                "for packed sequences and causal=True for causality, or kind='softmax'."
            )
        if key_segment_ids is not None:
            raise ValueError(
                f"{self.kind!r} attention cannot cross-attend over a packed memory "
                "(key_segment_ids): its one (s, z) summary of the memory would mix the segments; "
                "use 'softmax' cross-attention for packed encoder-decoder batches."
            )
        if self.causal:
            return ops.causal_linear_attention(
                q_BTHD,
                k_BSHD,
                v_BSHM,
                key_lengths=key_lengths,
                segment_ids=segment_ids,
                sequence_axis=self.sequence_axis,
                **self.options.op_kwargs(self.feature_map),
            )
        return ops.linear_attention(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            key_lengths=key_lengths,
            segment_ids=segment_ids,
            sequence_axis=self.sequence_axis,
            **self.options.op_kwargs(self.feature_map, causal_form=False),
        )

    def init_state(self, batch, *, max_length=None, dtype=None):
        """(s, z) zeros, float32 at least; `max_length` is accepted for a uniform interface and
        not needed (the state does not grow)."""
        del max_length
        self._require_causal("init_state")
        f = self.feature_map.num_features(self.head_dim)
        return ops.init_linear_state(
            batch, self.num_heads, f, self.value_dim, jnp.promote_types(dtype or jnp.float32, jnp.float32)
        )

    def step(self, state, q_BHD, k_BHD, v_BHM):
        """s += phi(k_t) v_t^T, z += phi(k_t); out_t = phi(q_t)^T s / phi(q_t)^T z."""
        self._require_causal("step")
        return ops.linear_attention_step(
            state, q_BHD, k_BHD, v_BHM, **self.options.op_kwargs(self.feature_map, causal_form=False)
        )

    def prefill(self, state, q_BTHD, k_BTHD, v_BTHM, *, key_lengths=None, segment_ids=None):
        """The causal parallel form (this layer's implementation) started from the state (s, z) and
        returning the state after the block (`ops.causal_linear_attention_prefill`); with
        key_lengths, the state after each example's real tokens; with segment_ids, the state of
        the last segment.

        With `sequence_axis`, the block is split over the devices when a mesh with that axis is
        set and T divides over it; otherwise it runs on the arrays as they are (same result).
        """
        self._check_prefill(state, q_BTHD, k_BTHD, v_BTHM)
        return ops.causal_linear_attention_prefill(
            state,
            q_BTHD,
            k_BTHD,
            v_BTHM,
            key_lengths=key_lengths,
            segment_ids=segment_ids,
            sequence_axis=prefill_axis(self.sequence_axis, q_BTHD.shape[1]),
            **self.options.op_kwargs(self.feature_map),
        )

    def init_memory(self, k_BSHD, v_BSHM, key_lengths=None):
        """Reduce the memory to one (s, z) summary: O(D*M) per head whatever its length.

        With `sequence_axis`, summed over the devices when a mesh with that axis is set and S
        divides over it (as the parallel form); otherwise on the arrays as they are.
        """
        return ops.linear_state_from_keys(
            k_BSHD,
            v_BSHM,
            feature_map=self.feature_map,
            key_lengths=key_lengths,
            sequence_axis=prefill_axis(self.sequence_axis, k_BSHD.shape[1]),
        )

    def attend_memory(self, memory, q):
        """Read one query step q [B, H, D], or a block q [B, T, H, D], out of the (s, z)
        summary."""
        memory_queries(q, "linear attend_memory")
        return ops.linear_attention_from_state(
            memory, q, **self.options.op_kwargs(self.feature_map, causal_form=False)
        )


@register_attention("causal-linear")
class CausalLinearAttention(LinearAttention):
    """`"linear"` that insists on the causal form (the authors' name for it); the same options,
    `LinearOptions`."""

    def __init__(self, *, causal: bool, rngs: nnx.Rngs, **kwargs):
        if not causal:
            raise ValueError(
                "attention kind 'causal-linear' is causal by definition but was "
                "built for non-causal attention (an encoder or cross-attention); "
                "use kind='linear' there."
            )
        super().__init__(causal=causal, rngs=rngs, **kwargs)
