"""Softmax attention over blocks of queries, heads next to the batch: the fast form on the CPU.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features;
in one block, Q its queries and K the keys it may see.

Why this form (BENCHMARKS.md section 1): `jax.nn.dot_product_attention(implementation="xla")`
contracts "BTNH,BSNH->BNTS" with the heads between time and features, and XLA:CPU runs that
(and the autodiff of the softmax around it) well below its matmul speed. Here q, k and v move
to [B, H, time, features] once, so every product is a plain batched matmul, and:

- queries go in blocks of Q; under `causal` block i sees only keys s < (i + 1) * Q, so the
  [T, S] work above the diagonal blocks is never done (about half of it at T = 4096);
- the backward is written out (`jax.custom_vjp`): from the saved weights w and output o,
  dv = w^T g, ds = w * (g v^T - rowsum(g * o)), dq = ds k, dk = ds^T q, one pass per block,
  instead of autodiff's chain through max, exp, sum and divide over every [T, S] entry.

Masked entries get weight exactly 0 and a query with no valid key gets output 0 (the library's
rule), with no NaN in either pass. Everything runs in float32 (float64 for float64 inputs).
`softmax.softmax_attention_reference` is the plain formula it is tested against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from linear_transformers.ops import input_checks

# Queries per block: at T = 1024 and 4096 (H = 8, D = 64) 256 ran fastest of 128-1024 on a
# 2-core CPU; longer sequences get longer blocks so that the unrolled loop stays <= 16 blocks.
MIN_BLOCK = 256
MAX_BLOCKS = 16


def default_block_size(num_queries: int) -> int:
    return max(MIN_BLOCK, math.ceil(num_queries / MAX_BLOCKS))


def _blocks(num_queries: int, block: int):
    """Static (start, stop) of each query block; the last may be shorter."""
    return [(r, min(r + block, num_queries)) for r in range(0, num_queries, block)]


def _num_keys(stop: int, num_keys: int, causal: bool) -> int:
    """Keys a block ending at query `stop` may see: the causal ones only."""
    return min(stop, num_keys) if causal else num_keys


def _block_weights(qs_BHQD, k_BHKD, start, *, causal, key_lengths, mask_BHTS):
    """Softmax weights [B, H, Q, K] of one query block; 0 where masked, rows with no valid key
    0 throughout."""
    Q, K = qs_BHQD.shape[2], k_BHKD.shape[2]
    logits_BHQK = jnp.einsum("bhqd,bhkd->bhqk", qs_BHQD, k_BHKD)
    valid = None
    if causal:
        valid = ((start + jnp.arange(Q))[:, None] >= jnp.arange(K)[None, :])[None, None]
    if key_lengths is not None:
        padding_B11K = input_checks.key_padding_mask(key_lengths, K)[:, None, None, :]
        valid = padding_B11K if valid is None else valid & padding_B11K
    if mask_BHTS is not None:
        rows = mask_BHTS if mask_BHTS.shape[2] == 1 else mask_BHTS[:, :, start : start + Q]
        block_mask = rows if rows.shape[3] == 1 else rows[:, :, :, :K]
        valid = block_mask if valid is None else valid & block_mask
    if valid is not None:
        logits_BHQK = jnp.where(valid, logits_BHQK, -jnp.inf)
    max_BHQ1 = jnp.max(logits_BHQK, axis=-1, keepdims=True)
    # A row with no valid key has max -inf: shift by 0 instead, so exp gives 0, not NaN.
    max_BHQ1 = jnp.where(jnp.isneginf(max_BHQ1), jnp.zeros((), max_BHQ1.dtype), max_BHQ1)
    e_BHQK = jnp.exp(logits_BHQK - max_BHQ1)
    sum_BHQ1 = jnp.sum(e_BHQK, axis=-1, keepdims=True)
    return e_BHQK * (1 / jnp.where(sum_BHQ1 > 0, sum_BHQ1, 1))


def _forward(qs_BHTD, k_BHSD, v_BHSM, key_lengths, mask_BHTS, causal, block):
    T, S = qs_BHTD.shape[2], k_BHSD.shape[2]
    w_blocks, out_blocks = [], []
    for start, stop in _blocks(T, block):
        K = _num_keys(stop, S, causal)
        w_BHQK = _block_weights(
            qs_BHTD[:, :, start:stop],
            k_BHSD[:, :, :K],
            start,
            causal=causal,
            key_lengths=key_lengths,
            mask_BHTS=mask_BHTS,
        )
        w_blocks.append(w_BHQK)
        out_blocks.append(jnp.einsum("bhqk,bhkm->bhqm", w_BHQK, v_BHSM[:, :, :K]))
    out_BHTM = jnp.concatenate(out_blocks, axis=2)
    return out_BHTM, (qs_BHTD, k_BHSD, v_BHSM, w_blocks, out_BHTM)


def _backward(causal, block, residuals, g_BHTM):
    qs_BHTD, k_BHSD, v_BHSM, w_blocks, out_BHTM = residuals
    T, S = qs_BHTD.shape[2], k_BHSD.shape[2]
    # rowsum(dw * w) = rowsum(g * o): the softmax's correction term, [T, M] work not [T, S].
    delta_BHT1 = jnp.sum(g_BHTM * out_BHTM, axis=-1, keepdims=True)
    dq_blocks = []
    dk_BHSD = jnp.zeros_like(k_BHSD)
    dv_BHSM = jnp.zeros_like(v_BHSM)
    for (start, stop), w_BHQK in zip(_blocks(T, block), w_blocks):
        K = _num_keys(stop, S, causal)
        g_BHQM = g_BHTM[:, :, start:stop]
        dv_BHSM = dv_BHSM.at[:, :, :K].add(jnp.einsum("bhqk,bhqm->bhkm", w_BHQK, g_BHQM))
        dw_BHQK = jnp.einsum("bhqm,bhkm->bhqk", g_BHQM, v_BHSM[:, :, :K])
        ds_BHQK = w_BHQK * (dw_BHQK - delta_BHT1[:, :, start:stop])
        dq_blocks.append(jnp.einsum("bhqk,bhkd->bhqd", ds_BHQK, k_BHSD[:, :, :K]))
        dk_BHSD = dk_BHSD.at[:, :, :K].add(jnp.einsum("bhqk,bhqd->bhkd", ds_BHQK, qs_BHTD[:, :, start:stop]))
    # Integer lengths and boolean masks have no cotangent.
    return jnp.concatenate(dq_blocks, axis=2), dk_BHSD, dv_BHSM, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attend(qs_BHTD, k_BHSD, v_BHSM, key_lengths, mask_BHTS, causal, block):
    return _forward(qs_BHTD, k_BHSD, v_BHSM, key_lengths, mask_BHTS, causal, block)[0]


_attend.defvjp(_forward, _backward)


def blocked_softmax_attention(
    q_BTHD, k_BSHD, v_BSHM, *, causal=False, key_lengths=None, mask=None, scale=None, block_size=None
):
    """softmax(q k^T * scale) v, [B, T, H, M] in the dtype of v.

    Same contract as `softmax.softmax_attention_reference` for checked inputs: key_lengths int
    [B]; mask boolean [B|1, H|1, T|1, S|1] (`input_checks.check_mask`), True = attend; causal needs
    T == S. block_size: queries per block (default `default_block_size(T)`).
    """
    B, T, H, D = q_BTHD.shape
    S = k_BSHD.shape[1]
    if T == 0 or S == 0:  # no query, or no key to see: the output is 0
        return jnp.zeros((B, T, H, v_BSHM.shape[-1]), v_BSHM.dtype)
    acc = input_checks.accumulation_dtype(jnp.result_type(q_BTHD, k_BSHD, v_BSHM))
    scale = D**-0.5 if scale is None else scale
    # Scaling the [T, D] queries, not the [T, S] logits; outside `_attend`, so a traced scale
    # gets its gradient from autodiff.
    qs_BHTD = jnp.swapaxes(q_BTHD.astype(acc) * jnp.asarray(scale, acc), 1, 2)
    k_BHSD = jnp.swapaxes(k_BSHD.astype(acc), 1, 2)
    v_BHSM = jnp.swapaxes(v_BSHM.astype(acc), 1, 2)
    if key_lengths is not None:
        key_lengths = jnp.asarray(key_lengths, jnp.int32)
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        if mask.ndim == 2:
            mask = mask[None, None]
    block = default_block_size(T) if block_size is None else block_size
    out_BHTM = _attend(qs_BHTD, k_BHSD, v_BHSM, key_lengths, mask, causal, block)
    return jnp.swapaxes(out_BHTM, 1, 2).astype(v_BSHM.dtype)
