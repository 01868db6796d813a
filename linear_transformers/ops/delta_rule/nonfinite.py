"""The guard every form of the delta rule carries: it runs on the finite part of v, of the log
decays and of the entering state, then writes NaN wherever a step sees a non-finite one (the
model: `gated_linear/nonfinite.py`).

Legend: B batch, T time, H heads, D key features, M value features, X decay features (1 or D).

The state's columns never mix (S_t[:, m] depends on S_{t-1}[:, m] and v[:, m] alone), its rows
do (the correction reads k^T S). So what a step sees:
- a non-finite v[s, m]: the outputs t >= s of its segment, in column m, and column m of the
  final state if s lies in the last segment;
- a NaN log decay g[s] (any feature; a positive one read under `jit`): the outputs t >= s of
  its segment in every column, and the whole final state if s lies in the last segment. The
  decay at a segment's first step decays the state the segment drops: it reaches nothing;
- a non-finite entry of the entering state in column m: column m of the outputs before the
  first segment begins, and of the final state if none begins.
A log decay of -inf (a decay of 0) is finite: per head a reset, per feature the row's.

Why every form: the chunked form multiplies by masked weights (0 * NaN at a masked pair), and
the recurrent ones compute the values right but not their gradients: 0 * NaN in the backward
pass of a decay reaches every earlier key even when no loss reads a NaN output. With the guard,
the outputs that see nothing bad, and the gradients through them, are those of the finite
inputs in every form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import _nonfinite
from linear_transformers.ops.gated_linear import nonfinite as gated_nonfinite
from linear_transformers.ops.gated_linear import totals


def guarded(form):
    """`form` (q, k, v, beta, g, reset, s0 prepared: `op.py`) with the guard."""

    @functools.wraps(form)
    def guarded(q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT, s0_BHDM, **kwargs):
        v, s0 = _nonfinite.finite_part(v_BTHM), _nonfinite.finite_part(s0_BHDM)
        g = None if g_BTHX is None else _nonfinite.finite_part(g_BTHX)
        result = form(q_BTHD, k_BTHD, v, beta_BTH, g, reset_BT, s0, **kwargs)
        clean = jnp.all(jnp.isfinite(v_BTHM)) & jnp.all(jnp.isfinite(s0_BHDM))
        if g_BTHX is not None:
            clean &= jnp.all(jnp.isfinite(g_BTHX))
        mark = functools.partial(_mark_seen, v_BTHM, g_BTHX, reset_BT, s0_BHDM)
        return jax.lax.cond(clean, lambda r: r, mark, result)

    return guarded


def _mark_seen(v_BTHM, g_BTHX, reset_BT, s0_BHDM, result):
    """NaN in the outputs, and the columns of the final state, that see a non-finite value (the
    module docstring). Runs only when some value is not finite."""
    out_BTHM, s_BHDM = result
    seen_BTHM = _nonfinite.seen_nonfinite_BTHM(
        v_BTHM, num_queries=v_BTHM.shape[1], causal=True, reset_BT=reset_BT
    )
    if g_BTHX is not None:
        seen_BTHM = seen_BTHM | jnp.any(gated_nonfinite.seen_decay_BTHX(g_BTHX, reset_BT), -1, keepdims=True)
    entering_BHM = jnp.any(~jnp.isfinite(s0_BHDM), axis=2)
    first_BT = jnp.ones(v_BTHM.shape[:2], bool) if reset_BT is None else totals.runs(reset_BT) == 0
    seen_BTHM = seen_BTHM | (first_BT[:, :, None, None] & entering_BHM[:, None])
    return _nonfinite.mark_seen(out_BTHM, seen_BTHM), _nonfinite.mark_seen(
        s_BHDM, seen_BTHM[:, -1, :, None, :]
    )
