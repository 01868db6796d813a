"""Non-causal linear attention and the recurrent (RNN) step of causal linear attention.

Legend: B batch, T query time, S key time, H heads, D key/query features, F feature-map
features (F = D for elu and relu), M value features, G = B * H (heads merged into the batch).

  out_t = phi(q_t) . s / (phi(q_t) . z + eps),   s = sum_i phi(k_i) v_i^T,  z = sum_i phi(k_i)

with the sums over all keys (non-causal) or over keys i <= t (causal). The state (s, z) is
accumulated in float32 (or wider) whatever the input dtype.

Layout: the contractions over time run with the heads moved next to the batch and the two
merged, G = B * H ([G, S, F] x [G, S, M] -> [G, F, M]): a plain batched matmul. XLA:CPU runs
"bshf,bshm->bhfm" (batch dims b, h around the contracted s) several times slower, at ~22
GFLOP/s against ~150 for a large matmul; the transposes fuse into the feature map and the
normalisation (BENCHMARKS.md section 1). `linear_attention_reference` is the explicit formula.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import input_checks, precision
from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.feature_maps import make_feature_map
from linear_transformers.ops.gated_linear import gated_linear_attention
from linear_transformers.ops.linear_state import LinearState, normalise


def heads_major(x_BSHF):
    """[B, S, H, F] -> [G, S, F] with G = B * H (batch-major, then heads)."""
    B, S, H, F = x_BSHF.shape
    return jnp.swapaxes(x_BSHF, 1, 2).reshape(B * H, S, F)


def time_major(x_GTM, batch: int):
    """The inverse of `heads_major`: [G, T, M] -> [B, T, H, M]."""
    G, T, M = x_GTM.shape
    return jnp.swapaxes(x_GTM.reshape(batch, G // batch, T, M), 1, 2)


def _local_state(k_BSHD, v_BSHM, key_lengths, *, fm, offset):
    acc = input_checks.accumulation_dtype(v_BSHM.dtype)
    B, _, H, _ = k_BSHD.shape
    phi_k_BSHF = fm.key(k_BSHD)
    if key_lengths is not None:
        valid_BS11 = (offset + jnp.arange(k_BSHD.shape[1])[None, :] < key_lengths[:, None])[:, :, None, None]
        # where, not multiply: padded values may hold inf or NaN.
        phi_k_BSHF = jnp.where(valid_BS11, phi_k_BSHF, 0)
        v_BSHM = jnp.where(valid_BS11, v_BSHM, 0)
    phi_k_GSF = heads_major(phi_k_BSHF)
    s_GFM = precision.einsum_in(acc, "gsf,gsm->gfm", phi_k_GSF, heads_major(v_BSHM))
    z_GF = jnp.sum(phi_k_GSF.astype(acc), axis=1)
    return LinearState(s_GFM.reshape(B, H, *s_GFM.shape[1:]), z_GF.reshape(B, H, -1))


def _sequence_parallel_state(k_BSHD, v_BSHM, key_lengths, *, fm, axis):
    local = _local_state(k_BSHD, v_BSHM, key_lengths, fm=fm, offset=sp.device_offset(axis, k_BSHD.shape[1]))
    return LinearState(*(jax.lax.psum(x, axis) for x in local))


def linear_state_from_keys(
    k_BSHD, v_BSHM, *, feature_map="elu", key_lengths=None, sequence_axis=None
) -> LinearState:
    """The summary (s, z) of all keys and values; padded keys (index >= key_lengths[b]) add 0.

    This is the whole memory a non-causal linear attention needs: cross-attention over a fixed
    memory computes it once and reuses it for every query. With `sequence_axis` (a mesh axis the
    key time axis is split over; see `causal_linear_attention`) each device sums its block and
    one psum gives every device the global summary; key_lengths are global indices.
    """
    fm = make_feature_map(feature_map)
    key_lengths = input_checks.check_key_lengths(
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
    eps = input_checks.check_eps(eps, name="linear_attention_from_state")
    fm = make_feature_map(feature_map)
    phi_q_xHF = fm.query(q_xHD).astype(state.s_BHFM.dtype)
    if q_xHD.ndim == 4:  # [B, T, H, D]: heads next to the batch (module docstring)
        B, _, H, _ = q_xHD.shape
        phi_q_GTF = heads_major(phi_q_xHF)
        s_GFM = state.s_BHFM.reshape(B * H, *state.s_BHFM.shape[2:])
        num_GTM = jnp.einsum("gtf,gfm->gtm", phi_q_GTF, s_GFM)
        den_GT = jnp.einsum("gtf,gf->gt", phi_q_GTF, state.z_BHF.reshape(B * H, -1))
        return time_major(normalise(num_GTM, den_GT, eps, out_dtype or q_xHD.dtype), B)
    # [B, H, D]: one query per head
    num = jnp.einsum("bhf,bhfm->bhm", phi_q_xHF, state.s_BHFM)
    den = jnp.einsum("bhf,bhf->bh", phi_q_xHF, state.z_BHF)
    return normalise(num, den, eps, out_dtype or q_xHD.dtype)


def linear_attention(
    q_BTHD,
    k_BSHD,
    v_BSHM,
    *,
    feature_map="elu",
    key_lengths=None,
    eps=1e-6,
    segment_ids=None,
    sequence_axis=None,
):
    """Non-causal linear attention in O(T + S) time and memory.

    Args:
      q_BTHD: [B, T, H, D]; k_BSHD: [B, S, H, D]; v_BSHM: [B, S, H, M].
      feature_map: registered name ("elu", "relu", "favor" via make_feature_map), a FeatureMap,
        or a callable.
      key_lengths: int [B] in [0, S]; keys at index >= key_lengths[b] contribute nothing (out
        of range: a ValueError eagerly, clamped under jit).
      eps: added to the normaliser: a number >= 0, or a scalar array.
      segment_ids: int [B, T] of packed sequences (self-attention, T == S; 0 = padding): each
        query reads the sums over its own segment only, computed as a forward and a backward
        causal pass with the state dropped between segments (O(T) memory, however many
        segments).
      sequence_axis: mesh axis the time axes of queries and keys are split over (inside
        `jax.shard_map`, or under `jax.set_mesh` where the op wraps itself; see
        `causal_linear_attention`): the (s, z) summary is summed over the devices with one psum.
        Under a mesh with explicit axis types, time axes sharded on a mesh axis select it.

    Arbitrary [T, S] masks cannot be honoured without forming the T x S matrix, so there is no
    mask argument; key padding and segments are the masks this form supports.
    """
    input_checks.check_qkv(q_BTHD, k_BSHD, v_BSHM, name="linear_attention")
    eps = input_checks.check_eps(eps, name="linear_attention")
    key_lengths = input_checks.check_key_lengths(
        key_lengths, q_BTHD.shape[0], name="linear_attention", length=k_BSHD.shape[1]
    )
    if segment_ids is not None:
        if q_BTHD.shape[1] != k_BSHD.shape[1]:
            raise ValueError(
                f"linear_attention: segment_ids are for self-attention (T == S), got "
                f"T={q_BTHD.shape[1]} and S={k_BSHD.shape[1]}."
            )
        segment_ids = input_checks.check_segment_ids(segment_ids, q_BTHD.shape[:2], name="linear_attention")
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
            lambda q, k, v, lengths, ids: local(q, k, v, key_lengths=lengths, segment_ids=ids),
            sequence_axis,
            (q_BTHD, k_BSHD, v_BSHM, key_lengths, segment_ids),
            (sp.TIME, sp.TIME, sp.TIME, sp.BATCH, sp.TIME),
            sp.TIME,
            batch=q_BTHD.shape[0],
        )
    if segment_ids is not None:
        return _segmented(q_BTHD, k_BSHD, v_BSHM, feature_map, key_lengths, eps, segment_ids, sequence_axis)
    state = linear_state_from_keys(
        k_BSHD, v_BSHM, feature_map=feature_map, key_lengths=key_lengths, sequence_axis=sequence_axis
    )
    return linear_attention_from_state(
        state, q_BTHD, feature_map=feature_map, eps=eps, out_dtype=v_BSHM.dtype
    )


def _segmented(q_BTHD, k_BTHD, v_BTHM, feature_map, key_lengths, eps, segment_ids_BT, axis):
    """Non-causal linear attention within segments: a causal pass forward and one backward,
    each with the state dropped between segments, count every key of a query's segment once
    and its own key twice (subtracted). The normaliser rides along as a column of ones."""
    fm = make_feature_map(feature_map)
    T = q_BTHD.shape[1]
    if key_lengths is not None:  # Padding as segment 0: a reversed pass cannot use lengths.
        offset = 0 if axis is None else sp.device_offset(axis, T)
        valid_BT = offset + jnp.arange(T)[None, :] < key_lengths[:, None]
        segment_ids_BT = jnp.where(valid_BT, segment_ids_BT, 0)
    acc = input_checks.accumulation_dtype(v_BTHM.dtype)
    ones = jnp.ones(v_BTHM.shape[:-1] + (1,), acc)
    v1_BTHM = jnp.concatenate([v_BTHM.astype(acc), ones], axis=-1)

    def causal(q, k, v, ids):
        return gated_linear_attention(q, k, v, feature_map=fm, scale=1.0, segment_ids=ids, sequence_axis=axis)

    forward = causal(q_BTHD, k_BTHD, v1_BTHM, segment_ids_BT)
    flipped = (sp.reverse_time(x, axis) for x in (q_BTHD, k_BTHD, v1_BTHM, segment_ids_BT))
    backward = sp.reverse_time(causal(*flipped), axis)
    phi_q, phi_k = fm.query(q_BTHD).astype(acc), fm.key(k_BTHD).astype(acc)
    own_BTH1 = jnp.sum(phi_q * phi_k, axis=-1, keepdims=True) * (segment_ids_BT != 0)[:, :, None, None]
    both = forward + backward - jnp.where(own_BTH1 != 0, own_BTH1 * v1_BTHM, 0)
    return normalise(both[..., :-1], both[..., -1], eps, v_BTHM.dtype)


def linear_attention_reference(q_BTHD, k_BSHD, v_BSHM, *, feature_map="elu", key_lengths=None, eps=1e-6):
    """The explicit kernel formula with the [T, S] similarity matrix, for tests."""
    fm = make_feature_map(feature_map)
    acc = input_checks.accumulation_dtype(v_BSHM.dtype)
    phi_q = fm.query(q_BTHD).astype(acc)
    phi_k = fm.key(k_BSHD).astype(acc)
    sim_BHTS = jnp.einsum("bthf,bshf->bhts", phi_q, phi_k)
    if key_lengths is not None:
        valid_BS = input_checks.key_padding_mask(jnp.asarray(key_lengths), k_BSHD.shape[1])
        sim_BHTS = jnp.where(valid_BS[:, None, None, :], sim_BHTS, 0)
        v_BSHM = jnp.where(valid_BS[:, :, None, None], v_BSHM, 0)
    num = jnp.einsum("bhts,bshm->bthm", sim_BHTS, v_BSHM.astype(acc))
    den = jnp.einsum("bhts->bth", sim_BHTS)
    return normalise(num, den, eps, v_BSHM.dtype)


def linear_attention_step(state: LinearState, q_BHD, k_BHD, v_BHM, *, feature_map="elu", eps=1e-6):
    """One step of causal linear attention as an RNN: (state, q_t, k_t, v_t) -> (state, out_t).

    Inputs are [B, H, D] (values [B, H, M]); the state comes from `init_linear_state`.
    Usable as the body of `lax.scan`.
    """
    input_checks.check_step_qkv(q_BHD, k_BHD, v_BHM, name="linear_attention_step")
    eps = input_checks.check_eps(eps, name="linear_attention_step")
    fm = make_feature_map(feature_map)
    B, H, D = q_BHD.shape
    expected = (B, H, fm.num_features(D), v_BHM.shape[-1])
    if state.s_BHFM.shape != expected or state.z_BHF.shape != expected[:3]:
        raise ValueError(
            f"linear_attention_step: state shapes s {tuple(state.s_BHFM.shape)}, z "
            f"{tuple(state.z_BHF.shape)} do not fit the inputs, which need s {expected} and z "
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
