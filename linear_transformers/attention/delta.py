"""`"deltanet"`, `"gated-deltanet"` and `"kda"`: the delta rule (`ops.delta_rule_attention`) as
FLA's layers wrap it: a short causal convolution on q, k and v, the writing strength beta from
the layer input, q and k L2-normalised, a norm per head and an output gate.

Legend: B batch, T time, E layer input width, H heads, D key/query features per head, M value
features per head, W the convolution's window.

  q, k, v = silu(short_convolution(q)), ... (each over its H * D or H * M features)
  beta_t = sigmoid(x_t W_beta)                                       [B, T, H] (x2 with
                                                                     allow_neg_eigval)
  deltanet:        no decay
  gated-deltanet:  g_t = -exp(A_log) * softplus(x_t W_a + dt_bias)     [B, T, H]   (Mamba-2's)
  kda:             g_t = -exp(A_log) * softplus((x_t W_1) W_2 + dt_bias) [B, T, H, D]
  out = rms_norm(delta_rule(q, k, v, beta, g)) * gate(x)               per head

The gate is swish(x W_gate) for deltanet (off by default, as FLA's `DeltaNet`) and
gated-deltanet, sigmoid((x W_1) W_2 + b) for kda (Kimi Linear's). A_log starts at log U(1, 16)
per head and dt_bias at softplus^-1 of dt ~ logU(0.001, 0.1), as FLA initialises them.

They are causal self-attention with a recurrent form (`init_state`, `step`, `prefill`; the
state holds the delta rule's [D, M] matrix and the convolution's last W - 1 inputs) and packed
segments (the convolution's window stops at a segment's start). Built with `sequence_axis`, the
parallel form splits time over that mesh axis: the convolution reads the previous device's last
inputs, the delta rule composes the devices' affine maps of the state (`ops.delta_rule_attention`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_transformers import ops
from linear_transformers.attention.base import AttentionCore, integer_option, prefill_axis, register_attention
from linear_transformers.attention.gated import HeadNorm
from linear_transformers.ops.delta_rule.op import FORMS

# Parameters weight decay leaves alone: the decays' rates, as FLA's layers mark them
# (`_no_weight_decay`). Pulled toward 0 they move the gates' time constants rather than shrink a
# weight: dt_bias starts near log(0.001..0.1), and at 0 softplus gives 0.69, a far stronger decay.
NO_WEIGHT_DECAY = frozenset({"A_log", "dt_bias"})


@dataclasses.dataclass(frozen=True)
class DeltaNetOptions:
    """Options of the delta-rule kinds.

    Attributes:
      implementation: one of the delta rule's forms, "chunked" (default), "scan", "reference".
      chunk_size: chunk length of "chunked" (None: the op's default, 32 on CPU, 64 elsewhere).
      conv_size: the short convolution's window W (default 4, FLA's), None for none.
      output_gate: multiply the normalised output by the gate of the module docstring.
      allow_neg_eigval: beta in [0, 2] (2 sigmoid) instead of [0, 1]: the state's transition
        I - beta k k^T may reflect (Grazzi et al. 2025).
      norm_eps: added to the variance in each head's RMS norm.
    """

    implementation: str = "chunked"
    chunk_size: int | None = None
    conv_size: int | None = 4
    output_gate: bool = False
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self):
        where = type(self).__name__
        if self.implementation not in FORMS:
            raise ValueError(
                f"{where}: unknown implementation {self.implementation!r}; expected one of {tuple(FORMS)}."
            )
        integer_option(self, "chunk_size", where=where, allow_none=True)
        integer_option(self, "conv_size", where=where, allow_none=True)
        for flag in ("output_gate", "allow_neg_eigval"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{where}: {flag} must be True or False, got {getattr(self, flag)!r}.")
        if not self.norm_eps > 0:
            raise ValueError(f"{where}: norm_eps must be > 0, got {self.norm_eps!r}.")


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetOptions(DeltaNetOptions):
    """Options of `"gated-deltanet"` and `"kda"`: `DeltaNetOptions` with the output gate on."""

    output_gate: bool = True


class DeltaState(NamedTuple):
    """The recurrent state of a delta-rule kind: the [D, M] matrix per head (no normaliser) and
    the convolutions' last W - 1 inputs, [B, W - 1, H * D] for q and k, [B, W - 1, H * M] for v
    (an empty tuple without convolutions)."""

    linear: ops.LinearState
    conv: tuple


def _linear(rngs, param_dtype, dtype, i, o, *, use_bias):
    return nnx.Linear(i, o, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def _dt_bias(key, shape, param_dtype):
    """softplus^-1(dt) for dt log-uniform in [0.001, 0.1] (at least 1e-4), as FLA's layers."""
    dt = jnp.exp(jax.random.uniform(key, shape) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    dt = jnp.maximum(dt, 1e-4)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(param_dtype)


class DeltaRuleCore(AttentionCore):
    """Base of the delta-rule kinds; subclasses define `log_decay(x)` (None: no decay) and may
    override `gate(x)`."""

    options_class = DeltaNetOptions
    has_recurrent_form = True
    has_sequence_parallel_form = True
    supports_segments = True
    takes_inputs = True

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        self._check_causal_with_inputs(along_time="the delta rule", from_input="beta and its gates")
        options, E, H = self.options, self.in_features, self.num_heads
        self.beta_projection = _linear(rngs, param_dtype, self.dtype, E, H, use_bias=False)
        conv = None
        if options.conv_size is not None:
            W, widths = options.conv_size, (H * self.head_dim, H * self.head_dim, H * self.value_dim)
            # PyTorch's Conv1d initialisation: U(-1/sqrt(W), 1/sqrt(W)) for a depthwise window.
            keys = jax.random.split(rngs.params(), 3)
            conv = nnx.List(
                [
                    nnx.Param(jax.random.uniform(key, (W, n), param_dtype, -(W**-0.5), W**-0.5))
                    for key, n in zip(keys, widths)
                ]
            )
        self.conv = conv  # The windows [W, H * D] of q and k, [W, H * M] of v; None: no convolution.
        self.norm = HeadNorm(
            "rms", H, self.value_dim, eps=options.norm_eps, dtype=self.dtype, param_dtype=param_dtype
        )
        self.gate_projection = (
            _linear(rngs, param_dtype, self.dtype, E, H * self.value_dim, use_bias=False)
            if options.output_gate
            else None
        )

    def log_decay(self, x_BTE):
        """The log decays for inputs x [B, T, E]: None, [B, T, H] or [B, T, H, D], all <= 0."""
        del x_BTE
        return None

    def gate(self, x_xE):
        """The output gate [..., H * M]: swish(x W_gate)."""
        return jax.nn.silu(self.gate_projection(x_xE))

    def beta(self, x_xE):
        """sigmoid(x W_beta) [..., H] in float32 (times 2 with allow_neg_eigval)."""
        beta = jax.nn.sigmoid(self.beta_projection(x_xE).astype(jnp.float32))
        return 2 * beta if self.options.allow_neg_eigval else beta

    def _finish(self, out_xHM, x_xE):
        out_xHM = self.norm(out_xHM)
        if self.gate_projection is None:
            return out_xHM
        gate_xHM = self.gate(x_xE).reshape(x_xE.shape[:-1] + (self.num_heads, self.value_dim))
        return (out_xHM * gate_xHM).astype(out_xHM.dtype)

    def _op_kwargs(self, *, causal_form: bool = True):
        if not causal_form:
            return {}
        return dict(implementation=self.options.implementation, chunk_size=self.options.chunk_size)

    def _convolve(self, qkv, states, *, step: bool = False, **kwargs):
        """silu(short convolution) of q, k and v over their flattened heads, a block ([B, T, H,
        *]) or one `step` ([B, H, *]): -> (q, k, v) and, with `states`, the convolutions' new
        states (`kwargs`: short_convolution's masks and sequence_axis)."""
        if self.conv is None:
            return qkv, ()
        outs, new_states = [], []
        for i, x in enumerate(qkv):
            x_flat = x.reshape(x.shape[: 1 if step else 2] + (-1,))
            weight = self.conv[i][...].astype(x.dtype)
            if step:
                state, y = ops.short_convolution_step(states[i], x_flat, weight)
            elif states is None:
                y, state = ops.short_convolution(x_flat, weight, **kwargs), None
            else:
                y, state = ops.short_convolution(
                    x_flat, weight, initial_state=states[i], return_state=True, **kwargs
                )
            new_states.append(state)
            outs.append(y.reshape(x.shape))
        return tuple(outs), () if states is None else tuple(new_states)

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
        del positions  # No rotation: the convolution gives the layer its sense of order.
        self._refuse_pair_masks(mask, key_segment_ids)
        x = self._require_inputs(x, "the parallel form")
        masks = dict(key_lengths=key_lengths, segment_ids=segment_ids, sequence_axis=self.sequence_axis)
        (q, k, v), _ = self._convolve((q_BTHD, k_BSHD, v_BSHM), None, **masks)
        out_BTHM = ops.delta_rule_attention(
            q, k, v, self.beta(x), log_decay=self.log_decay(x), **masks, **self._op_kwargs()
        )
        return self._finish(out_BTHM, x)

    def init_state(self, batch, *, max_length=None, dtype=None):
        """A zero [D, M] state per head (float32 at least) and zero convolution inputs
        (`max_length` is not needed: the state does not grow)."""
        del max_length
        self._require_causal("init_state")
        acc = jnp.promote_types(dtype or jnp.float32, jnp.float32)
        H, D, M = self.num_heads, self.head_dim, self.value_dim
        conv = ()
        if self.conv is not None:
            W = self.options.conv_size
            conv = tuple(ops.init_short_convolution_state(batch, W, n, acc) for n in (H * D, H * D, H * M))
        return DeltaState(ops.init_linear_state(batch, H, D, M, acc, normalizer=False), conv)

    def step(self, state: DeltaState, q_BHD, k_BHD, v_BHM, *, x=None):
        """One token: the convolutions' steps, then the delta rule's."""
        x_BE = self._require_inputs(x, "step")
        qkv, conv = self._convolve((q_BHD, k_BHD, v_BHM), state.conv, step=True)
        log_decay = self.log_decay(x_BE[:, None])
        linear, out_BHM = ops.delta_rule_attention_step(
            state.linear, *qkv, self.beta(x_BE), log_decay=None if log_decay is None else log_decay[:, 0]
        )
        return DeltaState(linear, conv), self._finish(out_BHM, x_BE)

    def prefill(
        self,
        state: DeltaState,
        q_BTHD,
        k_BTHD,
        v_BTHM,
        *,
        key_lengths=None,
        segment_ids=None,
        x=None,
        positions=None,
    ):
        """A block of T tokens from `state` in parallel form: equal to T steps; with
        segment_ids, the first segment continues the state and decoding continues the last."""
        del positions
        self._check_prefill(state, q_BTHD, k_BTHD, v_BTHM)
        x = self._require_inputs(x, "prefill")
        axis = prefill_axis(self.sequence_axis, q_BTHD.shape[1])
        masks = dict(key_lengths=key_lengths, segment_ids=segment_ids, sequence_axis=axis)
        states = state.conv if self.conv is not None else None
        (q, k, v), conv = self._convolve((q_BTHD, k_BTHD, v_BTHM), states, **masks)
        linear, out_BTHM = ops.delta_rule_attention_prefill(
            state.linear, q, k, v, self.beta(x), log_decay=self.log_decay(x), **masks, **self._op_kwargs()
        )
        return DeltaState(linear, tuple(s.astype(p.dtype) for s, p in zip(conv, state.conv))), self._finish(
            out_BTHM, x
        )


@register_attention("deltanet")
class DeltaNet(DeltaRuleCore):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): S_t = (I - beta_t k_t k_t^T) S_{t-1} +
    beta_t k_t v_t^T. Options: `DeltaNetOptions`."""


class _DecayedDeltaRule(DeltaRuleCore):
    """Mamba-2's decay -exp(A_log) * softplus(logits + dt_bias) from the layer input."""

    options_class = GatedDeltaNetOptions

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        H = self.num_heads
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (H,), param_dtype, 1.0, 16.0)))
        self.dt_bias = nnx.Param(_dt_bias(rngs.params(), (H * self._decay_width(),), param_dtype))

    def _decay_width(self) -> int:
        """Decays per head: 1, or D (one per key feature)."""
        return 1

    def _decay_logits(self, x_BTE):
        """[..., H * decays per head], before dt_bias."""
        raise NotImplementedError

    def log_decay(self, x_BTE):
        """-exp(A_log) * softplus(logits + dt_bias) in float32: [B, T, H] or [B, T, H, D]."""
        logits = self._decay_logits(x_BTE).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jax.nn.softplus(logits).reshape(logits.shape[:-1] + (self.num_heads, -1))
        g = g * jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]
        return g[..., 0] if self._decay_width() == 1 else g


