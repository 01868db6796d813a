"""Softmax attention as an RNN: a preallocated KV cache, one step or one block at a time.

Legend: B batch, T time (a block), S cache slots, H heads, D key/query features, M value
features.

The cache remembers which segment each slot belongs to, so a packed prompt (`segment_ids`)
can be prefilled and decoding continues its last segment without seeing the others, as the
linear kinds' state does: a block's first segment continues the cache's current one, each
later segment of the block starts afresh, and padding (id 0) is never attended to (a padding
query sees no key: its output is 0, as in the parallel form).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_transformers.ops import _checks
from linear_transformers.ops.softmax import softmax_attention_weights


class KVCache(NamedTuple):
    """Preallocated keys and values for softmax recurrent inference.

    `length` (int32 scalar) counts the filled slots; shapes never change, so the cache is a valid
    `lax.scan` carry. `segment_BS` (int32) numbers the run each slot belongs to (-1 for
    padding) and `segment_B` the run decoding continues: a query attends only to the slots of
    its own run.
    """

    k_BSHD: jax.Array
    v_BSHM: jax.Array
    length: jax.Array
    segment_BS: jax.Array
    segment_B: jax.Array


def init_kv_cache(batch: int, max_length: int, heads: int, d: int, m: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for up to `max_length` steps of keys [B, S, H, D] and values [B, S, H, M]."""
    if max_length < 1:
        raise ValueError(f"init_kv_cache: max_length must be >= 1, got {max_length}.")
    return KVCache(
        k_BSHD=jnp.zeros((batch, max_length, heads, d), dtype),
        v_BSHM=jnp.zeros((batch, max_length, heads, m), dtype),
        length=jnp.zeros((), jnp.int32),
        segment_BS=jnp.zeros((batch, max_length), jnp.int32),
        segment_B=jnp.zeros((batch,), jnp.int32),
    )


def _check_cache(cache: KVCache, B: int, H: int, D: int, M: int, *, name: str) -> int:
    if not isinstance(cache, KVCache):
        raise ValueError(
            f"{name}: the state must be an ops.KVCache (init_kv_cache), got {type(cache).__name__}."
        )
    capacity = cache.k_BSHD.shape[1]
    if cache.k_BSHD.shape != (B, capacity, H, D) or cache.v_BSHM.shape != (B, capacity, H, M):
        raise ValueError(
            f"{name}: cache shapes k {tuple(cache.k_BSHD.shape)}, v {tuple(cache.v_BSHM.shape)} do "
            f"not fit queries of batch {B}, {H} heads, {D} key features and {M} value features."
        )
    return capacity


def softmax_attention_step(cache: KVCache, q_BHD, k_BHD, v_BHM, *, scale=None):
    """One causal step: append (k_t, v_t) to the cache and attend q_t to every filled slot of the
    current segment.

    Returns (new_cache, out_BHM). Stepping past `max_length` cannot grow a static cache: an eager
    call raises, and under `jit` the output is NaN so the overflow cannot pass unnoticed.
    """
    name = "softmax_attention_step"
    _checks.check_step_qkv(q_BHD, k_BHD, v_BHM, name=name)
    B, H, D = q_BHD.shape
    capacity = _check_cache(cache, B, H, D, v_BHM.shape[-1], name=name)
    if _checks.is_concrete(cache.length) and int(cache.length) >= capacity:
        raise ValueError(f"{name}: the KV cache is full ({capacity} steps); allocate a larger max_length.")
    pos = cache.length
    k_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.k_BSHD, k_BHD[:, None].astype(cache.k_BSHD.dtype), pos, axis=1
    )
    v_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.v_BSHM, v_BHM[:, None].astype(cache.v_BSHM.dtype), pos, axis=1
    )
    segment_BS = jax.lax.dynamic_update_slice_in_dim(cache.segment_BS, cache.segment_B[:, None], pos, axis=1)
    visible_BS = (jnp.arange(capacity)[None] <= pos) & (segment_BS == cache.segment_B[:, None])
    w_BHTS = softmax_attention_weights(
        q_BHD[:, None].astype(k_cache.dtype), k_cache, mask=visible_BS[:, None, None, :], scale=scale
    )
    out_BHM = jnp.einsum("bhs,bshm->bhm", w_BHTS[:, :, 0], v_cache.astype(w_BHTS.dtype))
    out_BHM = jnp.where(pos < capacity, out_BHM, jnp.nan).astype(v_BHM.dtype)
    return KVCache(k_cache, v_cache, pos + 1, segment_BS, cache.segment_B), out_BHM


