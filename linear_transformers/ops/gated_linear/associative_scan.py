"""The "associative_scan" form: `lax.associative_scan` of every step's totals (its decay, whether
a segment begins at it, its own key and value); O(T log T) work, one [F, M] state per step in
memory.

Legend: B batch, T time, H heads, F feature-map features, M value features.

The form interface is in `forms.py`.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_transformers.ops import precision
from linear_transformers.ops.gated_linear import totals


def form(q, k, v, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, eps, acc):
    phi_q_BTHF, phi_k_BTHF, v_BTHM, g_BTHX = (
        (q, k, v, g) if prepare is None else prepare(q, k, v, g, valid_BT)
    )
    k_BTHF = phi_k_BTHF.astype(acc)
    ds_BTHFM = precision.einsum_in(acc, "bthf,bthm->bthfm", k_BTHF, v_BTHM)
    dz_BTHF = k_BTHF if z0_BHF is not None else None
    a_BTHX = None if g_BTHX is None else jnp.exp(g_BTHX)
    scanned = totals.scan_totals(a_BTHX, reset_BT, ds_BTHFM, dz_BTHF, axis=1)
    # The state after every step: the scanned totals applied to the initial state.
    s_BTHFM, z_BTHF = totals.apply_totals(
        (s0_BHFM[:, None], None if z0_BHF is None else z0_BHF[:, None]), scanned
    )
    q_BTHF = phi_q_BTHF.astype(acc)
    num_BTHM = jnp.einsum("bthf,bthfm->bthm", q_BTHF, s_BTHFM)
    den_BTH = None if z0_BHF is None else jnp.einsum("bthf,bthf->bth", q_BTHF, z_BTHF)
    final = (s_BTHFM[:, -1], None if z0_BHF is None else z_BTHF[:, -1])
    return totals.finish(num_BTHM, den_BTH, eps, v_BTHM.dtype), final
