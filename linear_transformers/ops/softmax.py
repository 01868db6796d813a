"""Softmax attention: parallel form, plain reference, and the KV-cache recurrent step.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features.
Logits and the softmax are computed in float32 (or wider) whatever the input dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_transformers.ops import _checks, _nonfinite, precision
from linear_transformers.ops import sequence_parallel as sp

IMPLEMENTATIONS = (None, "xla", "cudnn", "reference")


def _build_mask_BHTS(batch, heads, t, s, *, causal, key_lengths, mask):
    """Combine causal, key-padding and explicit masks into one boolean [B|1, H|1, T, S] mask."""
    combined = None
    if causal:
        combined = jnp.tril(jnp.ones((t, s), bool))[None, None]
    if key_lengths is not None:
        padding = _checks.key_padding_mask(key_lengths, s)[:, None, None, :]
        combined = padding if combined is None else combined & padding
    mask = _checks.check_mask(mask, (batch, heads, t, s), name="softmax_attention")
    if mask is not None:
        combined = mask if combined is None else combined & mask
    return combined


def softmax_attention_weights(q_BTHD, k_BSHD, *, causal=False, key_lengths=None, mask=None, scale=None):
    """Attention probabilities [B, H, T, S], float32 (or float64 for float64 inputs).

    Masked entries get probability 0; a row with no valid key is uniform over its keys (as in
    `jax.nn.dot_product_attention`), so its output is finite.
    """
    B, T, H, D = q_BTHD.shape
    S = k_BSHD.shape[1]
    acc = _checks.accumulation_dtype(q_BTHD.dtype)
    scale = D**-0.5 if scale is None else scale
    logits_BHTS = precision.einsum_in(acc, "bthd,bshd->bhts", q_BTHD, k_BSHD)
    logits_BHTS = logits_BHTS * jnp.asarray(scale, acc)
    mask_BHTS = _build_mask_BHTS(B, H, T, S, causal=causal, key_lengths=key_lengths, mask=mask)
    if mask_BHTS is not None:
        logits_BHTS = jnp.where(mask_BHTS, logits_BHTS, jnp.finfo(acc).min)
    return jax.nn.softmax(logits_BHTS, axis=-1)


def validate_softmax_inputs(q_BTHD, k_BSHD, v_BSHM, *, causal, key_lengths):
    """Check shapes; return key_lengths as int32 [B] (or None)."""
    _checks.check_qkv(q_BTHD, k_BSHD, v_BSHM, name="softmax_attention")
    if causal and q_BTHD.shape[1] != k_BSHD.shape[1]:
        raise ValueError(
            f"softmax_attention: causal=True needs as many queries as keys, got "
            f"T={q_BTHD.shape[1]} and S={k_BSHD.shape[1]}."
        )
    return _checks.check_key_lengths(
        key_lengths, q_BTHD.shape[0], name="softmax_attention", length=k_BSHD.shape[1]
    )


def softmax_attention_reference(
    q_BTHD, k_BSHD, v_BSHM, *, causal=False, key_lengths=None, mask=None, scale=None
):
    """The plain O(T*S) formula softmax(q k^T * scale) v with explicit weights."""
    key_lengths = validate_softmax_inputs(q_BTHD, k_BSHD, v_BSHM, causal=causal, key_lengths=key_lengths)
    w_BHTS = softmax_attention_weights(
        q_BTHD, k_BSHD, causal=causal, key_lengths=key_lengths, mask=mask, scale=scale
    )
    out_BTHM = jnp.einsum("bhts,bshm->bthm", w_BHTS, v_BSHM.astype(w_BHTS.dtype))
    return out_BTHM.astype(v_BSHM.dtype)


def softmax_attention(
    q_BTHD,
    k_BSHD,
    v_BSHM,
    *,
    causal=False,
    key_lengths=None,
    mask=None,
    scale=None,
    implementation=None,
    sequence_axis=None,
):
    """Softmax attention softmax(q k^T * scale) v.

    Args:
      q_BTHD: queries [B, T, H, D]; k_BSHD keys [B, S, H, D]; v_BSHM values [B, S, H, M].
      causal: query t attends to keys s <= t (needs T == S).
      key_lengths: int [B] in [0, S]; keys at index >= key_lengths[b] are ignored (out of
        range: a ValueError eagerly, clamped under jit).
      mask: boolean [T, S] or [B, H, T, S] (size-1 dimensions broadcast), True = attend; a
        float (additive) mask or a 3-D one is refused (`ops._checks.check_mask`).
      scale: multiplies the logits (softmax temperature); default 1/sqrt(D).
      implementation: None (jax.nn.dot_product_attention where it applies, i.e. D == M, else the
        reference), "xla" or "cudnn" (jax.nn.dot_product_attention with that implementation;
        "cudnn" is flash attention on NVIDIA GPUs), or "reference" (explicit weights).
      sequence_axis: mesh axis the time axes of queries and keys are split over. Each device
        all-gathers the keys and values (the whole sequence's, O(S) per device: the baseline to
        compare with linear attention's states) and attends its own queries, offset to their
        global positions for the causal mask. Inside `jax.shard_map` over the axis, or under
        `jax.set_mesh` where the op wraps itself; key_lengths are global; `mask` is refused.
        Under a mesh with explicit axis types, time axes sharded on a mesh axis select it.

    Returns:
      [B, T, H, M] in the dtype of v.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"softmax_attention: unknown implementation {implementation!r}; "
            f"expected one of {IMPLEMENTATIONS}."
        )
    key_lengths = validate_softmax_inputs(q_BTHD, k_BSHD, v_BSHM, causal=causal, key_lengths=key_lengths)
    if sequence_axis is None and mask is None:
        sequence_axis = sp.explicit_sequence_axis(q_BTHD, k_BSHD, v_BSHM, name="softmax_attention")
    if sequence_axis is not None:
        return _sequence_parallel_softmax(
            q_BTHD,
            k_BSHD,
            v_BSHM,
            causal=causal,
            key_lengths=key_lengths,
            mask=mask,
            scale=scale,
            implementation=implementation,
            axis=sequence_axis,
        )
    # The weights of unseen keys are 0, and 0 * inf is NaN: attend over the finite part of v
    # and mark NaN where a query sees a non-finite value (ops/_nonfinite.py).
    B, T, H, _ = q_BTHD.shape
    full_mask = (
        None
        if mask is None
        else _build_mask_BHTS(B, H, T, k_BSHD.shape[1], causal=False, key_lengths=None, mask=mask)
    )
    out_BTHM = _dense_softmax(
        q_BTHD,
        k_BSHD,
        _nonfinite.finite_part(v_BSHM),
        causal=causal,
        key_lengths=key_lengths,
        mask=mask,
        full_mask=full_mask,
        scale=scale,
        implementation=implementation,
    )

    def mark(out_BTHM):
        seen_BTHM = _nonfinite.seen_nonfinite_BTHM(
            v_BSHM, num_queries=T, causal=causal, key_lengths=key_lengths, mask_BHTS=full_mask
        )
        return _nonfinite.mark_seen(out_BTHM, seen_BTHM)

    return _nonfinite.mark_unless_all_finite(v_BSHM, out_BTHM, mark)


