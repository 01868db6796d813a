"""What the gated kinds ("retention", "simple-gla", "gla") share: the decayed linear attention
of `ops.gated_linear_attention`, a norm per head, and a swish output gate from the layer input.

Legend: B batch, T time, E layer input width, H heads, D key/query features per head, F
feature-map features, M value features per head, X decay features (1 or F).

  out_BTHM = gated_linear_attention(q, k, v, log_decay=self.log_decay(x))   (decays: the kind's)
  out_BTHM = norm(out_BTHM) * swish(x W_gate)                                 (per head)

The kinds differ only in `log_decay(x)`: a constant per head (retention), a scalar per head and
step from the input (simple-gla), one per key feature and step from a low-rank projection of
the input (gla). They are causal self-attention with a recurrent form (`init_state`, `step`,
`prefill`), a sequence-parallel form, and packed segments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers import ops
from linear_transformers.attention.base import AttentionCore, CausalFormOptions, prefill_axis
from linear_transformers.packing import continue_positions, next_positions, segment_positions

NORMS = ("rms", "group", None)


@dataclasses.dataclass(frozen=True)
class GatedOptions(CausalFormOptions):
    """Options every gated kind takes: `CausalFormOptions` (the causal form: implementation,
    chunk_size) and

    Attributes:
      feature_map: phi of queries and keys: "identity" (default, as RetNet and GLA), or another
        name from `ops.registered_feature_maps()`, or a callable.
      output_gate: multiply the output by swish(x W_gate), a projection of the layer input.
      norm: the norm of each head's output before the gate: "rms" (FLA's, a weight of M shared
        by the heads), "group" (RetNet's GroupNorm over the heads: a LayerNorm per head with a
        weight and bias per channel) or None.
      norm_eps: added to the variance in the norm.
    """

    feature_map: str | Callable = "identity"
    output_gate: bool = True
    norm: str | None = "rms"
    norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        kind = type(self).__name__
        if self.norm not in NORMS:
            raise ValueError(f"{kind}: norm must be one of {NORMS}, got {self.norm!r}.")
        if not self.norm_eps > 0:
            raise ValueError(f"{kind}: norm_eps must be > 0, got {self.norm_eps!r}.")
        if self.feature_map == "favor":
            raise ValueError(
                f"{kind}: feature_map 'favor' draws random features, which only the 'linear' kind "
                f"draws and stores (its options num_features, and redraw_features); the gated kinds "
                f"take a deterministic feature map: 'identity' (their default), 'elu', 'relu', ... "
                f"(ops.registered_feature_maps() but 'favor'), or a callable."
            )
        ops.make_feature_map(self.feature_map)  # An unknown name fails here, where it is given.


class GatedState(NamedTuple):
    """The recurrent state of a gated kind: the decayed linear state (s; no normaliser) and the
    position of each row's next token (for rotary positions)."""

    linear: ops.LinearState
    position: jax.Array  # int32 [B]


class HeadNorm(nnx.Module):
    """A norm of each head's M outputs, statistics in float32: "rms" (a weight [M] shared by the
    heads) or "group" (mean and variance per head, a weight and bias per channel [H, M])."""

    def __init__(self, kind: str, num_heads: int, features: int, *, eps: float, dtype, param_dtype):
        self.kind, self.eps, self.dtype = kind, eps, dtype
        shape = (features,) if kind == "rms" else (num_heads, features)
        self.scale = nnx.Param(jnp.ones(shape, param_dtype))
        self.bias = nnx.Param(jnp.zeros(shape, param_dtype)) if kind == "group" else None

    def __call__(self, y_xHM):
        y = y_xHM.astype(jnp.promote_types(y_xHM.dtype, jnp.float32))
        if self.kind == "group":
            y = y - jnp.mean(y, axis=-1, keepdims=True)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        y = y * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(self.dtype or y_xHM.dtype)


