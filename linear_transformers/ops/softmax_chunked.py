"""Softmax attention a chunk of queries at a time: bounded memory at any length, on any platform.

Legend: B batch, T query time, S key time, H heads, D key/query features, M value features;
C queries per chunk, N chunks (T padded to N * C).

The dense forms hold the [B, H, T, S] logits at once, and their backward the probabilities and
their gradients too: at B = H = 8 and T = S = 16384 the float32 logits alone are 68 GB, which
XLA's dense form on a GPU cannot place (BENCHMARKS.md, the GPU section). Here one `lax.scan`
runs the N chunks of C queries, each computing its [B, H, C, S] logits, softmax and output;
the backward (`jax.custom_vjp`) recomputes a chunk's weights from its saved log-sum-exp rather
than storing them (FlashAttention's residuals, chunked over queries only):

  forward+backward memory = q, k, v, out, one [B, H, T] log-sum-exp, one chunk's [B, H, C, S]

with C chosen so that a chunk's float32 logits take at most CHUNK_LOGITS_BYTES. Which keys a
query sees is built a chunk at a time from `causal`, `key_lengths`, the rows of an explicit
mask and the queries' and keys' segment ids, so packed sequences never form a [T, S] mask.
A causal chunk still computes its whole row of keys (a scan's chunks share one shape): twice
the work of a form that skips the upper triangle, the price of one compiled chunk.

Masked entries get weight exactly 0 and a query with no valid key gets output 0 (the library's
rule), with finite gradients. Everything runs in float32 (float64 for float64 inputs); products
follow `jax.default_matmul_precision` (ops/precision.py). `softmax.softmax_attention_reference`
is the plain formula it is tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import input_checks

# A chunk's float32 logits at most this many bytes (and at least MIN_CHUNK queries).
CHUNK_LOGITS_BYTES = 2**28
MIN_CHUNK = 16


def default_chunk_size(batch: int, heads: int, num_queries: int, num_keys: int) -> int:
    """Queries per chunk: as many as keep a chunk's float32 logits within CHUNK_LOGITS_BYTES, a
    multiple of MIN_CHUNK (at least MIN_CHUNK), and no more than the queries."""
    row_bytes = max(1, batch * heads * num_keys * 4)
    rows = max(MIN_CHUNK, CHUNK_LOGITS_BYTES // row_bytes // MIN_CHUNK * MIN_CHUNK)
    return max(1, min(num_queries, rows))


def _rows(x, start, C: int, axis: int):
    """C rows of `x` from `start` along `axis`, or `x` itself where that axis broadcasts."""
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, C, axis=axis)


def _valid_BHCS(start, C: int, S: int, *, causal, key_lengths, mask, query_ids, key_ids):
    """bool [B|1, H|1, C, S]: which keys each query of the chunk from `start` sees (None: all)."""
    valid = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        valid = ((start + jnp.arange(C))[:, None] >= jnp.arange(S)[None, :])[None, None]
    if key_lengths is not None:
        valid = both(valid, input_checks.key_padding_mask(key_lengths, S)[:, None, None, :])
    if mask is not None:
        valid = both(valid, _rows(mask, start, C, axis=2))
    if query_ids is not None:
        ids_BC = _rows(query_ids, start, C, axis=1)
        same_BCS = (ids_BC[:, :, None] == key_ids[:, None, :]) & (key_ids != 0)[:, None, :]
        valid = both(valid, same_BCS[:, None])
    return valid


def _chunk_logits(qs_BHCD, k_BHSD, valid):
    logits_BHCS = jnp.einsum("bhcd,bhsd->bhcs", qs_BHCD, k_BHSD)
    return logits_BHCS if valid is None else jnp.where(valid, logits_BHCS, -jnp.inf)


def _forward(qs_BHTD, k_BHSD, v_BHSM, masks, causal, C):
    B, H, T, _ = qs_BHTD.shape
    S = k_BHSD.shape[2]

    def chunk(_, start):
        qs_BHCD = jax.lax.dynamic_slice_in_dim(qs_BHTD, start, C, axis=2)
        logits_BHCS = _chunk_logits(qs_BHCD, k_BHSD, _valid_BHCS(start, C, S, causal=causal, **masks))
        max_BHC1 = jnp.max(logits_BHCS, axis=-1, keepdims=True)
        # A row with no valid key has max -inf: shift by 0 instead, so exp gives 0, not NaN.
        max_BHC1 = jnp.where(jnp.isneginf(max_BHC1), jnp.zeros((), max_BHC1.dtype), max_BHC1)
        e_BHCS = jnp.exp(logits_BHCS - max_BHC1)
        sum_BHC1 = jnp.sum(e_BHCS, axis=-1, keepdims=True)
        has_key_BHC1 = sum_BHC1 > 0
        w_BHCS = e_BHCS * (1 / jnp.where(has_key_BHC1, sum_BHC1, 1))
        out_BHCM = jnp.einsum("bhcs,bhsm->bhcm", w_BHCS, v_BHSM)
        # Rows with no valid key keep 0: their recomputed weights are 0 through `valid` alone.
        lse_BHC = jnp.where(has_key_BHC1, max_BHC1 + jnp.log(jnp.where(has_key_BHC1, sum_BHC1, 1)), 0)[..., 0]
        return None, (out_BHCM, lse_BHC)

    _, (out_NBHCM, lse_NBHC) = jax.lax.scan(chunk, None, jnp.arange(0, T, C))
    out_BHTM = jnp.moveaxis(out_NBHCM, 0, 2).reshape(B, H, T, v_BHSM.shape[-1])
    return out_BHTM, jnp.moveaxis(lse_NBHC, 0, 2).reshape(B, H, T)


def _attend_fwd(qs_BHTD, k_BHSD, v_BHSM, masks, causal, C):
    out_BHTM, lse_BHT = _forward(qs_BHTD, k_BHSD, v_BHSM, masks, causal, C)
    return out_BHTM, (qs_BHTD, k_BHSD, v_BHSM, masks, out_BHTM, lse_BHT)


def _attend_bwd(causal, C, residuals, g_BHTM):
    qs_BHTD, k_BHSD, v_BHSM, masks, out_BHTM, lse_BHT = residuals
    S = k_BHSD.shape[2]
    # rowsum(dw * w) = rowsum(g * o): the softmax's correction term, [T, M] work not [T, S].
    delta_BHT = jnp.sum(g_BHTM * out_BHTM, axis=-1)

    def chunk(carry, start):
        dk_BHSD, dv_BHSM = carry
        qs_BHCD = jax.lax.dynamic_slice_in_dim(qs_BHTD, start, C, axis=2)
        g_BHCM = jax.lax.dynamic_slice_in_dim(g_BHTM, start, C, axis=2)
        lse_BHC = jax.lax.dynamic_slice_in_dim(lse_BHT, start, C, axis=2)
        delta_BHC = jax.lax.dynamic_slice_in_dim(delta_BHT, start, C, axis=2)
        valid = _valid_BHCS(start, C, S, causal=causal, **masks)
        logits_BHCS = _chunk_logits(qs_BHCD, k_BHSD, valid)
        w_BHCS = jnp.exp(logits_BHCS - lse_BHC[..., None])
        if valid is not None:
            w_BHCS = jnp.where(valid, w_BHCS, 0)
        dv_BHSM = dv_BHSM + jnp.einsum("bhcs,bhcm->bhsm", w_BHCS, g_BHCM)
        dw_BHCS = jnp.einsum("bhcm,bhsm->bhcs", g_BHCM, v_BHSM)
        ds_BHCS = w_BHCS * (dw_BHCS - delta_BHC[..., None])
        dk_BHSD = dk_BHSD + jnp.einsum("bhcs,bhcd->bhsd", ds_BHCS, qs_BHCD)
        return (dk_BHSD, dv_BHSM), jnp.einsum("bhcs,bhsd->bhcd", ds_BHCS, k_BHSD)

    T = qs_BHTD.shape[2]
    start = (jnp.zeros_like(k_BHSD), jnp.zeros_like(v_BHSM))
    (dk_BHSD, dv_BHSM), dq_NBHCD = jax.lax.scan(chunk, start, jnp.arange(0, T, C))
    dq_BHTD = jnp.moveaxis(dq_NBHCD, 0, 2).reshape(qs_BHTD.shape)
    # Integer lengths and ids and boolean masks have no cotangent.
    return dq_BHTD, dk_BHSD, dv_BHSM, jax.tree.map(lambda _: None, masks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(qs_BHTD, k_BHSD, v_BHSM, masks, causal, C):
    return _forward(qs_BHTD, k_BHSD, v_BHSM, masks, causal, C)[0]


_attend.defvjp(_attend_fwd, _attend_bwd)


def _padded(x, pad: int, axis: int):
    """`x` with `pad` zeros (False, id 0) after its last row along `axis`; None stays None, and
    an axis of size 1 (broadcast) stays as it is."""
    if x is None or not pad or x.shape[axis] == 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _layout(q_BTHD, k_BSHD, v_BSHM, scale, chunk_size, key_lengths, mask, segment_ids, key_segment_ids):
    """Heads next to the batch, q scaled and padded to whole chunks; the masks likewise."""
    B, T, H, D = q_BTHD.shape
    S = k_BSHD.shape[1]
    acc = input_checks.accumulation_dtype(jnp.result_type(q_BTHD, k_BSHD, v_BSHM))
    C = default_chunk_size(B, H, T, S) if chunk_size is None else min(chunk_size, T)
    pad = -T % C
    # Scaling the [T, D] queries, not the [T, S] logits; outside `_attend`, so a traced scale
    # gets its gradient from autodiff.
    scale = D**-0.5 if scale is None else scale
    qs_BHTD = _padded(jnp.swapaxes(q_BTHD.astype(acc) * jnp.asarray(scale, acc), 1, 2), pad, axis=2)
    k_BHSD = jnp.swapaxes(k_BSHD.astype(acc), 1, 2)
    v_BHSM = jnp.swapaxes(v_BSHM.astype(acc), 1, 2)
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        mask = mask[None, None] if mask.ndim == 2 else mask
    masks = {
        "key_lengths": None if key_lengths is None else jnp.asarray(key_lengths, jnp.int32),
        "mask": _padded(mask, pad, axis=2),
        "query_ids": None
        if segment_ids is None
        else _padded(jnp.asarray(segment_ids, jnp.int32), pad, axis=1),
        "key_ids": None if key_segment_ids is None else jnp.asarray(key_segment_ids, jnp.int32),
    }
    return qs_BHTD, k_BHSD, v_BHSM, masks, C


def chunked_softmax_attention(
    q_BTHD,
    k_BSHD,
    v_BSHM,
    *,
    causal=False,
    key_lengths=None,
    mask=None,
    scale=None,
    segment_ids=None,
    key_segment_ids=None,
    chunk_size=None,
):
    """softmax(q k^T * scale) v, [B, T, H, M] in the dtype of v, a chunk of queries at a time.

    Same contract as `softmax.softmax_attention_reference` for checked inputs: key_lengths int
    [B]; mask boolean [B|1, H|1, T|1, S|1] (`input_checks.check_mask`), True = attend; causal needs
    T == S; segment_ids int [B, T] and key_segment_ids int [B, S] (both or neither): a query sees
    the keys of its own segment, never id 0. chunk_size: queries per chunk (default
    `default_chunk_size`).
    """
    B, T, H, _ = q_BTHD.shape
    S = k_BSHD.shape[1]
    if T == 0 or S == 0:  # no query, or no key to see: the output is 0
        return jnp.zeros((B, T, H, v_BSHM.shape[-1]), v_BSHM.dtype)
    qs_BHTD, k_BHSD, v_BHSM, masks, C = _layout(
        q_BTHD, k_BSHD, v_BSHM, scale, chunk_size, key_lengths, mask, segment_ids, key_segment_ids
    )
    out_BHTM = _attend(qs_BHTD, k_BHSD, v_BHSM, masks, causal, C)
    return jnp.swapaxes(out_BHTM[:, :, :T], 1, 2).astype(v_BSHM.dtype)


def seen_nonfinite_BTHM(
    v_BSHM, *, num_queries, causal=False, key_lengths=None, mask=None, segment_ids=None, key_segment_ids=None
):
    """bool [B, T, H, M]: query t sees a non-finite v[s, m] (`_nonfinite.seen_nonfinite_BTHM`
    for the masks this form takes), a chunk of queries at a time: no [T, S] array is formed."""
    B, S, H, M = v_BSHM.shape
    bad_BHSM = jnp.swapaxes(~jnp.isfinite(v_BSHM), 1, 2).astype(jnp.float32)
    C = default_chunk_size(B, H, num_queries, S)
    pad = -num_queries % C
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        mask = _padded(mask[None, None] if mask.ndim == 2 else mask, pad, axis=2)
    masks = {
        "key_lengths": key_lengths,
        "mask": mask,
        "query_ids": _padded(segment_ids, pad, axis=1),
        "key_ids": key_segment_ids,
    }

    def chunk(_, start):
        valid = _valid_BHCS(start, C, S, causal=causal, **masks)
        seen_BHCS = jnp.ones((1, 1, C, S), jnp.float32) if valid is None else valid.astype(jnp.float32)
        seen_BHCM = jnp.einsum("bhcs,bhsm->bhcm", jnp.broadcast_to(seen_BHCS, (B, H, C, S)), bad_BHSM) > 0
        return None, seen_BHCM

    _, seen_NBHCM = jax.lax.scan(chunk, None, jnp.arange(0, num_queries + pad, C))
    seen_BHTM = jnp.moveaxis(seen_NBHCM, 0, 2).reshape(B, H, num_queries + pad, M)
    return jnp.swapaxes(seen_BHTM[:, :, :num_queries], 1, 2)
