"""The guard every form carries: it runs on the finite part of v and of the log decays, then
writes NaN wherever a step sees a non-finite value, and in the parts of the final s it reaches
(`ops/_nonfinite.py`).

Legend: B batch, T time, H heads, F feature-map features, M value features, X decay features
(1 or F).

What a step sees:
- a non-finite v[s, m]: the outputs t >= s of its segment, in column m, and column m of the
  final s if s lies in the last segment;
- a NaN log decay g[s] (a positive one read under `jit`: `inputs.prepare_log_decay`): it
  multiplies the state, so every output t >= s of its segment, in every column, and the rows of
  the final s and z it decays. A decay of 0 (g = -inf) is a reset, not an error: it is finite.

Why every form: the forms that multiply by masked weights ("reference", "chunked") would turn
one bad value into NaN at every step (0 * inf at a masked pair, 0 * NaN in a sum of log decays
taken as a matmul); the recurrent ones ("scan", "associative_scan") compute the values right but
their gradients wrong: 0 * NaN in the backward pass of a decay reaches every earlier key even
when no loss reads a NaN output. With the guard, the outputs that see nothing bad, and the
gradients through them, are those of the finite inputs in every form.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import _nonfinite
from linear_transformers.ops.feature_maps import make_feature_map
from linear_transformers.ops.gated_linear import inputs


def guarded(form):
    """`form` (the interface of `forms.py`) with the guard; a form that checks its inputs as
    it reads them (pallas) returns that check third, else the guard reads v and g for it. v and
    g are made finite by the `Preparation` the form is given, so the chunked form does that a
    segment at a time too, and the pallas kernel a chunk at a time. Inputs prepared already
    (prepare None) are only made finite: the identity map, no scale, and log decays prepared
    twice are the same."""

    @functools.wraps(form)
    def guarded(q, k, v_BTHM, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, acc, **kwargs):
        if prepare is None:
            prepare_finite = inputs.Preparation(make_feature_map("identity"), 1.0, acc, finite=True)
        else:
            prepare_finite = dataclasses.replace(prepare, finite=True)
        out, state, *checked = form(
            q, k, v_BTHM, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, prepare=prepare_finite, acc=acc, **kwargs
        )
        result = out, state
        clean = checked[0] if checked and checked[0] is not None else _clean(v_BTHM, g)
        mark = functools.partial(_mark_seen, v_BTHM, g, reset_BT, valid_BT, prepare, acc)
        # `lax.cond`: the decays are prepared again and the marks found only when needed.
        return jax.lax.cond(clean, lambda r: r, mark, result)

    return guarded


def _clean(v_BTHM, g_BTHX):
    """Every v is finite and every log decay <= 0 (NaN, and a positive value, which a jitted
    call reads as NaN, fail; -inf passes)."""
    clean = jnp.all(jnp.isfinite(v_BTHM))
    return clean if g_BTHX is None else clean & jnp.all(g_BTHX <= 0)


def seen_decay_BTHX(g_BTHX, reset_BT):
    """bool [B, T, H, X]: the state at step t was multiplied by a non-finite decay of its segment
    (not the one at its first step: that decays the state the segment drops)."""
    if reset_BT is not None:
        g_BTHX = jnp.where(reset_BT[:, :, None, None], jnp.zeros((), g_BTHX.dtype), g_BTHX)
    return _nonfinite.seen_nonfinite_BTHM(g_BTHX, num_queries=g_BTHX.shape[1], causal=True, reset_BT=reset_BT)


def mark_decayed_state(s_BHFM, z_BHF, seen_BHX):
    """NaN in the rows of s and z (all of them for a decay per head) a non-finite decay reached."""
    s_BHFM = _nonfinite.mark_seen(s_BHFM, seen_BHX[..., None])
    return s_BHFM, None if z_BHF is None else _nonfinite.mark_seen(z_BHF, seen_BHX)


def _mark_seen(v_BTHM, g_BTHX, reset_BT, valid_BT, prepare, acc, result):
    """NaN in the outputs (and the parts of the final state) that see a non-finite value of v (of
    the keys that count: `valid_BT`, None: all) or of the decays the form read (raw ones
    prepared as `prepare` did). Runs only inside the marking branch, so the masked copies are
    made only when some value is not finite."""
    if g_BTHX is not None and prepare is not None:
        g_BTHX = inputs.prepare_log_decay(g_BTHX, valid_BT, acc)
    if valid_BT is not None:
        v_BTHM = jnp.where(valid_BT[:, :, None, None], v_BTHM, jnp.zeros((), v_BTHM.dtype))
    out_BTHM, (s_BHFM, z_BHF) = result
    seen_BTHM = _nonfinite.seen_nonfinite_BTHM(
        v_BTHM, num_queries=v_BTHM.shape[1], causal=True, reset_BT=reset_BT
    )
    s_BHFM = _nonfinite.mark_seen(s_BHFM, seen_BTHM[:, -1][:, :, None, :])
    if g_BTHX is not None:
        decayed_BTHX = seen_decay_BTHX(g_BTHX, reset_BT)
        seen_BTHM = seen_BTHM | jnp.any(decayed_BTHX, axis=-1, keepdims=True)
        s_BHFM, z_BHF = mark_decayed_state(s_BHFM, z_BHF, decayed_BTHX[:, -1])
    return _nonfinite.mark_seen(out_BTHM, seen_BTHM), (s_BHFM, z_BHF)
