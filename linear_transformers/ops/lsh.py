"""Reformer's LSH attention (Kitaev et al., 2020), the paper's baseline: shared query/key,
angular hashing into buckets, sort, chunk, attend within a chunk and one chunk back, R rounds.

Legend: B batch, T query time, S key time (the same positions: self-attention, shared QK), H
heads, D query/key features, M value features, R hashing rounds, U buckets, N chunks, C chunk
length, W window (the previous chunk and the own chunk, 2C); `_` any trailing shape.

What one query sees. Each round r hashes every position, sorts positions by (bucket, position)
and cuts the sorted order into chunks of C; query i may attend key j when j's chunk in that
order is i's chunk or the one before it. Over R rounds, i attends to the *union* of its windows:
a key inside several windows is counted once (its logit is lowered by log of the number of
windows holding it), so the result is exactly a softmax over that union. That definition is
what `lsh_attention_reference` computes densely. Keys are the unit-normalised queries (shared
QK); a token attends to itself only when nothing else is in reach (its logit is replaced by
`SELF_LOGIT`), as in the Reformer. Causal and key-padding masks restrict the union further; a
query left with no valid key (padding, or key_lengths 0) gets 0, as in every kind.

Causal LSH attends only to keys j <= i, but which of them share i's window depends on every
position's hash, later ones included (they take places in the sorted order). That is the
Reformer's definition, and the reason it has no recurrent form. Changing later positions moves
earlier outputs by O(1) (tests/attention/test_lsh_attention.py measures it), so a causal LSH model's
teacher-forced predictions are not what greedy decoding gives. Marking the later positions as
padding (`key_lengths`) takes them out of the sorted order (padding has a bucket of its own),
so the outputs up to a length equal those of the sequence cut there: decoding exactly means
re-running the model on each prefix that way.

Logits, softmaxes and the round weights are float32 (or wider) whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linear_transformers.ops import input_checks, precision

SELF_LOGIT = -1e5  # attend to oneself only when no other key is in reach
MASKED_LOGIT = -1e9


def lsh_rotations(key, num_rounds: int, head_dim: int, num_buckets: int):
    """Random rotations [R, D, U/2] for angular LSH; one bucket needs none ([R, D, 0])."""
    check_lsh_options(num_rounds=num_rounds, num_buckets=num_buckets, chunk_size=1)
    return jax.random.normal(key, (num_rounds, head_dim, num_buckets // 2), jnp.float32)


def check_lsh_options(*, num_rounds: int, num_buckets: int, chunk_size: int) -> tuple[int, int, int]:
    """(num_rounds, num_buckets, chunk_size) as Python ints, or a ValueError naming the first
    unusable one (numpy integers are ints; bools and floats are refused)."""
    num_rounds = input_checks.check_int(num_rounds, "LSH attention: num_rounds")
    is_int = isinstance(num_buckets, (int, np.integer)) and not isinstance(num_buckets, (bool, np.bool_))
    if not is_int or not (num_buckets == 1 or (num_buckets >= 2 and num_buckets % 2 == 0)):
        raise ValueError(
            f"LSH attention: num_buckets must be 1 or an even integer >= 2 (angular "
            f"hashing picks argmax over [xR, -xR]), got {num_buckets!r}"
            + ("" if is_int else f" ({type(num_buckets).__name__})")
            + "."
        )
    chunk_size = input_checks.check_int(chunk_size, "LSH attention: chunk_size")
    return num_rounds, int(num_buckets), chunk_size


def lsh_hashes(x_BTHD, rotations_RDU):
    """Bucket of every position in every round, int32 [R, B, H, T]: argmax over [xR, -xR]."""
    R, D, half = rotations_RDU.shape
    B, T, H, _ = x_BTHD.shape
    if half == 0:
        return jnp.zeros((R, B, H, T), jnp.int32)
    # In float32 on every platform: a bucket is a discrete choice that TF32 rounding can flip.
    proj_RBHTU = jnp.einsum(
        "bthd,rdu->rbhtu", x_BTHD, rotations_RDU.astype(x_BTHD.dtype), precision=precision.EXACT
    )
    return jnp.argmax(jnp.concatenate([proj_RBHTU, -proj_RBHTU], -1), -1).astype(jnp.int32)


def _unit_keys(q_BTHD, acc):
    q = q_BTHD.astype(acc)
    return q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + jnp.finfo(acc).tiny)


def _prepare(q_BTHD, v_BTHM, rotations_RDU, chunk_size, key_lengths, name):
    """Shared by the fast path and the reference: checks, padding to whole chunks, hashing and
    the sorted order. Returns the padded arrays and, per round, order and rank [R, B, H, Tp]
    (Tp: T padded to whole chunks)."""
    input_checks.check_qkv(q_BTHD, q_BTHD, v_BTHM, name=name)
    B, T, H, D = q_BTHD.shape
    if rotations_RDU.ndim != 3 or rotations_RDU.shape[1] != D:
        raise ValueError(
            f"{name}: rotations must be [rounds, {D}, buckets/2], got shape {tuple(rotations_RDU.shape)}."
        )
    if T == 0:
        raise ValueError(
            f"{name}: needs at least one position to hash, got an empty sequence "
            f"(shape {tuple(q_BTHD.shape)})."
        )
    key_lengths = input_checks.check_key_lengths(key_lengths, B, name=name, length=T)
    num_buckets = max(1, 2 * rotations_RDU.shape[2])
    check_lsh_options(num_rounds=rotations_RDU.shape[0], num_buckets=num_buckets, chunk_size=chunk_size)
    acc = input_checks.accumulation_dtype(q_BTHD.dtype)
    Tp = -(-T // chunk_size) * chunk_size
    pad = [(0, 0), (0, Tp - T), (0, 0), (0, 0)]
    q_BTHD, v_BTHM = jnp.pad(q_BTHD, pad), jnp.pad(v_BTHM, pad)
    k_BTHD = _unit_keys(q_BTHD, acc)
    pos_T = jnp.arange(Tp)
    lengths_B = jnp.full((B,), T, jnp.int32) if key_lengths is None else jnp.minimum(key_lengths, T)
    # Padding (past key_lengths, or added to fill the last chunk) goes to an extra bucket: it
    # sorts last, so it never takes a real token's place in a chunk and its content cannot
    # change which real keys a query sees.
    real_B11T = (pos_T[None, :] < lengths_B[:, None])[:, None, :]
    bucket_RBHT = jnp.where(real_B11T, lsh_hashes(k_BTHD, rotations_RDU), num_buckets)
    order_RBHT = jnp.argsort(bucket_RBHT * Tp + pos_T, axis=-1)
    rank_RBHT = jnp.argsort(order_RBHT, axis=-1)
    return q_BTHD, k_BTHD, v_BTHM, order_RBHT, rank_RBHT, lengths_B, acc


def lsh_attention(
    q_BTHD, v_BTHM, rotations_RDU, *, chunk_size: int, causal: bool = False, key_lengths=None, scale=None
):
    """LSH self-attention with shared query/key: O(T log T + T C R) time, O(T C R) memory.

    Args:
      q_BTHD: queries [B, T, H, D]; the keys are these queries normalised to unit length.
      v_BTHM: values [B, T, H, M].
      rotations_RDU: from `lsh_rotations` (R rounds, U buckets).
      chunk_size: C; T need not be a multiple (the last chunk is padded).
      causal: query i sees keys j <= i only.
      key_lengths: int [B] in [0, T]; keys at index >= key_lengths[b] are ignored (out of
        range: a ValueError eagerly, clamped under jit).
      scale: multiplies the logits; default 1/sqrt(D).

    Returns [B, T, H, M] in the dtype of v.
    """
    B, T, H, D = q_BTHD.shape
    M = v_BTHM.shape[-1]
    q_BTHD, k_BTHD, v_BTHM, order_RBHT, rank_RBHT, lengths_B, acc = _prepare(
        q_BTHD, v_BTHM, rotations_RDU, chunk_size, key_lengths, "lsh_attention"
    )
    R, C, Tp = rotations_RDU.shape[0], chunk_size, q_BTHD.shape[1]
    N = Tp // C
    scale = D**-0.5 if scale is None else scale

    def sort(x_BTH_):  # -> [R, B, H, N, C, ...] in each round's sorted order
        x_RBHT_ = jnp.broadcast_to(jnp.swapaxes(x_BTH_, 1, 2)[None], (R, B, H, Tp, x_BTH_.shape[-1]))
        x_RBHT_ = jnp.take_along_axis(x_RBHT_, order_RBHT[..., None], axis=3)
        return x_RBHT_.reshape(R, B, H, N, C, -1)

    def window(x_RBHNC_):  # own chunk preceded by the previous one -> [R, B, H, N, W, ...]
        if N == 1:
            return x_RBHNC_
        return jnp.concatenate([jnp.roll(x_RBHNC_, 1, axis=3), x_RBHNC_], axis=4)

    q_RBHNCD = sort(q_BTHD.astype(acc))
    k_RBHNWD = window(sort(k_BTHD))
    v_RBHNWM = window(sort(v_BTHM))
    posq_RBHNC = order_RBHT.reshape(R, B, H, N, C)
    posk_RBHNW = window(posq_RBHNC)

    logits = jnp.einsum("rbhncd,rbhnwd->rbhncw", q_RBHNCD, k_RBHNWD) * jnp.asarray(scale, acc)
    pq, pk = posq_RBHNC[..., :, None], posk_RBHNW[..., None, :]
    allowed = pk < lengths_B[None, :, None, None, None, None]
    if N > 1:  # chunk 0 has no previous chunk: its rolled-in half is the last chunk
        first_half = jnp.arange(2 * C) < C
        allowed &= ~((jnp.arange(N) == 0)[:, None, None] & first_half)
    if causal:
        allowed &= pk <= pq
    logits = jnp.where(pk == pq, SELF_LOGIT, logits)
    if R > 1:
        logits = logits - jnp.log(_window_counts(rank_RBHT, pq, pk, C, N).astype(acc))
    logits = jnp.where(allowed, logits, MASKED_LOGIT)

    lse_RBHNC = jax.nn.logsumexp(logits, axis=-1)
    p = jnp.exp(logits - lse_RBHNC[..., None])
    out_RBHNCM = jnp.einsum("rbhncw,rbhnwm->rbhncm", p, v_RBHNWM.astype(acc))

    # Back to time order, then weight each round by its share of the total normaliser.
    out_RBHTM = jnp.take_along_axis(out_RBHNCM.reshape(R, B, H, Tp, M), rank_RBHT[..., None], 3)
    lse_RBHT = jnp.take_along_axis(lse_RBHNC.reshape(R, B, H, Tp), rank_RBHT, 3)
    weight_RBHT = jax.nn.softmax(lse_RBHT, axis=0)
    out_BHTM = jnp.einsum("rbht,rbhtm->bhtm", weight_RBHT, out_RBHTM)
    # A query with no valid key in any round's window (padding, or key_lengths 0) gets 0: the
    # softmax over MASKED_LOGIT alone would average (or, rounded, sum) the masked values.
    has_key_RBHT = jnp.take_along_axis(
        jnp.any(jnp.broadcast_to(allowed, logits.shape), axis=-1).reshape(R, B, H, Tp), rank_RBHT, 3
    )
    out_BHTM = jnp.where(jnp.any(has_key_RBHT, axis=0)[..., None], out_BHTM, jnp.zeros((), acc))
    return jnp.swapaxes(out_BHTM, 1, 2)[:, :T].astype(v_BTHM.dtype)


def _window_counts(rank_RBHT, pq, pk, C, N):
    """For every (query, key) pair in a window: in how many rounds' windows the pair falls."""
    R, B, H, _ = rank_RBHT.shape

    def chunk_of(pos, chunk_BHT):  # chunk of each position of `pos` [R, B, H, ...] in one round
        flat_RBH_ = pos.reshape(R, B, H, -1)
        got = jnp.take_along_axis(jnp.broadcast_to(chunk_BHT, (R,) + chunk_BHT.shape), flat_RBH_, axis=-1)
        return got.reshape(pos.shape)

    counts = 0
    for r in range(R):  # one round at a time: no [R, R, ...] tensor
        chunk_BHT = rank_RBHT[r] // C
        cq, ck = chunk_of(pq, chunk_BHT), chunk_of(pk, chunk_BHT)
        inside = (ck == cq) | (ck == cq - 1) if N > 1 else ck == cq
        counts = counts + inside.astype(jnp.int32)
    return jnp.maximum(counts, 1)  # masked pairs (e.g. chunk 0's rolled-in half) may count 0