def _block_segments(cache: KVCache, segment_ids_BT, T: int):
    """The run of each step of a block (-1 at padding) and the run decoding continues after it."""
    B = cache.segment_B.shape[0]
    if segment_ids_BT is None:
        return jnp.broadcast_to(cache.segment_B[:, None], (B, T)), cache.segment_B
    changes_BT = jnp.concatenate(
        [jnp.zeros((B, 1), jnp.int32), (segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]).astype(jnp.int32)],
        axis=1,
    )
    runs_BT = cache.segment_B[:, None] + jnp.cumsum(changes_BT, axis=1)
    present_BT = segment_ids_BT != 0
    last_B = jnp.max(jnp.where(present_BT, runs_BT, -1), axis=1)
    return jnp.where(present_BT, runs_BT, -1), jnp.where(last_B >= 0, last_B, cache.segment_B)


def softmax_attention_prefill(cache: KVCache, q_BTHD, k_BTHD, v_BTHM, *, scale=None, segment_ids=None):
    """A block of T causal steps at once: write (k, v) into the cache after its `length` filled
    slots and attend each query to every slot up to its own, within its segment.

    Equal to T calls of `softmax_attention_step`, in one parallel pass (the prompt of a
    generation). `segment_ids` int [B, T] packs several sequences into the block (0 = padding;
    the module docstring says how they meet the cache). Returns (cache with length + T,
    out_BTHM). Past `max_length`: an eager call raises, and under `jit` the outputs are NaN, as
    for the step.
    """
    name = "softmax_attention_prefill"
    _checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    B, T, H, D = q_BTHD.shape
    if k_BTHD.shape[1] != T:
        raise ValueError(
            f"{name}: queries and keys must have the same length, got T={T} and S={k_BTHD.shape[1]}."
        )
    segment_ids = _checks.check_segment_ids(segment_ids, (B, T), name=name)
    capacity = _check_cache(cache, B, H, D, v_BTHM.shape[-1], name=name)
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
    runs_BT, current_B = _block_segments(cache, segment_ids, T)
    segment_BS = jax.lax.dynamic_update_slice_in_dim(cache.segment_BS, runs_BT, pos, axis=1)
    # Query t sits at slot pos + t and sees slots <= pos + t of its own run: the history and its
    # block's past. A padding query (run -1) sees nothing, so its output is 0.
    visible_BTS = (
        (jnp.arange(capacity)[None, None] <= (pos + jnp.arange(T))[None, :, None])
        & (segment_BS[:, None, :] == runs_BT[:, :, None])
        & (runs_BT >= 0)[:, :, None]
    )
    w_BHTS = softmax_attention_weights(
        q_BTHD.astype(k_cache.dtype), k_cache, mask=visible_BTS[:, None], scale=scale
    )
    out_BTHM = jnp.einsum("bhts,bshm->bthm", w_BHTS, v_cache.astype(w_BHTS.dtype))
    # dynamic_update_slice clamps an overflowing start, which would overwrite history.
    out_BTHM = jnp.where(pos + T <= capacity, out_BTHM, jnp.nan).astype(v_BTHM.dtype)
    return KVCache(k_cache, v_cache, pos + T, segment_BS, current_B), out_BTHM
