"""Non-causal linear attention and the recurrent (RNN) step of causal linear attention.

Legend: B batch, T query time, S key time, H heads, D key/query features, F feature-map
features (F = D for elu and relu), M value features.

  out_t = phi(q_t) . S / (phi(q_t) . z + eps),   S = sum_s phi(k_s) v_s^T,  z = sum_s phi(k_s)

with the sums over all keys (non-causal) or over s <= t (causal). S and z are accumulated in
float32 (or wider) whatever the input dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_transformers.ops import _checks, precision
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.feature_maps import make_feature_map


class LinearState(NamedTuple):
    """The recurrent state of linear attention: S = sum phi(k) v^T [B, H, F, M], z = sum phi(k)."""

    s_BHFM: jax.Array
    z_BHF: jax.Array


def init_linear_state(batch: int, heads: int, d: int, m: int, dtype=jnp.float32) -> LinearState:
    """Zero state for `linear_attention_step`.

    `d` is the feature-map dimension F (equal to the head dimension D for "elu" and "relu";
    `make_feature_map(...).num_features(D)` in general). Keep `dtype` float32 or wider: the state
    is a running sum.
    """
    return LinearState(
        s_BHFM=jnp.zeros((batch, heads, d, m), dtype), z_BHF=jnp.zeros((batch, heads, d), dtype)
    )


def _normalise(num_xM, den_x, eps, dtype):
    return (num_xM / (den_x + eps)[..., None]).astype(dtype)


def _local_state(k_BSHD, v_BSHM, key_lengths, *, fm, offset):
    acc = _checks.accumulation_dtype(v_BSHM.dtype)
    phi_k_BSHF = fm.key(k_BSHD)
    if key_lengths is not None:
        valid_BS11 = (offset + jnp.arange(k_BSHD.shape[1])[None, :] < key_lengths[:, None])[:, :, None, None]
        # where, not multiply: padded values may hold inf or NaN.
        phi_k_BSHF = jnp.where(valid_BS11, phi_k_BSHF, 0)
        v_BSHM = jnp.where(valid_BS11, v_BSHM, 0)
    s_BHFM = precision.einsum_in(acc, "bshf,bshm->bhfm", phi_k_BSHF, v_BSHM)
    z_BHF = jnp.sum(phi_k_BSHF.astype(acc), axis=1)
    return LinearState(s_BHFM, z_BHF)


def _sequence_parallel_state(k_BSHD, v_BSHM, key_lengths, *, fm, axis):
    local = _local_state(k_BSHD, v_BSHM, key_lengths, fm=fm, offset=sp.device_offset(axis, k_BSHD.shape[1]))
    return LinearState(*(jax.lax.psum(x, axis) for x in local))


def linear_state_from_keys(
    k_BSHD, v_BSHM, *, feature_map="elu", key_lengths=None, sequence_axis=None
) -> LinearState:
    """The summary (S, z) of all keys and values; padded keys (index >= key_lengths[b]) add 0.

    This is the whole memory a non-causal linear attention needs: cross-attention over a fixed
    memory computes it once and reuses it for every query. With `sequence_axis` (a mesh axis the
    key time axis is split over; see `causal_linear_attention`) each device sums its block and
    one psum gives every device the global summary; key_lengths are global indices.
    """
    fm = make_feature_map(feature_map)
    key_lengths = _checks.check_key_lengths(
        key_lengths, k_BSHD.shape[0], name="linear_attention", length=k_BSHD.shape[1]
    )
    if sequence_axis is None:
        sequence_axis = sp.explicit_sequence_axis(k_BSHD, v_BSHM, name="linear_state_from_keys")
    if sequence_axis is None:
        return _local_state(k_BSHD, v_BSHM, key_lengths, fm=fm, offset=0)
    if not sp.is_manual(sequence_axis):
        sp.check_sequence_axis(sequence_axis, k_BSHD.shape[1], name="linear_state_from_keys")
    local = functools.partial(_sequence_parallel_state, fm=fm, axis=sequence_axis)
    return sp.call_over_sequence(
        local,
        sequence_axis,
        (k_BSHD, v_BSHM, key_lengths),
        (sp.TIME, sp.TIME, sp.BATCH),
        sp.BATCH,
        batch=k_BSHD.shape[0],
    )


def linear_attention_from_state(state: LinearState, q_xHD, *, feature_map="elu", eps=1e-6, out_dtype=None):
    """Queries [..., H, D] attend to a fixed summary state; returns [..., H, M]."""
    fm = make_feature_map(feature_map)
    phi_q_xHF = fm.query(q_xHD).astype(state.s_BHFM.dtype)
    if q_xHD.ndim == 4:  # [B, T, H, D]
        num = jnp.einsum("bthf,bhfm->bthm", phi_q_xHF, state.s_BHFM)
        den = jnp.einsum("bthf,bhf->bth", phi_q_xHF, state.z_BHF)
    else:  # [B, H, D]
        num = jnp.einsum("bhf,bhfm->bhm", phi_q_xHF, state.s_BHFM)
        den = jnp.einsum("bhf,bhf->bh", phi_q_xHF, state.z_BHF)
    return _normalise(num, den, eps, out_dtype or q_xHD.dtype)


def linear_attention(
    q_BTHD, k_BSHD, v_BSHM, *, feature_map="elu", key_lengths=None, eps=1e-6, sequence_axis=None
):
    """Non-causal linear attention in O(T + S) time and memory.

    Args:
      q_BTHD: [B, T, H, D]; k_BSHD: [B, S, H, D]; v_BSHM: [B, S, H, M].
      feature_map: registered name ("elu", "relu", "favor" via make_feature_map), a FeatureMap,
        or a callable.
      key_lengths: int [B] in [0, S]; keys at index >= key_lengths[b] contribute nothing (out
        of range: a ValueError eagerly, clamped under jit).
      eps: added to the normaliser.
      sequence_axis: mesh axis the time axes of queries and keys are split over (inside
        `jax.shard_map`, or under `jax.set_mesh` where the op wraps itself; see
        `causal_linear_attention`): the (S, z) summary is summed over the devices with one psum.
        Under a mesh with explicit axis types, time axes sharded on a mesh axis select it.

    Arbitrary [T, S] masks cannot be honoured without forming the T x S matrix, so there is no
    mask argument; key padding is the only mask this form supports.
    """
    _checks.check_qkv(q_BTHD, k_BSHD, v_BSHM, name="linear_attention")
    key_lengths = _checks.check_key_lengths(
        key_lengths, q_BTHD.shape[0], name="linear_attention", length=k_BSHD.shape[1]
    )
    if sequence_axis is None:
        sequence_axis = sp.explicit_sequence_axis(q_BTHD, k_BSHD, v_BSHM, name="linear_attention")
    if sequence_axis is not None and not sp.is_manual(sequence_axis):
        # The global view: queries and keys split over the axis, the summary made inside.
        sp.check_sequence_axis(sequence_axis, q_BTHD.shape[1], name="linear_attention")
        sp.check_sequence_axis(sequence_axis, k_BSHD.shape[1], name="linear_attention")
        local = functools.partial(
            linear_attention, feature_map=feature_map, eps=eps, sequence_axis=sequence_axis
        )
        return sp.call_over_sequence(
            lambda q, k, v, lengths: local(q, k, v, key_lengths=lengths),
            sequence_axis,
            (q_BTHD, k_BSHD, v_BSHM, key_lengths),
            (sp.TIME, sp.TIME, sp.TIME, sp.BATCH),
            sp.TIME,
            batch=q_BTHD.shape[0],
        )
    state = linear_state_from_keys(
        k_BSHD, v_BSHM, feature_map=feature_map, key_lengths=key_lengths, sequence_axis=sequence_axis
    )
    return linear_attention_from_state(
        state, q_BTHD, feature_map=feature_map, eps=eps, out_dtype=v_BSHM.dtype
    )


def linear_attention_reference(q_BTHD, k_BSHD, v_BSHM, *, feature_map="elu", key_lengths=None, eps=1e-6):
    """The explicit kernel formula with the [T, S] similarity matrix, for tests."""
    fm = make_feature_map(feature_map)
    acc = _checks.accumulation_dtype(v_BSHM.dtype)
    phi_q = fm.query(q_BTHD).astype(acc)
    phi_k = fm.key(k_BSHD).astype(acc)
    sim_BHTS = jnp.einsum("bthf,bshf->bhts", phi_q, phi_k)
    if key_lengths is not None:
        valid_BS = _checks.key_padding_mask(jnp.asarray(key_lengths), k_BSHD.shape[1])
        sim_BHTS = jnp.where(valid_BS[:, None, None, :], sim_BHTS, 0)
        v_BSHM = jnp.where(valid_BS[:, :, None, None], v_BSHM, 0)
    num = jnp.einsum("bhts,bshm->bthm", sim_BHTS, v_BSHM.astype(acc))
    den = jnp.einsum("bhts->bth", sim_BHTS)
    return _normalise(num, den, eps, v_BSHM.dtype)


def linear_attention_step(state: LinearState, q_BHD, k_BHD, v_BHM, *, feature_map="elu", eps=1e-6):
    """One step of causal linear attention as an RNN: (state, q_t, k_t, v_t) -> (state, out_t).

    Inputs are [B, H, D] (values [B, H, M]); the state comes from `init_linear_state`.
    Usable as the body of `lax.scan`.
    """
    _checks.check_step_qkv(q_BHD, k_BHD, v_BHM, name="linear_attention_step")
    fm = make_feature_map(feature_map)
    B, H, D = q_BHD.shape
    expected = (B, H, fm.num_features(D), v_BHM.shape[-1])
    if state.s_BHFM.shape != expected or state.z_BHF.shape != expected[:3]:
        raise ValueError(
            f"linear_attention_step: state shapes S {tuple(state.s_BHFM.shape)}, z "
            f"{tuple(state.z_BHF.shape)} do not fit the inputs, which need S {expected} and z "
            f"{expected[:3]} (init_linear_state(batch, heads, F, M))."
        )
    acc = state.s_BHFM.dtype
    phi_k_BHF = fm.key(k_BHD).astype(acc)
    s_BHFM = state.s_BHFM + jnp.einsum("bhf,bhm->bhfm", phi_k_BHF, v_BHM.astype(acc))
    z_BHF = state.z_BHF + phi_k_BHF
    new_state = LinearState(s_BHFM, z_BHF)
    return new_state, linear_attention_from_state(
        new_state, q_BHD, feature_map=fm, eps=eps, out_dtype=v_BHM.dtype
    )