def _dense_softmax(q_BTHD, k_BSHD, v_BSHM, *, causal, key_lengths, mask, full_mask, scale, implementation):
    same_dims = q_BTHD.shape[-1] == v_BSHM.shape[-1]
    if implementation in ("xla", "cudnn") and not same_dims:
        raise ValueError(
            f"softmax_attention: implementation={implementation!r} (jax.nn.dot_product_attention) "
            f"needs value features M equal to key features D, got D={q_BTHD.shape[-1]}, "
            f"M={v_BSHM.shape[-1]}; use implementation=None or 'reference'."
        )
    if implementation == "reference" or (implementation is None and not same_dims):
        return softmax_attention_reference(
            q_BTHD, k_BSHD, v_BSHM, causal=causal, key_lengths=key_lengths, mask=mask, scale=scale
        )
    dtype = jnp.result_type(q_BTHD, k_BSHD, v_BSHM)
    return jax.nn.dot_product_attention(
        q_BTHD.astype(dtype),
        k_BSHD.astype(dtype),
        v_BSHM.astype(dtype),
        mask=full_mask,
        scale=scale,
        is_causal=causal,
        key_value_seq_lengths=key_lengths,
        implementation=implementation,
    )


def _sequence_parallel_softmax(
    q_BTHD, k_BSHD, v_BSHM, *, causal, key_lengths, mask, scale, implementation, axis
):
    name = "softmax_attention"
    if mask is not None:
        raise ValueError(
            f"{name}: an explicit mask cannot be combined with sequence_axis (its "
            "[T, S] layout is the global one); use causal and key_lengths."
        )
    if not sp.is_manual(axis):
        sp.check_sequence_axis(axis, q_BTHD.shape[1], name=name)
        sp.check_sequence_axis(axis, k_BSHD.shape[1], name=name)

    def local(q_BTHD, k_BSHD, v_BSHM, key_lengths):
        T = q_BTHD.shape[1]
        k_all = jax.lax.all_gather(k_BSHD, axis, axis=1, tiled=True)
        v_all = jax.lax.all_gather(v_BSHM, axis, axis=1, tiled=True)
        causal_mask = None
        if causal:
            position_T = sp.device_offset(axis, T) + jnp.arange(T)
            causal_mask = (jnp.arange(k_all.shape[1])[None, :] <= position_T[:, None])[None, None]
        return softmax_attention(
            q_BTHD,
            k_all,
            v_all,
            key_lengths=key_lengths,
            mask=causal_mask,
            scale=scale,
            implementation=implementation,
        )

    return sp.call_over_sequence(
        local,
        axis,
        (q_BTHD, k_BSHD, v_BSHM, key_lengths),
        (sp.TIME, sp.TIME, sp.TIME, sp.BATCH),
        sp.TIME,
        batch=q_BTHD.shape[0],
    )


