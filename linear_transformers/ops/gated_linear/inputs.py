"""The gated linear op's inputs: the checks of its decays and state, and `Preparation`, which
turns raw inputs into what the recurrence reads.

Legend: B batch, T time, H heads, D key/query features, F feature-map features (F = D but for
FAVOR+), M value features, X decay features (1 or F).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from linear_transformers.ops import _nonfinite, input_checks
from linear_transformers.ops.feature_maps import FeatureMap
from linear_transformers.ops.linear_state import LinearState


def check_log_decay(log_decay, shape_BTHF, *, name: str, step: bool = False):
    """`log_decay` as a float array of shape [B, T, H, X] (X = 1 or F), or None.

    Accepted: None, [H] (a constant per head), [B, T, H] (per head and step) and [B, T, H, F]
    (per key feature and step); with `step` (one step, T = 1) [H], [B, H] and [B, H, F]. Values
    must be <= 0, -inf included (a reset). The values are
    checked only when concrete (an eager call): under `jit` or `vmap` a positive value cannot
    raise and is read as NaN instead (`prepare_log_decay`).
    """
    if log_decay is None:
        return None
    B, T, H, F = shape_BTHF
    log_decay = jnp.asarray(log_decay)
    input_checks.check_floating((("log_decay", log_decay),), name=name)
    if step:
        shapes = {1: (H,), 2: (B, H), 3: (B, H, F)}
        allowed = f"[B, H]={[B, H]} (per head) or [B, H, F]={[B, H, F]} (per key feature"
    else:
        shapes = {1: (H,), 3: (B, T, H), 4: (B, T, H, F)}
        allowed = (
            f"[B, T, H]={[B, T, H]} (per head and step) or [B, T, H, F]={[B, T, H, F]} (per key "
            f"feature and step"
        )
    if shapes.get(log_decay.ndim) != tuple(log_decay.shape):
        raise ValueError(
            f"{name}: log_decay must be [H]={[H]} (a constant per head), {allowed}; F is the "
            f"feature map's width), got shape {tuple(log_decay.shape)}."
        )
    if step and log_decay.ndim > 1:
        log_decay = log_decay[:, None]
    if input_checks.is_concrete(log_decay) and log_decay.size:
        largest = float(np.max(np.asarray(log_decay, np.float64)))
        if largest > 0:
            raise ValueError(
                f"{name}: log_decay must be <= 0 (a decay exp(g) in (0, 1]), got a largest value of "
                f"{largest}; e.g. jax.nn.log_sigmoid of a gate logit."
            )
    if log_decay.ndim == 1:
        log_decay = jnp.broadcast_to(log_decay[:, None], (B, T, H, 1))
    elif log_decay.ndim == 3:
        log_decay = log_decay[..., None]
    return log_decay


def check_linear_state(state, expected_BHFM, *, normalize: bool, name: str) -> LinearState:
    """Raise a ValueError unless `state` is a LinearState of shapes s [B, H, F, M] and z [B, H, F]
    (z None when the op does not normalise)."""
    if not isinstance(state, LinearState):
        raise ValueError(
            f"{name}: initial_state must be an ops.LinearState (init_linear_state, "
            f"or the state a call with return_state=True returned), got "
            f"{type(state).__name__}."
        )
    expected_z = tuple(expected_BHFM[:3]) if normalize else None
    z_shape = None if state.z_BHF is None else tuple(state.z_BHF.shape)
    if tuple(state.s_BHFM.shape) != tuple(expected_BHFM) or z_shape != expected_z:
        raise ValueError(
            f"{name}: initial_state shapes s {tuple(state.s_BHFM.shape)}, z {z_shape} do not fit "
            f"the inputs, which need s {tuple(expected_BHFM)} and z {expected_z} "
            f"(init_linear_state(batch, heads, F, M, normalizer={normalize}))."
        )
    for part in state:
        if part is not None and not jnp.issubdtype(part.dtype, jnp.floating):
            raise ValueError(f"{name}: initial_state must be floating point, got {part.dtype}.")
    return state


# Log decays at or below this are a reset: exp gives exactly 0 in float32 and float64 alike, and
# a sum of T of them stays finite, so the forms built from sums of log decays never meet -inf.
LOG_DECAY_FLOOR = -1e4


def along_time(valid, x):
    """`valid` ([..., T]) broadcastable against x ([..., T, ...]): [B, T] against [B, T, H, D],
    or a kernel's [C] against its [C, D] block."""
    return jnp.expand_dims(valid, tuple(range(valid.ndim, x.ndim)))


def prepare_log_decay(g_BTHX, valid_BT, acc):
    """The log decays the forms read: in `acc`; -inf (a decay of 0, a reset) and anything below
    as LOG_DECAY_FLOOR (the same decay, exactly); a positive value, which only an eager call can
    refuse (`check_log_decay`), as NaN (an error the outputs show); 0 where a key does not count
    (`valid_BT` False), whatever it held."""
    g = g_BTHX.astype(acc)
    g = jnp.where(g > 0, jnp.asarray(jnp.nan, acc), jnp.maximum(g, LOG_DECAY_FLOOR))
    return g if valid_BT is None else jnp.where(along_time(valid_BT, g), g, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class Preparation:
    """What the recurrence reads, from raw inputs: `prepare(q, k, v, g, valid)` -> (phi(q) *
    scale, phi(k), v, g), phi(k) and v zeroed where a key does not count (`valid` False; None:
    every key counts), g as `prepare_log_decay` makes it; with `finite`, also the finite part of
    v and g (the non-finite guard's, `nonfinite.py`). `where`, not a product: padded values may
    hold inf or NaN.

    Every part is elementwise along time, so it serves any stretch of steps; with a pointwise
    feature map (`pointwise`) it serves any block of features too, as a kernel loads them."""

    fm: FeatureMap
    scale: Any  # a number, or a scalar array (traced where it is learned)
    acc: Any
    finite: bool = False

    @property
    def pointwise(self) -> bool:
        return self.fm.pointwise

    def queries(self, q):
        phi_q = self.fm.query(q)
        if input_checks.is_number(self.scale) and self.scale == 1.0:
            return phi_q
        return phi_q * jnp.asarray(self.scale, phi_q.dtype)

    def keys(self, k, valid):
        phi_k = self.fm.key(k)
        return phi_k if valid is None else jnp.where(along_time(valid, phi_k), phi_k, 0)

    def values(self, v, valid):
        if valid is not None:
            v = jnp.where(along_time(valid, v), v, 0)
        return _nonfinite.finite_part(v) if self.finite else v

    def log_decays(self, g, valid):
        if g is None:
            return None
        g = prepare_log_decay(g, valid, self.acc)
        return _nonfinite.finite_part(g) if self.finite else g

    def __call__(self, q, k, v, g, valid):
        return self.queries(q), self.keys(k, valid), self.values(v, valid), self.log_decays(g, valid)