class GatedLinearCore(AttentionCore):
    """Base of the gated kinds: subclasses set `options_class` (a `GatedOptions` subclass) and
    define `log_decay(x)`; `rotary` (a class attribute or an option) rotates q and k by their
    positions first (retention)."""

    options_class = GatedOptions
    has_recurrent_form = True
    has_sequence_parallel_form = True
    supports_segments = True
    takes_inputs = True

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        self._check_causal_with_inputs(along_time="its decay", from_input="gates")
        options = self.options
        H, M = self.num_heads, self.value_dim
        self.feature_map = ops.make_feature_map(options.feature_map)
        self.gate = (
            nnx.Linear(
                self.in_features, H * M, use_bias=False, dtype=self.dtype, param_dtype=param_dtype, rngs=rngs
            )
            if options.output_gate
            else None
        )
        self.norm = (
            None
            if options.norm is None
            else HeadNorm(options.norm, H, M, eps=options.norm_eps, dtype=self.dtype, param_dtype=param_dtype)
        )

    @property
    def rotary(self) -> bool:
        return getattr(self.options, "rotary", False)

    def log_decay(self, x_BTE) -> Any:
        """The log decays for inputs x [B, T, E]: [H], [B, T, H] or [B, T, H, F], all <= 0."""
        raise NotImplementedError

    def _finish(self, out_xHM, x_xE):
        """norm per head, then the swish output gate."""
        if self.norm is not None:
            out_xHM = self.norm(out_xHM)
        if self.gate is None:
            return out_xHM
        gate_xHM = self.gate(x_xE).reshape(x_xE.shape[:-1] + (self.num_heads, self.value_dim))
        return (out_xHM * jax.nn.silu(gate_xHM)).astype(out_xHM.dtype)

    def _rotate(self, q, k, positions):
        if not self.rotary:
            return q, k
        return ops.rotary_embedding(q, positions), ops.rotary_embedding(k, positions)

    def __call__(
        self,
        q_BTHD,
        k_BSHD,
        v_BSHM,
        *,
        key_lengths=None,
        mask=None,
        segment_ids=None,
        key_segment_ids=None,
        x=None,
        positions=None,
    ):
        self._refuse_pair_masks(mask, key_segment_ids)
        x = self._require_inputs(x, "the parallel form")
        if positions is None and self.rotary:
            T = q_BTHD.shape[1]
            positions = jnp.arange(T)[None] if segment_ids is None else segment_positions(segment_ids)
        q_BTHD, k_BSHD = self._rotate(q_BTHD, k_BSHD, positions)
        out_BTHM = ops.gated_linear_attention(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            log_decay=self.log_decay(x),
            key_lengths=key_lengths,
            segment_ids=segment_ids,
            sequence_axis=self.sequence_axis,
            **self.options.op_kwargs(self.feature_map),
        )
        return self._finish(out_BTHM, x)

    def init_state(self, batch, *, max_length=None, dtype=None):
        """A zero decayed state s [B, H, F, M] (float32 at least, no normaliser; `max_length` is
        not needed: the state does not grow) at position 0."""
        del max_length
        self._require_causal("init_state")
        F = self.feature_map.num_features(self.head_dim)
        acc = jnp.promote_types(dtype or jnp.float32, jnp.float32)
        return GatedState(
            ops.init_linear_state(batch, self.num_heads, F, self.value_dim, acc, normalizer=False),
            jnp.zeros((batch,), jnp.int32),
        )

    def step(self, state: GatedState, q_BHD, k_BHD, v_BHM, *, x=None):
        """s = exp(g_t) * s + phi(k_t) v_t^T; out_t = norm(scale * phi(q_t)^T s) * gate."""
        x_BE = self._require_inputs(x, "step")
        q_BHD, k_BHD = self._rotate(q_BHD, k_BHD, state.position)
        log_decay = self.log_decay(x_BE[:, None])
        log_decay = log_decay if jnp.ndim(log_decay) == 1 else log_decay[:, 0]
        linear, out_BHM = ops.gated_linear_attention_step(
            state.linear,
            q_BHD,
            k_BHD,
            v_BHM,
            log_decay=log_decay,
            **self.options.op_kwargs(self.feature_map, causal_form=False),
        )
        return GatedState(linear, state.position + 1), self._finish(out_BHM, x_BE)

    def prefill(
        self,
        state: GatedState,
        q_BTHD,
        k_BTHD,
        v_BTHM,
        *,
        key_lengths=None,
        segment_ids=None,
        x=None,
        positions=None,
    ):
        """A block of T tokens from `state` in parallel form (`ops.gated_linear_attention_prefill`):
        equal to T steps; with segment_ids, the first segment continues the state and decoding
        continues the last one."""
        self._check_prefill(state, q_BTHD, k_BTHD, v_BTHM)
        x = self._require_inputs(x, "prefill")
        T = q_BTHD.shape[1]
        ids = segment_ids
        if key_lengths is not None:  # Padding as segment 0 for the positions that follow.
            valid_BT = jnp.arange(T)[None] < key_lengths[:, None]
            ids = jnp.where(valid_BT, 1 if segment_ids is None else segment_ids, 0)
        if positions is None:
            positions = continue_positions(state.position, ids, T)
        q_BTHD, k_BTHD = self._rotate(q_BTHD, k_BTHD, positions)
        linear, out_BTHM = ops.gated_linear_attention_prefill(
            state.linear,
            q_BTHD,
            k_BTHD,
            v_BTHM,
            log_decay=self.log_decay(x),
            key_lengths=key_lengths,
            segment_ids=segment_ids,
            sequence_axis=prefill_axis(self.sequence_axis, T),
            **self.options.op_kwargs(self.feature_map),
        )
        return GatedState(linear, next_positions(positions, ids, state.position)), self._finish(out_BTHM, x)
