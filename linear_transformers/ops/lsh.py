"""Reformer's LSH attention (Kitaev et al., 2020), the paper's baseline: shared query/key,
angular hashing into buckets, sort, chunk, attend within a chunk and one chunk back, R rounds.

Legend: B batch, N time, H heads, D query/key features, M value features, R hashing rounds,
U buckets, G chunks, C chunk length, W window (the previous chunk and the own chunk, 2C).

What one query sees. Each round r hashes every position, sorts positions by (bucket, position)
and cuts the sorted order into chunks of C; query i may attend key j when j's chunk in that
order is i's chunk or the one before it. Over R rounds, i attends to the *union* of its windows:
a key inside several windows is counted once (its logit is lowered by log of the number of
windows holding it), so the result is exactly a softmax over that union. That definition is
what `lsh_attention_reference` computes densely. Keys are the unit-normalised queries (shared
QK); a token attends to itself only when nothing else is in reach (its logit is replaced by
`SELF_LOGIT`), as in the Reformer. Causal and key-padding masks restrict the union further.

Causal LSH attends only to keys j <= i, but which of them share i's window depends on every
position's hash, later ones included (they take places in the sorted order). That is the
Reformer's definition, and the reason it has no recurrent form. Changing later positions moves
earlier outputs by O(1) (tests/test_lsh_attention.py measures it), so a causal LSH model's
teacher-forced predictions are not what greedy decoding gives. Marking the later positions as
padding (`key_lengths`) takes them out of the sorted order (padding has a bucket of its own),
so the outputs up to a length equal those of the sequence cut there: decoding exactly means
re-running the model on each prefix that way.

Logits, softmaxes and the round weights are float32 (or wider) whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import _checks

SELF_LOGIT = -1e5  # attend to oneself only when no other key is in reach
MASKED_LOGIT = -1e9


def lsh_rotations(key, num_rounds: int, head_dim: int, num_buckets: int):
    """Random rotations [R, D, U/2] for angular LSH; one bucket needs none ([R, D, 0])."""
    check_lsh_options(num_rounds=num_rounds, num_buckets=num_buckets, chunk_size=1)
    return jax.random.normal(key, (num_rounds, head_dim, num_buckets // 2), jnp.float32)


def check_lsh_options(*, num_rounds: int, num_buckets: int, chunk_size: int) -> None:
    """Raise a ValueError naming the first unusable LSH option."""
    if not isinstance(num_rounds, int) or num_rounds < 1:
        raise ValueError(f"LSH attention: num_rounds must be an integer >= 1, got {num_rounds!r}.")
    if not isinstance(num_buckets, int) or not (
        num_buckets == 1 or (num_buckets >= 2 and num_buckets % 2 == 0)
    ):
        raise ValueError(
            f"LSH attention: num_buckets must be 1 or an even integer >= 2 (angular "
            f"hashing picks argmax over [xR, -xR]), got {num_buckets!r}."
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"LSH attention: chunk_size must be an integer >= 1, got {chunk_size!r}.")


def lsh_hashes(x_BNHD, rotations_RDU):
    """Bucket of every position in every round, int32 [R, B, H, N]: argmax over [xR, -xR]."""
    R, D, half = rotations_RDU.shape
    B, N, H, _ = x_BNHD.shape
    if half == 0:
        return jnp.zeros((R, B, H, N), jnp.int32)
    proj_RBHNU = jnp.einsum("bnhd,rdu->rbhnu", x_BNHD, rotations_RDU.astype(x_BNHD.dtype))
    return jnp.argmax(jnp.concatenate([proj_RBHNU, -proj_RBHNU], -1), -1).astype(jnp.int32)


def _unit_keys(q_BNHD, acc):
    q = q_BNHD.astype(acc)
    return q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + jnp.finfo(acc).tiny)


def _prepare(q_BNHD, v_BNHM, rotations_RDU, chunk_size, key_lengths, name):
    """Shared by the fast path and the reference: checks, padding to whole chunks, hashing and
    the sorted order. Returns the padded arrays and, per round, order and rank [R, B, H, Np]."""
    _checks.check_qkv(q_BNHD, q_BNHD, v_BNHM, name=name)
    B, N, H, D = q_BNHD.shape
    if rotations_RDU.ndim != 3 or rotations_RDU.shape[1] != D:
        raise ValueError(
            f"{name}: rotations must be [rounds, {D}, buckets/2], got shape {tuple(rotations_RDU.shape)}."
        )
    if N == 0:
        raise ValueError(
            f"{name}: needs at least one position to hash, got an empty sequence "
            f"(shape {tuple(q_BNHD.shape)})."
        )
    key_lengths = _checks.check_key_lengths(key_lengths, B, name=name, length=N)
    num_buckets = max(1, 2 * rotations_RDU.shape[2])
    check_lsh_options(num_rounds=rotations_RDU.shape[0], num_buckets=num_buckets, chunk_size=chunk_size)
    acc = _checks.accumulation_dtype(q_BNHD.dtype)
    Np = -(-N // chunk_size) * chunk_size
    pad = [(0, 0), (0, Np - N), (0, 0), (0, 0)]
    q_BNHD, v_BNHM = jnp.pad(q_BNHD, pad), jnp.pad(v_BNHM, pad)
    k_BNHD = _unit_keys(q_BNHD, acc)
    pos_N = jnp.arange(Np)
    lengths_B = jnp.full((B,), N, jnp.int32) if key_lengths is None else jnp.minimum(key_lengths, N)
    # Padding (past key_lengths, or added to fill the last chunk) goes to an extra bucket: it
    # sorts last, so it never takes a real token's place in a chunk and its content cannot
    # change which real keys a query sees.
    real_B11N = (pos_N[None, :] < lengths_B[:, None])[:, None, :]
    bucket_RBHN = jnp.where(real_B11N, lsh_hashes(k_BNHD, rotations_RDU), num_buckets)
    order_RBHN = jnp.argsort(bucket_RBHN * Np + pos_N, axis=-1)
    rank_RBHN = jnp.argsort(order_RBHN, axis=-1)
    return q_BNHD, k_BNHD, v_BNHM, order_RBHN, rank_RBHN, lengths_B, acc


def lsh_attention(
    q_BNHD, v_BNHM, rotations_RDU, *, chunk_size: int, causal: bool = False, key_lengths=None, scale=None
):
    """LSH self-attention with shared query/key: O(N log N + N C R) time, O(N C R) memory.

    Args:
      q_BNHD: queries [B, N, H, D]; the keys are these queries normalised to unit length.
      v_BNHM: values [B, N, H, M].
      rotations_RDU: from `lsh_rotations` (R rounds, U buckets).
      chunk_size: C; N need not be a multiple (the last chunk is padded).
      causal: query i sees keys j <= i only.
      key_lengths: int [B] in [0, N]; keys at index >= key_lengths[b] are ignored (out of
        range: a ValueError eagerly, clamped under jit).
      scale: multiplies the logits; default 1/sqrt(D).

    Returns [B, N, H, M] in the dtype of v.
    """
    B, N, H, D = q_BNHD.shape
    M = v_BNHM.shape[-1]
    q_BNHD, k_BNHD, v_BNHM, order_RBHN, rank_RBHN, lengths_B, acc = _prepare(
        q_BNHD, v_BNHM, rotations_RDU, chunk_size, key_lengths, "lsh_attention"
    )
    R, C, Np = rotations_RDU.shape[0], chunk_size, q_BNHD.shape[1]
    G = Np // C
    scale = D**-0.5 if scale is None else scale

    def sort(x_BNHF):  # -> [R, B, H, G, C, F] in each round's sorted order
        x_RBHNF = jnp.broadcast_to(jnp.swapaxes(x_BNHF, 1, 2)[None], (R, B, H, Np, x_BNHF.shape[-1]))
        x_RBHNF = jnp.take_along_axis(x_RBHNF, order_RBHN[..., None], axis=3)
        return x_RBHNF.reshape(R, B, H, G, C, -1)

    def window(x_RBHGC_):  # own chunk preceded by the previous one -> [R, B, H, G, W, ...]
        if G == 1:
            return x_RBHGC_
        return jnp.concatenate([jnp.roll(x_RBHGC_, 1, axis=3), x_RBHGC_], axis=4)

    q_RBHGCD = sort(q_BNHD.astype(acc))
    k_RBHGWD = window(sort(k_BNHD))
    v_RBHGWM = window(sort(v_BNHM))
    posq_RBHGC = order_RBHN.reshape(R, B, H, G, C)
    posk_RBHGW = window(posq_RBHGC)

    logits = jnp.einsum("rbhgcd,rbhgwd->rbhgcw", q_RBHGCD, k_RBHGWD) * jnp.asarray(scale, acc)
    pq, pk = posq_RBHGC[..., :, None], posk_RBHGW[..., None, :]
    allowed = pk < lengths_B[None, :, None, None, None, None]
    if G > 1:  # chunk 0 has no previous chunk: its rolled-in half is the last chunk
        first_half = jnp.arange(2 * C) < C
        allowed &= ~((jnp.arange(G) == 0)[:, None, None] & first_half)
    if causal:
        allowed &= pk <= pq
    logits = jnp.where(pk == pq, SELF_LOGIT, logits)
    if R > 1:
        logits = logits - jnp.log(_window_counts(rank_RBHN, pq, pk, C, G).astype(acc))
    logits = jnp.where(allowed, logits, MASKED_LOGIT)

    lse_RBHGC = jax.nn.logsumexp(logits, axis=-1)
    p = jnp.exp(logits - lse_RBHGC[..., None])
    out_RBHGCM = jnp.einsum("rbhgcw,rbhgwm->rbhgcm", p, v_RBHGWM.astype(acc))

    # Back to time order, then weight each round by its share of the total normaliser.
    out_RBHNM = jnp.take_along_axis(out_RBHGCM.reshape(R, B, H, Np, M), rank_RBHN[..., None], 3)
    lse_RBHN = jnp.take_along_axis(lse_RBHGC.reshape(R, B, H, Np), rank_RBHN, 3)
    weight_RBHN = jax.nn.softmax(lse_RBHN, axis=0)
    out_BHNM = jnp.einsum("rbhn,rbhnm->bhnm", weight_RBHN, out_RBHNM)
    return jnp.swapaxes(out_BHNM, 1, 2)[:, :N].astype(v_BNHM.dtype)


def _window_counts(rank_RBHN, pq, pk, C, G):
    """For every (query, key) pair in a window: in how many rounds' windows the pair falls."""
    R, B, H, _ = rank_RBHN.shape

    def chunk_of(pos, chunk_BHN):  # chunk of each position of `pos` [R, B, H, ...] in one round
        flat_RBHK = pos.reshape(R, B, H, -1)
        got = jnp.take_along_axis(jnp.broadcast_to(chunk_BHN, (R,) + chunk_BHN.shape), flat_RBHK, axis=-1)
        return got.reshape(pos.shape)

    counts = 0
    for r in range(R):  # one round at a time: no [R, R, ...] tensor
        chunk_BHN = rank_RBHN[r] // C
        cq, ck = chunk_of(pq, chunk_BHN), chunk_of(pk, chunk_BHN)
        inside = (ck == cq) | (ck == cq - 1) if G > 1 else ck == cq
        counts = counts + inside.astype(jnp.int32)
    return jnp.maximum(counts, 1)  # masked pairs (e.g. chunk 0's rolled-in half) may count 0


