"""The op on one block of the sequence: the whole sequence on one device, or this device's block
inside `jax.shard_map` over a sequence axis (LASP-2, Sun et al. 2025).

Legend: B batch, T time (this block's), H heads, D key/query features, F feature-map features,
M value features, X decay features (1 or F), P devices on the sequence axis.

A block reads its keys through two flags, bool [B, T] (None: every key counts; no segment
begins): `valid`, the keys that count (index < key_lengths, segment id not 0), and `reset`,
the steps where a segment begins. Its first step continues the state before it (the initial
state; on device p, the state the blocks of devices < p leave), so a segment begins there only
where the id differs from the last id of the block before.

On one device the form runs on the raw inputs with `prepare` (so the chunked form prepares a
segment at a time). On a device of a sequence axis the block is prepared once and reduced to its
totals (`totals.block_totals`); one all-gather shares the P devices' totals, and each device
runs the form from the state the devices before it leave. Every device returns the global final
state. The traffic is P states per device whatever the sequence length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import _nonfinite
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.gated_linear import nonfinite, totals
from linear_transformers.ops.linear_state import LinearState


def flags(T: int, key_lengths_B, segment_ids_BT, *, axis):
    """(valid_BT, reset_BT) of this block (the module docstring); `axis`: the manual mesh axis
    the block is one device's part of, or None (the whole sequence)."""
    offset = 0 if axis is None else sp.device_offset(axis, T)
    valid_BT = reset_BT = None
    if key_lengths_B is not None:
        valid_BT = offset + jnp.arange(T)[None, :] < key_lengths_B[:, None]
    if segment_ids_BT is not None:
        previous_B = segment_ids_BT[:, 0]  # No segment begins at the first step of a call.
        if axis is not None:
            index = jax.lax.axis_index(axis)
            last_ids_PB = jax.lax.all_gather(segment_ids_BT[:, -1], axis)
            previous_B = jnp.where(index > 0, last_ids_PB[jnp.maximum(index - 1, 0)], previous_B)
        previous_BT = jnp.concatenate([previous_B[:, None], segment_ids_BT[:, :-1]], axis=1)
        present_BT = segment_ids_BT != 0
        valid_BT = present_BT if valid_BT is None else valid_BT & present_BT
        reset_BT = valid_BT & (segment_ids_BT != previous_BT)
    return valid_BT, reset_BT


def attend_block(
    q_BTHD,
    k_BTHD,
    v_BTHM,
    g_BTHX,
    key_lengths_B,
    segment_ids_BT,
    initial_state,
    *,
    axis,
    form,
    prepare,
    eps,
    acc,
):
    """-> (out [B, T, H, M], the final LinearState): `form` (bound to its options) over this block,
    on one device (axis None) or as device `axis_index(axis)`'s part of the sequence."""
    valid_BT, reset_BT = flags(q_BTHD.shape[1], key_lengths_B, segment_ids_BT, axis=axis)
    args = (q_BTHD, k_BTHD, v_BTHM, g_BTHX, valid_BT, reset_BT)
    if axis is None:
        out_BTHM, final = form(*args, *initial_state, prepare=prepare, eps=eps, acc=acc)
        return out_BTHM, LinearState(*final)
    phi_q_BTHF, phi_k_BTHF, v_BTHM, g_BTHX = prepare(q_BTHD, k_BTHD, v_BTHM, g_BTHX, valid_BT)
    normalize = initial_state.z_BHF is not None
    block = _block_totals(phi_k_BTHF, v_BTHM, g_BTHX, reset_BT, acc, normalize=normalize)
    start, final = _start_and_final(block, tuple(initial_state), axis)
    prepared = (phi_q_BTHF, phi_k_BTHF, v_BTHM, g_BTHX, valid_BT, reset_BT)
    out_BTHM, _ = form(*prepared, *start, prepare=None, eps=eps, acc=acc)
    return out_BTHM, LinearState(*final)


def _block_totals(phi_k_BTHF, v_BTHM, g_BTHX, reset_BT, acc, *, normalize):
    """`totals.block_totals` from the finite part of the decays, with NaN in the rows of the
    state a non-finite decay of the block's last segment reached (`nonfinite.py`): a sum of log
    decays is a matmul, where one NaN would reach every key."""
    finite_BTHX = None if g_BTHX is None else _nonfinite.finite_part(g_BTHX)
    a, dropped, ds, dz = totals.block_totals(
        phi_k_BTHF, v_BTHM, finite_BTHX, reset_BT, acc, normalize=normalize
    )
    if g_BTHX is not None:
        ds, dz = nonfinite.mark_decayed_state(ds, dz, nonfinite.seen_decay_BTHX(g_BTHX, reset_BT)[:, -1])
    return a, dropped, ds, dz


def _start_and_final(block, initial, axis):
    """The state this device's block starts from and the global final state, from the devices'
    block totals."""
    a, dropped, ds, dz = block
    if a is None and dropped is None:
        # Sums only: the exclusive prefix of the devices' totals, and psum rather than the sum
        # of the gathered totals for the final state: the same on every device by construction,
        # which shard_map can verify for a replicated output.
        before = sp.exclusive_prefix(jax.lax.all_gather((ds, dz), axis), axis)
        start = tuple(None if x0 is None else x0 + b for x0, b in zip(initial, before))
        final = tuple(None if x0 is None else x0 + jax.lax.psum(t, axis) for x0, t in zip(initial, (ds, dz)))
        return start, final
    # With decays or segments the devices' totals compose in order, each decaying (or dropping)
    # what came before it: folded over the P gathered totals.
    gathered = sp.gather_replicated(block, axis)
    index = jax.lax.axis_index(axis)
    final = start = initial
    for p in range(sp.axis_size(axis)):
        final = totals.apply_totals(final, jax.tree.map(lambda x, p=p: x[p], gathered))
        start = jax.tree.map(lambda new, old, p=p: jnp.where(p < index, new, old), final, start)
    return start, final
