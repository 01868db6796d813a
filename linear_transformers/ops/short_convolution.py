"""`short_convolution`: the causal depthwise convolution over a few steps that DeltaNet, Gated
DeltaNet and KDA apply to q, k and v before the delta rule (FLA's `ShortConvolution`, Mamba's
`causal_conv1d`), with a state for decoding and packed sequences.

Legend: B batch, T time, E features (channels, each convolved on its own), W the window (kernel
width): a step reads itself and the W - 1 steps before it.

  y_t = act(b + sum_{i < W} w_i * x_{t - W + 1 + i})

A step's window holds only steps of its own sequence: where a segment begins (`segment_ids`)
the steps before it count as 0, and the first segment of a call continues `initial_state`, the
W - 1 inputs before step 0 (zeros by default). Steps that do not count (`key_lengths`, id 0)
output 0 and are skipped by the state, as the attention ops' states skip them.

With `sequence_axis`, inside `jax.shard_map` over it, x is one device's block of the sequence:
the first steps' windows read the previous device's last W - 1 inputs (`ppermute`; the first
device reads `initial_state`), a segment begun on an earlier device still bounds them, and the
state returned is the global one. Outside `shard_map` (a mesh set, the arrays in the global
view) the convolution is written over the global time axis and XLA moves the boundary steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import input_checks
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.gated_linear.block import flags

ACTIVATIONS = {"silu": jax.nn.silu, None: lambda y: y}


def _check(x_BTE, weight_WE, bias_E, activation, state_BWE, *, name: str, step: bool):
    """The shapes and options, named when wrong; -> W."""
    x_ndim = 2 if step else 3
    input_checks.check_floating((("x", x_BTE), ("weight", weight_WE)), name=name)
    if x_BTE.ndim != x_ndim:
        raise ValueError(f"{name}: x must be [B, {'' if step else 'T, '}E], got shape {tuple(x_BTE.shape)}.")
    E = x_BTE.shape[-1]
    if weight_WE.ndim != 2 or weight_WE.shape[1] != E or weight_WE.shape[0] < 1:
        raise ValueError(
            f"{name}: weight must be [W, E] with E={E} (x's features) and W >= 1 (the window), got "
            f"shape {tuple(weight_WE.shape)}."
        )
    if bias_E is not None and tuple(bias_E.shape) != (E,):
        raise ValueError(f"{name}: bias must be [E]=[{E}] or None, got shape {tuple(bias_E.shape)}.")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{name}: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}.")
    W = weight_WE.shape[0]
    want = (x_BTE.shape[0], W - 1, E)
    if state_BWE is not None and tuple(state_BWE.shape) != want:
        raise ValueError(
            f"{name}: the state must be [B, W - 1, E]={list(want)} (the inputs before the first "
            f"step; init_short_convolution_state), got shape {tuple(state_BWE.shape)}."
        )
    return W


def init_short_convolution_state(batch: int, window: int, features: int, dtype=jnp.float32):
    """Zeros [B, W - 1, E]: no inputs before the first step."""
    return jnp.zeros((batch, window - 1, features), dtype)


def short_convolution(
    x_BTE,
    weight_WE,
    bias_E=None,
    *,
    activation: str | None = "silu",
    initial_state=None,
    return_state: bool = False,
    key_lengths=None,
    segment_ids=None,
    sequence_axis: str | None = None,
):
    """The causal convolution of the module docstring over x [B, T, E], weight [W, E].

    Args:
      bias_E: [E] or None.
      activation: "silu" (default, as FLA's layers) or None.
      initial_state: [B, W - 1, E], the inputs before step 0 (default zeros).
      return_state: also return the state after the last step that counts.
      key_lengths: int [B]: steps past it do not count.
      segment_ids: int [B, T] of packed sequences (0 = padding).
      sequence_axis: the mesh axis time is split over (the module docstring); inside
        `jax.shard_map` each device's block must hold at least W - 1 steps.

    Returns:
      y [B, T, E] in x's dtype (summed in float32 at least), or (y, state [B, W - 1, E]).
    """
    name = "short_convolution"
    input_checks.check_bools(name=name, return_state=return_state)
    x_BTE, weight_WE = jnp.asarray(x_BTE), jnp.asarray(weight_WE)
    bias_E = None if bias_E is None else jnp.asarray(bias_E)
    W = _check(x_BTE, weight_WE, bias_E, activation, initial_state, name=name, step=False)
    B, T, E = x_BTE.shape
    key_lengths = input_checks.check_key_lengths(key_lengths, B, name=name, length=T)
    segment_ids = input_checks.check_segment_ids(segment_ids, (B, T), name=name)
    acc = input_checks.accumulation_dtype(x_BTE.dtype)
    s0_BWE = (
        jnp.zeros((B, W - 1, E), acc) if initial_state is None else jnp.asarray(initial_state).astype(acc)
    )
    axis = _manual_axis(sequence_axis, T, W, name=name)
    valid_BT, reset_BT = flags(T, key_lengths, segment_ids, axis=axis)

    # Position p of x_ext is step offset + p - (W - 1) (`t` holds global steps); the run a step
    # belongs to starts at its segment's first step, or at -(W - 1) (the initial state) when no
    # segment began before it, on this device or an earlier one.
    offset = 0 if axis is None else sp.device_offset(axis, T)
    x_acc = x_BTE.astype(acc)
    x_ext = jnp.concatenate([_inputs_before(x_acc, s0_BWE, axis), x_acc], axis=1)
    t = offset + jnp.arange(T)
    run_start_BT = jnp.broadcast_to(jnp.asarray(-(W - 1)), (B, T))
    if reset_BT is not None:
        run_start_BT = jax.lax.cummax(jnp.where(reset_BT, t[None], -(W - 1)), axis=1)
        if axis is not None:
            run_start_BT = jnp.maximum(run_start_BT, _earlier_devices_max(run_start_BT[:, -1], axis)[:, None])
    y_BTE = jnp.zeros((B, T, E), acc) if bias_E is None else jnp.broadcast_to(bias_E.astype(acc), (B, T, E))
    for i in range(W):  # `where`, not a product: a step outside the run may hold inf or NaN.
        inside_BT = t[None] - (W - 1) + i >= run_start_BT
        y_BTE = y_BTE + weight_WE[i].astype(acc) * jnp.where(inside_BT[..., None], x_ext[:, i : i + T], 0)
    y_BTE = ACTIVATIONS[activation](y_BTE)
    if valid_BT is not None:
        y_BTE = jnp.where(valid_BT[..., None], y_BTE, 0)
    y_BTE = y_BTE.astype(x_BTE.dtype)
    if not return_state:
        return y_BTE

    # The W - 1 inputs up to the last step that counts (L = -1: none, the initial state kept),
    # taken on the device that holds L (the first one for L = -1) and shared.
    if valid_BT is None:
        last_B = jnp.full((B,), T - 1) + offset
    else:
        last_B = jnp.max(jnp.where(valid_BT, t[None], -1), axis=1)
    if axis is not None:
        last_B = jnp.max(jax.lax.all_gather(last_B, axis), axis=0)
    local_B = jnp.clip(last_B - offset, 0, T - 1)
    start_B = jnp.take_along_axis(run_start_BT, local_B[:, None], axis=1)[:, 0]
    start_B = jnp.where(last_B >= 0, start_B, -(W - 1))
    p_BW = last_B[:, None] - (W - 2) + jnp.arange(W - 1)[None]
    local_BW = jnp.clip(p_BW - offset + W - 1, 0, T + W - 2)
    state_BWE = jnp.take_along_axis(x_ext, local_BW[..., None], axis=1)
    state_BWE = jnp.where((p_BW >= start_B[:, None])[..., None], state_BWE, 0)
    if axis is not None:
        holds_B = jnp.maximum(last_B, 0) // T == jax.lax.axis_index(axis)
        state_BWE = jax.lax.psum(jnp.where(holds_B[:, None, None], state_BWE, 0), axis)
    return y_BTE, state_BWE


def _manual_axis(sequence_axis, T: int, W: int, *, name: str):
    """The axis to exchange boundary steps over: `sequence_axis` inside `jax.shard_map` over it;
    None for the whole sequence, or the global view, where XLA moves them."""
    if sequence_axis is None:
        return None
    if not sp.is_manual(sequence_axis):
        sp.check_sequence_axis(sequence_axis, T, name=name)
        return None
    if T < W - 1:
        raise ValueError(
            f"{name}: each device's block of the sequence must hold at least W - 1 = {W - 1} steps "
            f"(the window reads the previous device's last W - 1), got {T} steps per device."
        )
    return sequence_axis


def _inputs_before(x_BTE, s0_BWE, axis):
    """The W - 1 inputs before this block's first step: the previous device's last ones, the
    initial state on the first device (and without an axis)."""
    W1 = s0_BWE.shape[1]
    if axis is None or W1 == 0:
        return s0_BWE
    size = sp.axis_size(axis)
    previous = jax.lax.ppermute(x_BTE[:, x_BTE.shape[1] - W1 :], axis, [(p, p + 1) for p in range(size - 1)])
    return jnp.where(jax.lax.axis_index(axis) == 0, s0_BWE, previous)


def _earlier_devices_max(x_B, axis):
    """max over the devices before this one of x [B] (int), the lowest int32 on the first."""
    x_PB = jax.lax.all_gather(x_B, axis)
    earlier_P = jnp.arange(x_PB.shape[0]) < jax.lax.axis_index(axis)
    return jnp.max(jnp.where(earlier_P[:, None], x_PB, jnp.iinfo(jnp.int32).min), axis=0)


def short_convolution_step(state_BWE, x_BE, weight_WE, bias_E=None, *, activation: str | None = "silu"):
    """One step: -> (state, y [B, E]); the state [B, W - 1, E] keeps its dtype (a valid
    `lax.scan` carry)."""
    name = "short_convolution_step"
    x_BE, weight_WE = jnp.asarray(x_BE), jnp.asarray(weight_WE)
    bias_E = None if bias_E is None else jnp.asarray(bias_E)
    _check(x_BE, weight_WE, bias_E, activation, state_BWE, name=name, step=True)
    acc = jnp.promote_types(state_BWE.dtype, jnp.float32)
    window_BWE = jnp.concatenate([state_BWE.astype(acc), x_BE.astype(acc)[:, None]], axis=1)
    y_BE = jnp.einsum("bwe,we->be", window_BWE, weight_WE.astype(acc))
    if bias_E is not None:
        y_BE = y_BE + bias_E.astype(acc)
    return window_BWE[:, 1:].astype(state_BWE.dtype), ACTIVATIONS[activation](y_BE).astype(x_BE.dtype)
