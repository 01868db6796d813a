"""Softmax attention as an RNN: a preallocated KV cache, one step or one block at a time.

Legend: B batch, T time (a block of queries), S cache slots, C slots of a cache block, H heads,
D key/query features, M value features.

The cache remembers which segment each slot belongs to, so a packed prompt (`segment_ids`)
can be prefilled and decoding continues its last segment without seeing the others, as the
linear kinds' state does: a block's first segment continues the cache's current one, each
later segment of the block starts afresh, and padding (id 0) is never attended to (a padding
query sees no key: its output is 0, as in the parallel form).

The cache is preallocated, but a step reads only the blocks of `block_size` slots that hold
filled ones, combined by an online softmax (running max and sum, float32 accumulator: flash
decoding), so step t costs O(t), not O(max_length). The blocks are a `lax.scan` with a
`lax.cond` that skips the empty ones: shapes stay static (a whole generation is one compiled
scan) and the op stays differentiable. `softmax_attention_step_reference` and
`softmax_attention_prefill_reference` attend densely over every slot: the plain definition the
tests compare with.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_transformers.ops import input_checks, precision
from linear_transformers.ops.softmax import softmax_attention_weights

# Slots read per block. One layer's step over a 784-step MNIST image (8 heads x 32) on a 2-core
# CPU, batch 1 and 16, ran about as fast with 48 to 64 as with 32, and slower from 96 on: XLA's CPU
# dot of a larger block costs more per slot (112 and 128 were no faster than reading every slot).
DEFAULT_BLOCK_SIZE = 64


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


def _attend_dense(q_BTHD, k_BSHD, v_BSHM, segment_BS, runs_BT, pos, *, scale):
    """Query t (at slot pos + t, of run runs_BT[:, t]) attends to every slot <= its own of its
    run, with a mask over all S slots: the plain definition. Returns [B, T, H, M] in the
    accumulation dtype."""
    S, T = k_BSHD.shape[1], q_BTHD.shape[1]
    # A padding query (run -1) sees nothing, so its output is 0.
    visible_BTS = (
        (jnp.arange(S)[None, None] <= (pos + jnp.arange(T))[None, :, None])
        & (segment_BS[:, None, :] == runs_BT[:, :, None])
        & (runs_BT >= 0)[:, :, None]
    )
    w_BHTS = softmax_attention_weights(
        q_BTHD.astype(k_BSHD.dtype), k_BSHD, mask=visible_BTS[:, None], scale=scale
    )
    return jnp.einsum("bhts,bshm->bthm", w_BHTS, v_BSHM.astype(w_BHTS.dtype))


def _attend_blocks(q_BTHD, k_BSHD, v_BSHM, segment_BS, runs_BT, pos, *, scale, block_size):
    """`_attend_dense` reading only the blocks of `block_size` slots up to the last query's
    slot, pos + T - 1, combined by an online softmax in the accumulation dtype."""
    B, T, H, D = q_BTHD.shape
    S, M = k_BSHD.shape[1], v_BSHM.shape[-1]
    C = min(block_size, S)
    acc = input_checks.accumulation_dtype(k_BSHD.dtype)
    scale = jnp.asarray(D**-0.5 if scale is None else scale, acc)
    q_BTHD = q_BTHD.astype(k_BSHD.dtype)
    slot_T = pos + jnp.arange(T)

    def attend_block(carry, start):
        max_BHT, sum_BHT, out_BHTM = carry
        # The last block of a capacity that is not a multiple of C is moved back to end at S;
        # the slots it shares with the block before (< start) are masked, not counted twice.
        first = jnp.minimum(start, S - C)
        k_BCHD = jax.lax.dynamic_slice_in_dim(k_BSHD, first, C, axis=1)
        v_BCHM = jax.lax.dynamic_slice_in_dim(v_BSHM, first, C, axis=1)
        segment_BC = jax.lax.dynamic_slice_in_dim(segment_BS, first, C, axis=1)
        slot_C = first + jnp.arange(C)
        visible_B1TC = (
            (slot_C >= start)[None, None]
            & (slot_C[None, None] <= slot_T[None, :, None])
            & (segment_BC[:, None, :] == runs_BT[:, :, None])
            & (runs_BT >= 0)[:, :, None]
        )[:, None]
        logits_BHTC = precision.einsum_in(acc, "bthd,bchd->bhtc", q_BTHD, k_BCHD) * scale
        logits_BHTC = jnp.where(visible_B1TC, logits_BHTC, -jnp.inf)
        # The running max only keeps exp in range: the result does not depend on it, so it
        # carries no gradient. Until a query has seen a key it is -inf; 0 then stands in so
        # that exp(-inf - 0) = 0 (exp(-inf - -inf) would be NaN).
        new_max_BHT = jax.lax.stop_gradient(jnp.maximum(max_BHT, jnp.max(logits_BHTC, axis=-1)))
        shift_BHT = jnp.where(new_max_BHT == -jnp.inf, jnp.zeros((), acc), new_max_BHT)
        p_BHTC = jnp.exp(logits_BHTC - shift_BHT[..., None])
        rescale_BHT = jnp.exp(max_BHT - shift_BHT)
        sum_BHT = sum_BHT * rescale_BHT + jnp.sum(p_BHTC, axis=-1)
        out_BHTM = out_BHTM * rescale_BHT[..., None] + jnp.einsum(
            "bhtc,bchm->bhtm", p_BHTC, v_BCHM.astype(acc)
        )
        return new_max_BHT, sum_BHT, out_BHTM

    def visit(carry, start):
        # Blocks past the last query's slot hold nothing it may see: skipped, not masked.
        return jax.lax.cond(start <= slot_T[-1], attend_block, lambda c, _: c, carry, start), None

    init = (
        jnp.full((B, H, T), -jnp.inf, acc),
        jnp.zeros((B, H, T), acc),
        jnp.zeros((B, H, T, M), acc),
    )
    starts = jnp.arange(0, S, C, dtype=jnp.int32)
    (_, sum_BHT, out_BHTM), _ = jax.lax.scan(visit, init, starts)
    # A query that saw no key (padding) has sum 0: its output is 0, with finite gradients.
    seen_BHT = sum_BHT > 0
    out_BHTM = jnp.where(seen_BHT[..., None], out_BHTM / jnp.where(seen_BHT, sum_BHT, 1)[..., None], 0)
    return jnp.swapaxes(out_BHTM, 1, 2)


def _blocked(block_size, *, name: str):
    block_size = input_checks.check_int(block_size, f"{name}: block_size")
    return functools.partial(_attend_blocks, block_size=block_size)


def softmax_attention_step(cache: KVCache, q_BHD, k_BHD, v_BHM, *, scale=None, block_size=DEFAULT_BLOCK_SIZE):
    """One causal step: append (k_t, v_t) to the cache and attend q_t to every filled slot of the
    current segment.

    Reads the cache in blocks of `block_size` slots (int >= 1) up to the filled ones only.
    Returns (new_cache, out_BHM). Stepping past `max_length` cannot grow a static cache: an eager
    call raises, and under `jit` the output is NaN so the overflow cannot pass unnoticed.
    """
    name = "softmax_attention_step"
    return _step(cache, q_BHD, k_BHD, v_BHM, scale=scale, attend=_blocked(block_size, name=name), name=name)


def softmax_attention_step_reference(cache: KVCache, q_BHD, k_BHD, v_BHM, *, scale=None):
    """`softmax_attention_step` attending over every slot of the cache, unfilled ones masked:
    the plain definition, O(max_length) per step."""
    name = "softmax_attention_step_reference"
    return _step(cache, q_BHD, k_BHD, v_BHM, scale=scale, attend=_attend_dense, name=name)


def _step(cache: KVCache, q_BHD, k_BHD, v_BHM, *, scale, attend, name: str):
    input_checks.check_step_qkv(q_BHD, k_BHD, v_BHM, name=name)
    B, H, D = q_BHD.shape
    capacity = _check_cache(cache, B, H, D, v_BHM.shape[-1], name=name)
    if input_checks.is_concrete(cache.length) and int(cache.length) >= capacity:
        raise ValueError(f"{name}: the KV cache is full ({capacity} steps); allocate a larger max_length.")
    pos = cache.length
    k_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.k_BSHD, k_BHD[:, None].astype(cache.k_BSHD.dtype), pos, axis=1
    )
    v_cache = jax.lax.dynamic_update_slice_in_dim(
        cache.v_BSHM, v_BHM[:, None].astype(cache.v_BSHM.dtype), pos, axis=1
    )
    segment_BS = jax.lax.dynamic_update_slice_in_dim(cache.segment_BS, cache.segment_B[:, None], pos, axis=1)
    out_B1HM = attend(
        q_BHD[:, None], k_cache, v_cache, segment_BS, cache.segment_B[:, None], pos, scale=scale
    )
    out_BHM = jnp.where(pos < capacity, out_B1HM[:, 0], jnp.nan).astype(v_BHM.dtype)
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


def softmax_attention_prefill(
    cache: KVCache,
    q_BTHD,
    k_BTHD,
    v_BTHM,
    *,
    scale=None,
    segment_ids=None,
    block_size=DEFAULT_BLOCK_SIZE,
):
    """A block of T causal steps at once: write (k, v) into the cache after its `length` filled
    slots and attend each query to every slot up to its own, within its segment.

    Equal to T calls of `softmax_attention_step`, in one parallel pass (the prompt of a
    generation). `segment_ids` int [B, T] packs several sequences into the block (0 = padding;
    the module docstring says how they meet the cache). The cache is read in blocks of
    `block_size` slots up to the last query's. Returns (cache with length + T, out_BTHM). Past
    `max_length`: an eager call raises, and under `jit` the outputs are NaN, as for the step.
    """
    name = "softmax_attention_prefill"
    attend = _blocked(block_size, name=name)
    return _prefill(
        cache, q_BTHD, k_BTHD, v_BTHM, scale=scale, segment_ids=segment_ids, attend=attend, name=name
    )


def softmax_attention_prefill_reference(
    cache: KVCache, q_BTHD, k_BTHD, v_BTHM, *, scale=None, segment_ids=None
):
    """`softmax_attention_prefill` attending over every slot of the cache with one [T, S] mask:
    the plain definition."""
    name = "softmax_attention_prefill_reference"
    return _prefill(
        cache, q_BTHD, k_BTHD, v_BTHM, scale=scale, segment_ids=segment_ids, attend=_attend_dense, name=name
    )


def _prefill(cache: KVCache, q_BTHD, k_BTHD, v_BTHM, *, scale, segment_ids, attend, name: str):
    input_checks.check_qkv(q_BTHD, k_BTHD, v_BTHM, name=name)
    B, T, H, D = q_BTHD.shape
    if k_BTHD.shape[1] != T:
        raise ValueError(
            f"{name}: queries and keys must have the same length, got T={T} and S={k_BTHD.shape[1]}."
        )
    segment_ids = input_checks.check_segment_ids(segment_ids, (B, T), name=name)
    capacity = _check_cache(cache, B, H, D, v_BTHM.shape[-1], name=name)
    if input_checks.is_concrete(cache.length) and int(cache.length) + T > capacity:
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
    # block's past.
    out_BTHM = attend(q_BTHD, k_cache, v_cache, segment_BS, runs_BT, pos, scale=scale)
    # dynamic_update_slice clamps an overflowing start, which would overwrite history.
    out_BTHM = jnp.where(pos + T <= capacity, out_BTHM, jnp.nan).astype(v_BTHM.dtype)
    return KVCache(k_cache, v_cache, pos + T, segment_BS, current_B), out_BTHM
