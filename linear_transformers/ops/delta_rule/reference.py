"""The delta rule step by step, as its definition reads: the reference every other form is
tested against.

Legend: B batch, T time, H heads, D key features, M value features, X decay features (1 or D).

  S_t = diag(exp(g_t)) S_{t-1}                        (the decay: none, per head, or per key feature)
  S_t = S_t + beta_t k_t (v_t - k_t^T S_t)^T           (the delta rule: S_t (I - beta k k^T) + beta k v^T)
  o_t = S_t^T q_t

S is [D, M] per head; at a step where a segment begins (`reset`) the decayed S_{t-1} is dropped.
Inputs are prepared (`op.py`): q scaled, q and k normalised if asked, beta = 0 and g = 0 at
steps that do not count.
"""

from __future__ import annotations

import jax.numpy as jnp


def step(s_BHDM, q_BHD, k_BHD, v_BHM, beta_BH, g_BHX, reset_B=None):
    """One step of the recurrence: -> (S_t, o_t)."""
    if g_BHX is not None:
        s_BHDM = jnp.exp(g_BHX)[..., None] * s_BHDM
    if reset_B is not None:  # After the decay, which decays only the state dropped here.
        s_BHDM = jnp.where(reset_B[:, None, None, None], 0, s_BHDM)
    predicted_BHM = jnp.einsum("bhd,bhdm->bhm", k_BHD, s_BHDM)
    correction_BHM = beta_BH[..., None] * (v_BHM - predicted_BHM)
    s_BHDM = s_BHDM + jnp.einsum("bhd,bhm->bhdm", k_BHD, correction_BHM)
    return s_BHDM, jnp.einsum("bhd,bhdm->bhm", q_BHD, s_BHDM)


def form(q_BTHD, k_BTHD, v_BTHM, beta_BTH, g_BTHX, reset_BT, s0_BHDM):
    """-> (out [B, T, H, M], S_T): a Python loop over the T steps."""
    s_BHDM, outs = s0_BHDM, []
    for t in range(q_BTHD.shape[1]):
        g_BHX = None if g_BTHX is None else g_BTHX[:, t]
        reset_B = None if reset_BT is None else reset_BT[:, t]
        s_BHDM, o_BHM = step(s_BHDM, q_BTHD[:, t], k_BTHD[:, t], v_BTHM[:, t], beta_BTH[:, t], g_BHX, reset_B)
        outs.append(o_BHM)
    return jnp.stack(outs, axis=1), s_BHDM