def lsh_attention_reference(
    q_BNHD, v_BNHM, rotations_RDU, *, chunk_size: int, causal: bool = False, key_lengths=None, scale=None
):
    """The definition, densely: softmax over the union of every round's window, O(N^2)."""
    B, N, H, D = q_BNHD.shape
    q_BNHD, k_BNHD, v_BNHM, _, rank_RBHN, lengths_B, acc = _prepare(
        q_BNHD, v_BNHM, rotations_RDU, chunk_size, key_lengths, "lsh_attention_reference"
    )
    G = q_BNHD.shape[1] // chunk_size
    chunk_RBHN = (rank_RBHN // chunk_size)[..., :N]
    ci, cj = chunk_RBHN[..., :, None], chunk_RBHN[..., None, :]
    in_window = (cj == ci) | ((cj == ci - 1) if G > 1 else False)
    allowed_BHNN = jnp.any(in_window, axis=0)
    allowed_BHNN &= (jnp.arange(N)[None, :] < lengths_B[:, None])[:, None, None, :]
    if causal:
        allowed_BHNN &= jnp.tril(jnp.ones((N, N), bool))
    scale = D**-0.5 if scale is None else scale
    logits = jnp.einsum("bihd,bjhd->bhij", q_BNHD[:, :N].astype(acc), k_BNHD[:, :N]) * scale
    logits = jnp.where(jnp.eye(N, dtype=bool), SELF_LOGIT, logits)
    logits = jnp.where(allowed_BHNN, logits, MASKED_LOGIT)
    out_BHNM = jnp.einsum("bhij,bjhm->bhim", jax.nn.softmax(logits, -1), v_BNHM[:, :N].astype(acc))
    return jnp.swapaxes(out_BHNM, 1, 2).astype(v_BNHM.dtype)
