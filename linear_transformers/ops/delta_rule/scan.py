"""The delta rule as one `lax.scan` over time: the recurrence of `reference.py`, compiled once
whatever T. O(T D M) work, one [D, M] state per head in memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.delta_rule import reference


def form(q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT, s0_BHDM):
    """-> (out [B, T, H, M], S_T)."""

    def body(s_BHDM, x):
        return reference.step(s_BHDM, *x)

    inputs = (q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT)
    xs = tuple(None if x is None else jnp.swapaxes(x, 0, 1) for x in inputs)
    s_BHDM, out_TBHM = jax.lax.scan(body, sp.vary_like(s0_BHDM, xs), xs)
    return jnp.swapaxes(out_TBHM, 0, 1), s_BHDM
