"""The "reference" form: the dense [T, T] (per-feature decays: [T, T, F]) decay matrix, masked;
O(T^2) time and memory. The others are checked against it.

Legend: B batch, T query time, S key time (the same positions), H heads, D key/query features,
F feature-map features, M value features, X decay features (1 or F); `x` in a suffix: 1 or B.

The form interface is in `forms.py`.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_transformers.ops.gated_linear import totals


def form(q, k, v, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, eps, acc):
    phi_q_BTHF, phi_k_BTHF, v_BTHM, g_BTHX = (
        (q, k, v, g) if prepare is None else prepare(q, k, v, g, valid_BT)
    )
    T = phi_q_BTHF.shape[1]
    q_BTHF, k_BTHF = phi_q_BTHF.astype(acc), phi_k_BTHF.astype(acc)
    mask_xTS = jnp.tril(jnp.ones((T, T), bool))[None]
    reads_state_xT = None
    if reset_BT is not None:
        runs_BT = totals.runs(reset_BT)
        mask_xTS = mask_xTS & (runs_BT[:, :, None] == runs_BT[:, None, :])
        reads_state_xT = runs_BT == 0
    sim_BHTS = jnp.einsum("bthf,bshf->bhts", q_BTHF, k_BTHF)
    q_in_BTHF = q_BTHF
    if g_BTHX is not None:
        log_BHTSX = totals.pair_log_decay(g_BTHX, time_axis=1)
        decay_BHTSX = jnp.exp(jnp.where(mask_xTS[:, None, :, :, None], log_BHTSX, -jnp.inf))
        if g_BTHX.shape[-1] == 1:
            sim_BHTS = sim_BHTS * decay_BHTSX[..., 0]
        else:
            sim_BHTS = jnp.einsum("bthf,bshf,bhtsf->bhts", q_BTHF, k_BTHF, decay_BHTSX)
        q_in_BTHF = q_BTHF * jnp.exp(totals.prefix_sum(g_BTHX, axis=1))
    sim_BHTS = jnp.where(mask_xTS[:, None], sim_BHTS, 0)
    num_BTHM = jnp.einsum("bhts,bshm->bthm", sim_BHTS, v_BTHM.astype(acc))
    state_num_BTHM = jnp.einsum("bthf,bhfm->bthm", q_in_BTHF, s0_BHFM)
    den_BTH = state_den_BTH = None
    if z0_BHF is not None:
        den_BTH = jnp.einsum("bhts->bth", sim_BHTS)
        state_den_BTH = jnp.einsum("bthf,bhf->bth", q_in_BTHF, z0_BHF)
    if reads_state_xT is not None:  # Queries after a segment's start read no earlier state.
        state_num_BTHM = jnp.where(reads_state_xT[:, :, None, None], state_num_BTHM, 0)
        if z0_BHF is not None:
            state_den_BTH = jnp.where(reads_state_xT[:, :, None], state_den_BTH, 0)
    num_BTHM = num_BTHM + state_num_BTHM
    den_BTH = None if z0_BHF is None else den_BTH + state_den_BTH
    block = totals.block_totals(phi_k_BTHF, v_BTHM, g_BTHX, reset_BT, acc, normalize=z0_BHF is not None)
    out_BTHM = totals.finish(num_BTHM, den_BTH, eps, v_BTHM.dtype)
    return out_BTHM, totals.apply_totals((s0_BHFM, z0_BHF), block)