@register_attention("gated-deltanet")
class GatedDeltaNet(_DecayedDeltaRule):
    """Gated DeltaNet (Yang et al. 2025; the linear layer of Qwen3-Next): S_t = (I - beta_t k_t
    k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T, one decay per head and step. Options:
    `GatedDeltaNetOptions`."""

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        self.decay_projection = _linear(
            rngs, param_dtype, self.dtype, self.in_features, self.num_heads, use_bias=False
        )

    def _decay_logits(self, x_BTE):
        return self.decay_projection(x_BTE)


@register_attention("kda")
class KimiDeltaAttention(_DecayedDeltaRule):
    """Kimi Delta Attention (the linear layer of Kimi Linear): one decay per key feature and
    step from a low-rank projection of the input, and a low-rank sigmoid output gate. Options:
    `GatedDeltaNetOptions`."""

    def __init__(self, *, rngs: nnx.Rngs, param_dtype=jnp.float32, **kwargs):
        super().__init__(rngs=rngs, param_dtype=param_dtype, **kwargs)
        E, H, D, M = self.in_features, self.num_heads, self.head_dim, self.value_dim
        self.decay_down = _linear(rngs, param_dtype, self.dtype, E, M, use_bias=False)
        self.decay_up = _linear(rngs, param_dtype, self.dtype, M, H * D, use_bias=False)
        if self.options.output_gate:
            self.gate_projection = _linear(rngs, param_dtype, self.dtype, E, M, use_bias=False)
            self.gate_up = _linear(rngs, param_dtype, self.dtype, M, H * M, use_bias=True)

    def _decay_width(self) -> int:
        return self.head_dim

    def _decay_logits(self, x_BTE):
        return self.decay_up(self.decay_down(x_BTE))

    def gate(self, x_xE):
        """sigmoid((x W_1) W_2 + b) [..., H * M], Kimi Linear's low-rank gate."""
        return jax.nn.sigmoid(self.gate_up(self.gate_projection(x_xE)))
