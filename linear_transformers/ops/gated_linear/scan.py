"""The "scan" form: the RNN, `lax.scan` of the update over the T steps; an O(F*M) state, T
sequential steps.

Legend: B batch, T time, H heads, F feature-map features, M value features, X decay features
(1 or F).

The form interface is in `forms.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops.gated_linear import totals


def form(q, k, v, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, eps, acc):
    phi_q_BTHF, phi_k_BTHF, v_BTHM, g_BTHX = (
        (q, k, v, g) if prepare is None else prepare(q, k, v, g, valid_BT)
    )

    def step(carry, x):
        """((s, z), step t's inputs) -> ((s, z), out_t)."""
        s_BHFM, z_BHF = carry
        q_BHF, k_BHF, v_BHM, g_BHX, reset_B = x
        q_BHF, k_BHF, v_BHM = q_BHF.astype(acc), k_BHF.astype(acc), v_BHM.astype(acc)
        if g_BHX is not None:
            a_BHX = jnp.exp(g_BHX)
            s_BHFM = a_BHX[..., None] * s_BHFM
            z_BHF = None if z_BHF is None else a_BHX * z_BHF
        if reset_B is not None:
            s_BHFM = jnp.where(reset_B[:, None, None, None], 0, s_BHFM)
            z_BHF = None if z_BHF is None else jnp.where(reset_B[:, None, None], 0, z_BHF)
        s_BHFM = s_BHFM + jnp.einsum("bhf,bhm->bhfm", k_BHF, v_BHM)
        num_BHM = jnp.einsum("bhf,bhfm->bhm", q_BHF, s_BHFM)
        den_BH = None
        if z_BHF is not None:
            z_BHF = z_BHF + k_BHF
            den_BH = jnp.einsum("bhf,bhf->bh", q_BHF, z_BHF)
        return (s_BHFM, z_BHF), totals.finish(num_BHM, den_BH, eps, v_BTHM.dtype)

    inputs = (phi_q_BTHF, phi_k_BTHF, v_BTHM, g_BTHX, reset_BT)
    time_major = tuple(None if x is None else jnp.swapaxes(x, 0, 1) for x in inputs)
    final, out_TBHM = jax.lax.scan(step, (s0_BHFM, z0_BHF), time_major)
    return jnp.swapaxes(out_TBHM, 0, 1), final