class KVCache(NamedTuple):
    """Preallocated keys and values for softmax recurrent inference.

    `length` (int32 scalar) counts the filled slots; shapes never change, so the cache is a valid
    `lax.scan` carry.
    """

    k_BSHD: jax.Array
    v_BSHM: jax.Array
    length: jax.Array


def init_kv_cache(batch: int, max_length: int, heads: int, d: int, m: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for up to `max_length` steps of keys [B, S, H, D] and values [B, S, H, M]."""
    if max_length < 1:
        raise ValueError(f"init_kv_cache: max_length must be >= 1, got {max_length}.")
    return KVCache(
        k_BSHD=jnp.zeros((batch, max_length, heads, d), dtype),
        v_BSHM=jnp.zeros((batch, max_length, heads, m), dtype),
        length=jnp.zeros((), jnp.int32),
    )


def softmax_attention_step(cache: KVCache, q_BHD, k_BHD, v_BHM, *, scale=None):
    """One causal step: append (k_t, v_t) to the cache and attend q_t to every filled slot.

    Returns (new_cache, out_BHM). Stepping past `max_length` cannot grow a static cache: an eager
    call raises, and under `jit` the output is NaN so the overflow cannot pass unnoticed.
    """
    _checks.check_step_qkv(q_BHD, k_BHD, v_BHM, name="softmax_attention_step")
    capacity = cache.k_BSHD.shape[1]
    B, H, D = q_BHD.shape
    if cache.k_BSHD.shape != (B, capacity, H, D) or cache.v_BSHM.shape != (B, capacity) + v_BHM.shape[1:]:
        raise ValueError(
            f"softmax_attention_step: cache shapes k {tuple(cache.k_BSHD.shape)}, v "
            f"{tuple(cache.v_BSHM.shape)} do not fit q_t {tuple(q_BHD.shape)}, "
            f"v_t {tuple(v_BHM.shape)}."
        )
    if _checks.is_concrete(cache.length) and int(cache.length) >= capacity:
        raise ValueError(
            f"softmax_attention_step: the KV cache is full ({capacity} steps); allocate a larger max_length."
        )
    pos = cache.length
    k_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.k_BSHD, k_BHD[:, None].astype(cache.k_BSHD.dtype), pos, axis=1
    )
    v_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.v_BSHM, v_BHM[:, None].astype(cache.v_BSHM.dtype), pos, axis=1
    )
    valid_S = jnp.arange(capacity) <= pos
    w_BHTS = softmax_attention_weights(
        q_BHD[:, None].astype(k_cache.dtype), k_cache, mask=valid_S[None, None, None, :], scale=scale
    )
    out_BHM = jnp.einsum("bhs,bshm->bhm", w_BHTS[:, :, 0], v_cache.astype(w_BHTS.dtype))
    out_BHM = jnp.where(pos < capacity, out_BHM, jnp.nan).astype(v_BHM.dtype)
    return KVCache(k_cache, v_cache, pos + 1), out_BHM


def softmax_attention_prefill(cache: KVCache, q_BTHD, k_BTHD, v_BTHM, *, scale=None):
    """A block of T causal steps at once: write (k, v) into the cache after its `length` filled
    slots and attend each query to every slot up to its own.

    Equal to T calls of `softmax_attention_step`, in one parallel pass (the prompt of a
    generation). Returns (cache with length + T, out_BTHM). Past `max_length`: an eager call
    raises, and under `jit` the outputs are NaN, as for the step.
    """
    name = "softmax_attention_prefill"
    _checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    B, T, H, D = q_BTHD.shape
    if k_BTHD.shape[1] != T:
        raise ValueError(
            f"{name}: queries and keys must have the same length, got T={T} and S={k_BTHD.shape[1]}."
        )
    capacity = cache.k_BSHD.shape[1]
    if cache.k_BSHD.shape != (B, capacity, H, D) or cache.v_BSHM.shape != (B, capacity) + v_BTHM.shape[2:]:
        raise ValueError(
            f"{name}: cache shapes k {tuple(cache.k_BSHD.shape)}, v {tuple(cache.v_BSHM.shape)} "
            f"do not fit q {tuple(q_BTHD.shape)}, v {tuple(v_BTHM.shape)}."
        )
    if _checks.is_concrete(cache.length) and int(cache.length) + T > capacity:
        raise ValueError(
            f"{name}: {T} more steps do not fit the KV cache ({int(cache.length)} of "
            f"{capacity} slots filled); allocate a larger max_length."
        )
    pos = cache.length
    k_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.k_BSHD, k_BTHD.astype(cache.k_BSHD.dtype), pos, axis=1
    )
    v_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.v_BSHM, v_BTHM.astype(cache.v_BSHM.dtype), pos, axis=1
    )
    # Query t sits at slot pos + t and sees slots <= pos + t: the history and its block's past.
    visible_TS = jnp.arange(capacity)[None, :] <= pos + jnp.arange(T)[:, None]
    w_BHTS = softmax_attention_weights(
        q_BTHD.astype(k_cache.dtype), k_cache, mask=visible_TS[None, None], scale=scale
    )
    out_BTHM = jnp.einsum("bhts,bshm->bthm", w_BHTS, v_cache.astype(w_BHTS.dtype))
    # dynamic_update_slice clamps an overflowing start, which would overwrite history.
    out_BTHM = jnp.where(pos + T <= capacity, out_BTHM, jnp.nan).astype(v_BTHM.dtype)
    return KVCache(k_cache, v_cache, pos + T), out_BTHM