def lsh_attention_reference(
    q_BTHD, v_BTHM, rotations_RDU, *, chunk_size: int, causal: bool = False, key_lengths=None, scale=None
):
    """The definition, densely: softmax over the union of every round's window, O(T^2)."""
    B, T, H, D = q_BTHD.shape
    q_BTHD, k_BTHD, v_BTHM, _, rank_RBHT, lengths_B, acc = _prepare(
        q_BTHD, v_BTHM, rotations_RDU, chunk_size, key_lengths, "lsh_attention_reference"
    )
    N = q_BTHD.shape[1] // chunk_size
    chunk_RBHT = (rank_RBHT // chunk_size)[..., :T]
    ci, cj = chunk_RBHT[..., :, None], chunk_RBHT[..., None, :]
    in_window = (cj == ci) | ((cj == ci - 1) if N > 1 else False)
    allowed_BHTS = jnp.any(in_window, axis=0)
    allowed_BHTS &= (jnp.arange(T)[None, :] < lengths_B[:, None])[:, None, None, :]
    if causal:
        allowed_BHTS &= jnp.tril(jnp.ones((T, T), bool))
    scale = D**-0.5 if scale is None else scale
    logits = jnp.einsum("bthd,bshd->bhts", q_BTHD[:, :T].astype(acc), k_BTHD[:, :T]) * scale
    logits = jnp.where(jnp.eye(T, dtype=bool), SELF_LOGIT, logits)
    logits = jnp.where(allowed_BHTS, logits, MASKED_LOGIT)
    out_BHTM = jnp.einsum("bhts,bshm->bhtm", jax.nn.softmax(logits, -1), v_BTHM[:, :T].astype(acc))
    out_BHTM = jnp.where(jnp.any(allowed_BHTS, axis=-1)[..., None], out_BHTM, jnp.zeros((), acc))
    return jnp.swapaxes(out_BHTM, 1, 2).astype(v_BTHM.dtype)
