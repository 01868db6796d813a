"""The Pallas kernels of the "pallas" form: the chunked recurrence of one (batch, head) per
program, its state kept on chip from the first chunk to the last. Each chunk is prepared as it
is loaded (`inputs.Preparation`: feature map, scale, the keys that do not count, the finite part
of v and g), where `pallas.py` leaves that to the kernels.

Legend: B batch, T time (a whole number of chunks), H heads, D key/query features (feature-map
features, after `prepare`), M value features, C chunk length, X decay features (1 or D).

Each program walks its sequence chunk by chunk with `lax.fori_loop`, carrying the [D, M] state
in float32 (float64 for float64 inputs). Within a chunk, with L[t, s] the log decays summed over
(s, t], P[t] those up to t and Q[s] those after s (within the chunk), and Gamma their total:

  A[t, s]   = sum_x q[t] k[s] exp(L[t, s, x])              t >= s, same segment (else 0)
  out[t]    = A[t] @ v + reads[t] * (q[t] * exp(P[t])) @ S
  S        <- survives * exp(Gamma) * S + (tail * k * exp(Q))^T @ v

`reads[t]`: no segment began in the chunk up to t (the query reads the state carried in);
`tail[s]`: s is in the chunk's last segment (it reaches the state carried out); `survives`: no
segment began in the chunk. Segments come in as two int32 [B, T] counts of segment starts, up to
and including t (`runs`) and before t (`before`); without segments neither is passed. The keys
that count come in as an int32 [B, T] (`valid`, nonzero: counts) where some do not.

Every sum of log decays is a sum of same-sign terms (a cumulative sum, or a product with a 0/1
matrix at float32's full precision on tensor cores: `_sums`), never the difference of two
running sums, and every exponent is <= 0:
exact and finite whatever the decays, as the XLA forms are (`totals.py`). With a decay per
feature a chunk's scores are, as in the chunked form (`chunk_scores.py`), one matmul of q and k
rescaled from the chunk's midpoint where its decays stay within exp(+-FACTOR_RANGE) of it (exact
to a relative eps * FACTOR_RANGE), else every pair's decay on its own (`lax.cond` per chunk):
a loop over the chunk's keys, each with its decays to every later step of the chunk, [C, D] at a
time, where all the pairs' decays at once would be [C, C, D] (FLA's GLA kernels loop over the
keys of a chunk's diagonal blocks the same way); so a decay per feature takes the chunks the
others take.

The backward kernel recomputes what it needs: one pass forward over the chunks (carrying S)
gives dq; one pass backward (carrying dS, the cotangent of the state) gives dk, dv and the
initial state's cotangent. Nothing the size of the sequence is kept between the passes, which
share nothing but their inputs, so they may run in programs of their own
(`pallas.Tuning.split_backward`; with `split_key_value` the backward pass runs twice, in
programs of its own for dk and for dv). Each cotangent goes back through the chunk's preparation
before it is written. With a decay the passes also write q . dq and k . dk of the prepared
chunks, summed within each chunk from each step to the end of its segment there, from which
`pallas.py` forms the decays' cotangent (adding what the later chunks give: a sum per chunk).

The parallel forms (`pallas.Tuning.parallel_forward`, `parallel_backward`) cut each loop down
to the state's update: a loop writes the state entering every chunk (backward, a second loop
the cotangent of the state leaving every chunk), and then one program per chunk makes its
output (`chunk_outputs_kernel`) or its gradients (`chunk_gradients_kernel`) from them, with
the same per-chunk functions as the one-pass kernels. With `pallas.Tuning.walks` the loop is
cut into walks over stretches of the sequence, a program each, each from a zero state: S
entering chunk c is then what its walk wrote plus the state entering the walk (joined by
`pallas.py` from each walk's final state and total factor) carried to c, rows scaled by the
factor the walk wrote for c, the product of the chunks' decays since the walk's start (0 past a
segment's start): `carry_over_normaliser` applied to a row of ones, chunk by chunk (`_Joins`).
Backward the same holds for the cotangents, from the end of each walk. The one-pass kernels
walk in stretches the same way, each stretch's program from the state entering it (and,
backward, the cotangent of the state leaving it), which `pallas.py` joins from a first walk of
the stretches from zero that writes only their ends (`chunk_states_kernel`,
`backward_states_kernel` with `write_chunks` False).

Only what Pallas lowers to Triton, and Triton compiles, is used here (no value slicing, 2-D
matmuls, forward `cumsum` of [C, D] blocks only); `tests/ops/test_pallas_form.py` lowers both
kernels for CUDA on any machine, and `experiments/kernel_resources.py` compiles them with Triton
for a GPU on any machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from linear_transformers.ops.gated_linear.chunk_scores import FACTOR_RANGE
from linear_transformers.ops.precision import EXACT


def _chunk_masks(c, runs_ref, before_ref, C: int):
    """(keep [C, C], reads [C], tail [C], survives) of chunk c; all None without segments but keep
    (the causal mask)."""
    t = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    s = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    keep = t >= s
    if runs_ref is None:
        return keep, None, None, None
    rows = pl.ds(c * C, C)
    runs = runs_ref[rows]
    entering = jnp.min(before_ref[rows])  # the segment count the carried state belongs to
    last = jnp.max(runs)
    keep = keep & (runs[:, None] == runs[None, :])
    return keep, runs == entering, runs == last, last == entering


class _Chunk:
    """One chunk's inputs, prepared (`inputs.Preparation`, where the kernel applies it) and in
    `acc`, its masks, and the factors that carry its queries to the state entering it (`into`)
    and its keys to the state leaving it (`out_of`): [C, X] or None (1)."""

    def __init__(self, c, refs, C: int, acc, *, per_feature: bool, prepare, features: int, products):
        q_ref, k_ref, v_ref, g_ref, valid_ref, runs_ref, before_ref = refs
        self.products = products
        rows = pl.ds(c * C, C)
        valid = None if valid_ref is None else valid_ref[rows] != 0
        self._raw = {"q": q_ref[rows, :], "k": k_ref[rows, :], "v": v_ref[rows, :]}
        self._prepare = _chunk_preparation(prepare, valid, features, acc)
        self.q, self.k, self.v = (self._prepare[name](self._raw[name]) for name in ("q", "k", "v"))
        self.keep, reads, tail, self.survives = _chunk_masks(c, runs_ref, before_ref, C)
        self.per_feature = per_feature
        self.g = self.decay = self.into = self.out_of = self.E = self.u = self.factored = None
        if g_ref is not None:
            self._raw["g"] = g_ref[rows, :] if per_feature else g_ref[rows][:, None]  # [C, X]
            g = self._raw["g"]
            g = g.astype(acc) if prepare is None else prepare.log_decays(g, valid)
            after = _later(C)  # after[s, i]: i > s
            if per_feature:
                prefix = jnp.cumsum(g, axis=0)
                suffix = _sums(after, g)
            else:  # Triton 3.6's scan lowering asserts for a [C, 1] block: sums along rows
                prefix = jnp.sum(jnp.where(_upto(C), jnp.transpose(g), 0), axis=1, keepdims=True)
                suffix = jnp.sum(jnp.where(after, jnp.transpose(g), 0), axis=1, keepdims=True)
            gamma = jnp.sum(g, axis=0, keepdims=True)  # [1, X]
            self.g, self.decay = g, jnp.exp(gamma)
            self.into, self.out_of = jnp.exp(prefix), jnp.exp(suffix)
            if per_feature:
                self.u = _from_midpoint(g)
                self.factored = jnp.max(jnp.abs(self.u)) <= FACTOR_RANGE
            else:  # the [C, C] pair decays every pass reads, once per chunk
                self.E = self._step_pair_decays()
        if reads is not None:
            one = jnp.ones((C, 1), acc)
            self.into = jnp.where(reads[:, None], one if self.into is None else self.into, 0)
            self.out_of = jnp.where(tail[:, None], one if self.out_of is None else self.out_of, 0)
        self.q_in = _times(self.q, self.into)
        self.k_out = _times(self.k, self.out_of)

    def dot(self, a, b, *, trans_a=False, trans_b=False):
        """a @ b (each transposed as asked), summed in float32 (float64 for float64 inputs), its
        operands cast to `products` (`pallas.Config`) where that is not None."""
        if self.products is not None:
            a, b = a.astype(self.products), b.astype(self.products)
        return pltriton.dot(a, b, trans_a=trans_a, trans_b=trans_b)

    def clean(self):
        """1 where every raw v of the chunk is finite and every raw log decay <= 0 (not NaN),
        else 0: what the non-finite guard checks (`nonfinite.py`), seen as the chunk is loaded."""
        one, zero = jnp.int32(1), jnp.int32(0)
        ok = jnp.min(jnp.where(jnp.isfinite(self._raw["v"]), one, zero))
        if "g" in self._raw:
            ok = jnp.minimum(ok, jnp.min(jnp.where(self._raw["g"] <= 0, one, zero)))
        return ok

    def raw_cotangent(self, name: str, cotangent):
        """The cotangent of the chunk of raw input `name` ("q", "k" or "v"), given that of its
        prepared chunk: back through the preparation, in the raw input's dtype."""
        _, pullback = jax.vjp(self._prepare[name], self._raw[name])
        return pullback(cotangent)[0]

    def log_decay_cotangent(self, x, dx):
        """x . dx of a prepared chunk and its cotangent, summed at and after each step within
        the chunk and the step's segment: per feature [C, D], or summed over the features too
        [C] with a decay per step (`pallas.py` adds what the steps after the chunk give)."""
        keep = self.keep  # [i, t]: i >= t in t's segment
        if self.per_feature:
            return _sums(keep, x * dx, transpose=True)
        return jnp.sum(jnp.where(keep, jnp.sum(x * dx, axis=1, keepdims=True), 0), axis=0)

    def _step_pair_decays(self):
        """exp(L[t, s]) where kept, else 0, [C, C], with one decay per step: L[t, s] = sum_i
        [i <= t] g[i] [i > s], the log decays in (s, t] as a product with a 0/1 matrix at full
        precision (`_sums`): a sum of same-sign terms, never a difference of two running sums,
        which would lose eps * |sum|."""
        C = self.g.shape[0]
        i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
        s = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
        L = _sums(_upto(C), jnp.where(i > s, self.g, 0))  # [t, i] @ [i, s]
        return jnp.exp(jnp.where(self.keep, L, -jnp.inf))

    def _decays_from(self, s):
        """[C, D]: per feature, the decay from step s to each step t >= s of the chunk, exp of
        sum_{s < i <= t} g[i] (a cumulative sum of same-sign terms, never a difference of two
        running sums), and 0 before s."""
        row = jax.lax.broadcasted_iota(jnp.int32, self.g.shape, 0)
        L = jnp.cumsum(jnp.where(row > s, self.g, 0), axis=0)
        return jnp.where(row >= s, jnp.exp(L), 0)

    def _per_feature(self, factored, column, init):
        """`factored(exp(u), exp(-u))` where the chunk's decays stay within exp(+-FACTOR_RANGE)
        of its midpoint (u: the log decays from the midpoint to each step), else every pair's
        decay on its own: a loop over the chunk's steps s from `init`, `column(s, decays from s
        [C, D], carry) -> carry` (`_decays_from`), which holds [C, D] values at a time where
        the pair decays of a chunk would be [C, C, D]."""
        C = self.g.shape[0]
        return jax.lax.cond(
            self.factored,
            lambda: factored(jnp.exp(self.u), jnp.exp(-self.u)),
            lambda: jax.lax.fori_loop(0, C, lambda s, carry: column(s, self._decays_from(s), carry), init),
        )

    def scores(self):
        """A [C, C]: q[t] . (decayed) k[s] where kept, else 0."""
        if self.g is None:
            return jnp.where(self.keep, self.dot(self.q, self.k, trans_b=True), 0)
        if not self.per_feature:
            return self.dot(self.q, self.k, trans_b=True) * self.E
        columns = jax.lax.broadcasted_iota(jnp.int32, self.keep.shape, 1)

        def column(s, E, A):  # column s of A
            a = jnp.sum(self.q * _row_of(self.k, s) * E, axis=1, keepdims=True)
            return jnp.where(self.keep & (columns == s), a, A)

        return self._per_feature(
            lambda up, down: jnp.where(self.keep, self.dot(self.q * up, self.k * down, trans_b=True), 0),
            column,
            jnp.zeros(self.keep.shape, self.q.dtype),
        )

    def query_cotangent(self, dA):
        """dq of the scores, given their cotangent dA [C, C] (zero where not kept)."""
        if self.g is None:
            return self.dot(dA, self.k)
        if not self.per_feature:
            return self.dot(dA * self.E, self.k)
        return self._per_feature(
            lambda up, down: self.dot(dA, self.k * down) * up,
            lambda s, E, dq: dq + _column_of(dA, s) * _row_of(self.k, s) * E,  # key s's part
            jnp.zeros_like(self.q),
        )

    def key_cotangent(self, dA):
        """dk of the scores, given their cotangent dA [C, C] (zero where not kept)."""
        if self.g is None:
            return self.dot(dA, self.q, trans_a=True)
        if not self.per_feature:
            return self.dot(dA * self.E, self.q, trans_a=True)
        rows = jax.lax.broadcasted_iota(jnp.int32, self.k.shape, 0)

        def column(s, E, dk):  # row s of dk
            return jnp.where(rows == s, jnp.sum(_column_of(dA, s) * self.q * E, axis=0, keepdims=True), dk)

        return self._per_feature(
            lambda up, down: self.dot(dA, self.q * up, trans_a=True) * down,
            column,
            jnp.zeros_like(self.k),
        )

    def carry_over(self, S):
        """What the chunk leaves of the state carried into it: S decayed (per row), or 0."""
        if self.decay is not None:
            S = S * jnp.transpose(self.decay)  # [X, 1] against S's rows
        return S if self.survives is None else jnp.where(self.survives, S, 0)

    def carry_over_normaliser(self, z):
        """The same for the normaliser's state z [1, D] (or its cotangent): a row."""
        if self.decay is not None:
            z = z * self.decay
        return z if self.survives is None else jnp.where(self.survives, z, 0)


def _row_of(x, s):
    """Row s of x [R, N], as [1, N] (Triton has no slicing of values)."""
    return jnp.sum(
        jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == s, x, 0), axis=0, keepdims=True
    )


def _column_of(x, s):
    """Column s of x [N, R], as [N, 1]."""
    return jnp.sum(
        jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) == s, x, 0), axis=1, keepdims=True
    )


def _later(C: int):
    """[C, C] bool: [s, i] is i > s."""
    return jax.lax.broadcasted_iota(jnp.int32, (C, C), 1) > jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)


def _upto(C: int):
    """[C, C] bool: [t, i] is i <= t."""
    return jax.lax.broadcasted_iota(jnp.int32, (C, C), 1) <= jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)


def _from_midpoint(g):
    """u [C, X]: the log decays summed from the chunk's midpoint m to each step (after m:
    sum_{m < i <= t} g_i; before it: -sum_{t < i <= m} g_i), each a sum of same-sign terms, as
    `chunk_scores.from_midpoint`. exp(u_t - u_s) is the decay from s to t."""
    C = g.shape[0]
    t = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    m = C // 2
    signed = ((m < i) & (i <= t)).astype(g.dtype) - ((t < i) & (i <= m)).astype(g.dtype)
    return _sums(signed, g)


def _sums(mask, x, *, transpose: bool = False):
    """mask @ x (mask^T @ x with `transpose`) at x's full precision, mask holding only 0 and
    +-1: sums of x's rows, chosen and signed by mask (the decays' cumulative and windowed log
    sums; Triton has no reverse `cumsum`). A float32 product at full precision (`EXACT`) would
    run as C * C * D fused multiply-adds on the CUDA cores, in the loop each program walks; here
    it runs on tensor cores: x is split into three bfloat16 parts (8 significant bits each,
    float32's 24: their sum is x exactly, for |x| above 1e-31), each multiplied by the mask
    exactly and summed in float32. float64 keeps its own exact product."""
    if x.dtype == jnp.float64:
        return pltriton.dot(mask.astype(x.dtype), x, trans_a=transpose, precision=EXACT)
    parts, rest = [], x.astype(jnp.float32)
    for _ in range(3):
        parts.append(rest.astype(jnp.bfloat16))
        rest = rest - parts[-1].astype(jnp.float32)
    mask = mask.astype(jnp.bfloat16)  # 0 and +-1: exact
    high, middle, low = (pltriton.dot(mask, part, trans_a=transpose) for part in parts)
    return (low + middle) + high  # the smallest first


def _times(x, factor):
    return x if factor is None else x * factor


def _chunk_preparation(prepare, valid, features: int, acc):
    """{"q", "k", "v"}: a raw chunk -> the prepared one, in `acc` (Triton has no bfloat16
    division, which the feature maps' derivatives use), as `prepare` makes it (None: the inputs
    come prepared), with the features past `features` (padding, which a feature map need not
    keep at 0) zeroed in q and k."""

    def queries(q):
        q = q.astype(acc)
        return _first_features(q if prepare is None else prepare.queries(q), features, prepare)

    def keys(k):
        k = k.astype(acc)
        return _first_features(k if prepare is None else prepare.keys(k, valid), features, prepare)

    def values(v):
        v = v.astype(acc)
        return v if prepare is None else prepare.values(v, valid)

    return {"q": queries, "k": keys, "v": values}


def _first_features(x, features: int, prepare):
    if prepare is None or x.shape[1] == features:
        return x
    kept = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < features
    return jnp.where(kept, x, 0)


def _split_refs(refs, has_decay: bool, has_valid: bool, has_segments: bool):
    """(q, k, v, g, valid, runs, before), taken from the iterator `refs` of the kernel's refs;
    None where not passed."""
    q_ref, k_ref, v_ref = next(refs), next(refs), next(refs)
    g_ref = next(refs) if has_decay else None
    valid_ref = next(refs) if has_valid else None
    runs_ref, before_ref = (next(refs), next(refs)) if has_segments else (None, None)
    return q_ref, k_ref, v_ref, g_ref, valid_ref, runs_ref, before_ref


def _state_refs(refs, normalize: bool):
    """The next ref of the iterator `refs` and, with a normaliser, the one after it: a state
    [D, M] (or the states of the chunks) and its normaliser's row [D]; None without one."""
    return next(refs), next(refs) if normalize else None


def _pack(S, z):
    """A loop's carry: S, or (S, z) with a normaliser (no placeholder carried without one)."""
    return S if z is None else (S, z)


def _unpack(carry, normalize: bool):
    return carry if normalize else (carry, None)


def _write_chunk_output(chunk, c, C: int, S, z, o_ref, den_ref, eps):
    """Chunk c's output from the state entering it (S, and z with a normaliser: eps not None),
    written to o_ref, with den (the normaliser) to den_ref."""
    A = chunk.scores()
    out = chunk.dot(A, chunk.v) + chunk.dot(chunk.q_in, S)
    rows = pl.ds(c * C, C)
    if eps is not None:
        den = jnp.sum(A, axis=1) + jnp.sum(chunk.q_in * z, axis=1)
        den_ref[rows] = den
        out = out / (den + eps)[:, None]
    o_ref[rows, :] = out.astype(o_ref.dtype)


def _carry_over_chunk(chunk, S, z):
    """The states leaving the chunk, from those entering it (z None: no normaliser)."""
    if z is not None:
        z = chunk.carry_over_normaliser(z) + jnp.sum(chunk.k_out, axis=0, keepdims=True)
    return chunk.carry_over(S) + chunk.dot(chunk.k_out, chunk.v, trans_a=True), z


def forward_kernel(
    *refs, C, num_chunks, walk_chunks, has_decay, has_valid, has_segments, eps, **chunk_options
):
    """refs: q, k, v, [g], [valid], [runs, before], s0, [z0] -> out, s (the state after the
    last chunk), [z, den], clean (`_Chunk.clean` of every chunk: int32 1 or 0).

    With `walk_chunks` < `num_chunks` each sequence is walked in stretches of that many chunks,
    one program a walk (the grid's last axis, `_Walk`), each from the state entering its walk
    (s0 and z0 hold each walk's, [walks * D, ...]: `chunk_states_kernel`'s walks joined by
    `pallas.py`); s, z and clean are each walk's, at its rows and its entry.

    eps None: no normaliser. Else the normaliser runs in the same program, its state z [1, D]
    carried beside S as an implicit column of ones in v: den[t] = the scores' row sum +
    q_in[t] . z, and out = num / (den + eps), written in out's dtype; den (float32 [T]) is
    kept for the backward. Programs of other value blocks compute the same z and den and write
    the same values. `chunk_options`: per_feature, acc, prepare, features (`_Chunk`)."""
    normalize, refs = eps is not None, iter(refs)
    inputs = _split_refs(refs, has_decay, has_valid, has_segments)
    s0_ref, z0_ref = _state_refs(refs, normalize)
    o_ref, s_ref = next(refs), next(refs)
    z_ref, den_ref = (next(refs), next(refs)) if normalize else (None, None)
    clean_ref = next(refs)

    def visit(chunk, c, S, z):
        _write_chunk_output(chunk, c, C, S, z, o_ref, den_ref, eps)

    walk = _Walk.of(pl.program_id(3), walk_chunks, num_chunks, own_start=True)
    _walk_chunks(inputs, (s0_ref, z0_ref), (s_ref, z_ref, clean_ref), visit, C, walk, chunk_options)


def _walk_chunks(inputs, initial_refs, final_refs, visit, C: int, walk, chunk_options, factor_refs=None):
    """The forward's loop over the chunks of `walk` (`_Walk`): `visit(chunk, c, S, z)`
    with the states entering chunk c (z None without a normaliser), carried from (s0, z0) in
    `initial_refs`; then the states after the last chunk and the guard's flag (`_Chunk.clean`
    of every chunk) written to (s, z, clean) in `final_refs` (all None: not written; s and z
    at the walk's rows). `factor_refs` (factors, total; None: none): the factor each of the
    walk's first state's rows reaches chunk c with, written at rows c * D of factors [num chunks
    * D], and the one it leaves the walk with to total (`_Walks`)."""
    (s0_ref, z0_ref), (s_ref, z_ref, clean_ref) = initial_refs, final_refs
    normalize, acc = z0_ref is not None, chunk_options["acc"]
    D = inputs[0].shape[1]  # q's features

    def body(c, carry):
        (S, z), clean, factor = _unpack(carry[0], normalize), carry[1], carry[2]
        chunk = _Chunk(c, inputs, C, **chunk_options)
        visit(chunk, c, S, z)
        if factor_refs is not None:
            factor = _write_factor(factor_refs[0], c, chunk, factor)
        return _pack(*_carry_over_chunk(chunk, S, z)), jnp.minimum(clean, chunk.clean()), factor

    states = walk.start(s0_ref, z0_ref, D, acc)
    factor = None if factor_refs is None else jnp.ones((1, D), acc)
    states, clean, factor = jax.lax.fori_loop(walk.first, walk.stop, body, (states, jnp.int32(1), factor))
    if s_ref is None:
        return
    S, z = _unpack(states, normalize)
    rows = walk.rows(D)
    s_ref[rows, :] = S.astype(s_ref.dtype)
    if normalize:
        z_ref[rows] = z[0].astype(z_ref.dtype)
    if factor_refs is not None:
        factor_refs[1][rows] = factor[0]
    if clean_ref is not None:
        clean_ref[...] = clean


def _write_factor(factors_ref, c, chunk, factor):
    """A walk's factor [1, D] at chunk c written at rows c * D of factors_ref (None: not
    written); the factor past the chunk (its decays, or 0 past a segment's start: as the
    normaliser's state is carried)."""
    if factors_ref is not None:
        D = factor.shape[1]
        factors_ref[pl.ds(c * D, D)] = factor[0]
    return chunk.carry_over_normaliser(factor)


def walk_count(walk_chunks: int, num_chunks: int) -> int:
    """The walks over a sequence of `num_chunks` chunks, `walk_chunks` a walk (the last may have
    fewer: `pallas.Tuning.walks`)."""
    return -(-num_chunks // walk_chunks)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """The chunks one program walks, range(first, stop): a sequence's only walk (index None),
    or its walk `index` of several (`pallas.Tuning.walks`), whose final states go to rows
    index * D of the walks' [walks * D, ...]."""

    first: Any
    stop: Any
    index: Any = None
    own_start: bool = False

    @classmethod
    def of(cls, index, walk_chunks: int, num_chunks: int, *, own_start: bool = False):
        """Walk `index` (the program's) of a sequence of `num_chunks` chunks, `walk_chunks` a walk
        (the last walk may have fewer); the only one where they are all. `own_start`: each
        walk starts from states of its own, at its rows (the one-pass kernels' walks); else
        all from the same (the parallel forms', from zero)."""
        if walk_count(walk_chunks, num_chunks) == 1:
            return cls(0, num_chunks)
        first = index * walk_chunks
        return cls(first, jnp.minimum(first + walk_chunks, num_chunks), index, own_start)

    def rows(self, D: int):
        return slice(None) if self.index is None else pl.ds(self.index * D, D)

    def start(self, s_ref, z_ref, D: int, acc):
        """The loop's carry the walk starts from: S [D, M] of s_ref and z [1, D] of z_ref (None:
        no normaliser), [D, ...] or, with `own_start`, the walk's rows of [walks * D, ...]."""
        rows = self.rows(D) if self.own_start else slice(None)
        return _pack(s_ref[rows, :].astype(acc), None if z_ref is None else z_ref[rows].astype(acc)[None, :])


def chunk_states_kernel(
    *refs, C, num_chunks, walk_chunks, has_decay, has_valid, has_segments, eps, write_chunks, **chunk_options
):
    """The parallel forward's first kernel (`pallas.Tuning.parallel_forward`): refs: q, k, v,
    [g], [valid], [runs, before], s0, [z0] -> states (the state entering each chunk, [num_chunks
    * D, M]: chunk c's at rows c * D), [z states ([num_chunks * D])], s, [z], [factors, totals],
    clean. The loop over chunks carries the state as `forward_kernel`'s does, but does nothing
    else: no query, score or output.

    With `walk_chunks` < `num_chunks` each sequence is walked in stretches of that many chunks,
    one program a walk (the grid's last axis, `_Walk`), each from s0 and z0 (zero: `pallas.py`
    joins the walks): the states each writes are its own, s and z hold each walk's final ones
    [walks * D, ...], and with a decay or segments each walk writes the factor its first state
    reaches each of its chunks with (factors [num_chunks * D]) and leaves it with (totals
    [walks * D]), which `_Joins` reads.

    `write_chunks` False: neither the states entering each chunk nor the factors to each chunk
    are written, only each walk's final states and total factor (the one-pass kernels' walks,
    which start from their joined states: `forward_kernel`)."""
    normalize, refs = eps is not None, iter(refs)
    inputs = _split_refs(refs, has_decay, has_valid, has_segments)
    s0_ref, z0_ref = _state_refs(refs, normalize)
    states_ref, z_states_ref = _state_refs(refs, normalize) if write_chunks else (None, None)
    s_ref, z_ref = _state_refs(refs, normalize)
    walk = _Walk.of(pl.program_id(3), walk_chunks, num_chunks)
    factor_refs = _factor_refs(refs, walk, has_decay or has_segments, write_chunks)
    clean_ref = next(refs)
    visit = _state_writer(states_ref, z_states_ref)
    _walk_chunks(
        inputs, (s0_ref, z0_ref), (s_ref, z_ref, clean_ref), visit, C, walk, chunk_options, factor_refs
    )


def _factor_refs(refs, walk, factored: bool, write_chunks: bool):
    """The next two refs of the iterator `refs` (a walk's factors and totals; without
    `write_chunks`, None and the next ref) where a walk of several, of a sequence with a decay
    or segments, writes them; else None."""
    if walk.index is None or not factored:
        return None
    return next(refs) if write_chunks else None, next(refs)


def _state_writer(states_ref, z_states_ref):
    """A visit of the chunks (`_walk_chunks`) that writes the states entering chunk c at rows
    c * D of states_ref [num_chunks * D, M] and z_states_ref [num_chunks * D] (None: no
    normaliser; states_ref None: nothing written): the parallel forward's and backward's states
    (and their cotangents), which `_chunk_state` reads. S in states_ref's dtype: the products'
    (`_Chunk.dot`) where they round it (`pallas.Config.products`), as the chunks' programs use
    it only in products."""

    def visit(chunk, c, S, z):
        if states_ref is None:
            return
        D = S.shape[0]
        states_ref[pl.ds(c * D, D), :] = S.astype(states_ref.dtype)
        if z_states_ref is not None:
            z_states_ref[pl.ds(c * D, D)] = z[0]

    return visit


class _Joins:
    """What makes the states a walk of several wrote from zero (`chunk_states_kernel`) the
    sequence's: the states each walk starts from ([walks * D, M], and z's [walks * D]: the
    walks' joined in XLA, `pallas.py`) and, with a decay or segments, the factor each reaches
    each chunk with ([num_chunks * D]; else 1). Backward, the same for the cotangents of the
    states leaving each chunk and each walk. `refs`: the next refs of an iterator, read only
    where `walk_chunks` < `num_chunks`."""

    def __init__(self, refs, *, walk_chunks: int, num_chunks: int, normalize: bool, factored: bool):
        self.walk_chunks = walk_chunks
        self.refs = None
        if walk_count(walk_chunks, num_chunks) > 1:
            walks, z_walks = _state_refs(refs, normalize)
            self.refs = walks, z_walks, next(refs) if factored else None

    def chunk_state(self, states_ref, z_states_ref, c, D: int, acc):
        """Chunk c's S [D, M] and z [1, D] (None without a normaliser): `_state_writer`'s, with
        its walk's first state added, carried to chunk c."""
        S, z = _chunk_state(states_ref, z_states_ref, c, D)
        if self.refs is None:
            return S, z
        walks_ref, z_walks_ref, factors_ref = self.refs
        first, rows = pl.ds((c // self.walk_chunks) * D, D), pl.ds(c * D, D)
        factor = None if factors_ref is None else factors_ref[rows][None, :]  # [1, D]
        S = S.astype(acc) + _times(walks_ref[first, :].astype(acc), _column(factor))
        if z is not None:
            z = z + _times(z_walks_ref[first][None, :], factor)
        return S, z


def _column(row):
    return None if row is None else jnp.transpose(row)


def _chunk_state(states_ref, z_states_ref, c, D: int):
    """Chunk c's rows of what `_state_writer` wrote, for D features: S [D, M] and z [1, D]
    (None without a normaliser)."""
    rows = pl.ds(c * D, D)
    return states_ref[rows, :], None if z_states_ref is None else z_states_ref[rows][None, :]


def chunk_outputs_kernel(
    *refs, C, num_chunks, walk_chunks, has_decay, has_valid, has_segments, eps, **chunk_options
):
    """The parallel forward's second kernel: refs: q, k, v, [g], [valid], [runs, before],
    states, [z states] (`chunk_states_kernel`'s), [walks, [z walks], [factors]] (`_Joins`)
    -> out, [den]. One program a chunk (the grid's last axis): every chunk's output at once,
    from the state entering it."""
    normalize, refs = eps is not None, iter(refs)
    inputs = _split_refs(refs, has_decay, has_valid, has_segments)
    states_ref, z_states_ref = _state_refs(refs, normalize)
    joins = _Joins(
        refs,
        walk_chunks=walk_chunks,
        num_chunks=num_chunks,
        normalize=normalize,
        factored=has_decay or has_segments,
    )
    o_ref = next(refs)
    den_ref = next(refs) if normalize else None
    c = pl.program_id(3)
    chunk = _Chunk(c, inputs, C, **chunk_options)
    S, z = joins.chunk_state(states_ref, z_states_ref, c, chunk.q.shape[1], chunk_options["acc"])
    _write_chunk_output(chunk, c, C, S, z, o_ref, den_ref, eps)


class _OutputCotangents:
    """A backward kernel's refs of the output's cotangent: d_out, and with a normaliser (eps not
    None) the forward's den and den's cotangent d_den; `load(c)` gives chunk c with them."""

    def __init__(self, refs, inputs, C: int, eps, chunk_options):
        self.do_ref, self.den_ref, self.dden_ref = refs  # the last two None without a normaliser
        self.inputs, self.C, self.eps, self.chunk_options = inputs, C, eps, chunk_options
        acc = chunk_options["acc"]
        # den's part of dq and dk, once over the value blocks
        self.first_block = (pl.program_id(2) == 0).astype(acc) if eps is not None else None

    def load(self, c):
        """(chunk c, num's cotangent [C, M], the scores' cotangent dA [C, C] (zero where not
        kept), den's cotangent [C, 1] in the first value block's programs (else 0; None without
        a normaliser))."""
        C, eps = self.C, self.eps
        chunk = _Chunk(c, self.inputs, C, **self.chunk_options)
        rows = pl.ds(c * C, C)
        do = self.do_ref[rows, :].astype(self.chunk_options["acc"])
        d_den = None
        if eps is not None:
            do = do / (self.den_ref[rows] + eps)[:, None]
            d_den = self.dden_ref[rows][:, None] * self.first_block  # [C, 1]
        dA = chunk.dot(do, chunk.v, trans_b=True)
        dA = jnp.where(chunk.keep, dA if d_den is None else dA + d_den, 0)  # of the scores
        return chunk, do, dA, d_den

    def whole_d_den(self, c):
        """den's cotangent [C, 1] of chunk c in every program (z's cotangent takes it whole);
        None without a normaliser."""
        return None if self.eps is None else self.dden_ref[pl.ds(c * self.C, self.C)][:, None]


def _write_query_cotangent(chunk, c, C: int, do, dA, d_den, S, z, dq_ref, dG_ref):
    """Chunk c's dq, from its cotangents (`_OutputCotangents.load`) and the states entering it
    (z None without a normaliser), written to dq_ref, with q . dq to dG_ref (None: no decay)."""
    rows = pl.ds(c * C, C)
    dq = chunk.query_cotangent(dA)  # first: the order Triton schedules in, and spills least
    entering = chunk.dot(do, S, trans_b=True)
    if z is not None:
        entering = entering + d_den * z
    dq = dq + _times(entering, chunk.into)
    dq_ref[rows, :] = chunk.raw_cotangent("q", dq).astype(dq_ref.dtype)
    if dG_ref is not None:
        dG_ref[rows] = chunk.log_decay_cotangent(chunk.q, dq)


def _write_key_value_cotangents(chunk, c, C: int, do, dA, dS, dz, first_block, refs, parts):
    """Chunk c's dk and dv, or one of them (`parts`: "key" and/or "value"), from its cotangents
    and those of the states leaving it (dz None without a normaliser; its part of dk taken in
    the first value block's programs only), written to refs (dk, dv, and k . dk with a decay)."""
    dk_ref, dv_ref, dG_ref = refs
    rows = pl.ds(c * C, C)
    key, value = "key" in parts, "value" in parts
    # In this order (dv's products first, dk written first) ptxas allocates best when a program
    # makes both (dv made and written first: 22 more registers without a decay; with TF32
    # products up to 0.25 KB a thread more spilled: BENCHMARKS.md).
    if value:
        dv = chunk.dot(chunk.scores(), do, trans_a=True) + chunk.dot(chunk.k_out, dS)
    if key:
        dk = chunk.key_cotangent(dA)
        leaving = chunk.dot(chunk.v, dS, trans_b=True)
        if dz is not None:
            leaving = leaving + dz * first_block
        dk = dk + _times(leaving, chunk.out_of)
        dk_ref[rows, :] = chunk.raw_cotangent("k", dk).astype(dk_ref.dtype)
    if value:
        dv_ref[rows, :] = chunk.raw_cotangent("v", dv).astype(dv_ref.dtype)
    if key and dG_ref is not None:
        dG_ref[rows] = chunk.log_decay_cotangent(chunk.k, dk)


def _carry_back_chunk(chunk, do, d_den, dS, dz):
    """The cotangents of the states entering the chunk, from those of the states leaving it
    (dz None: no normaliser; d_den whole, `_OutputCotangents.whole_d_den`)."""
    if dz is not None:
        dz = chunk.carry_over_normaliser(dz) + jnp.sum(chunk.q_in * d_den, axis=0, keepdims=True)
    return chunk.carry_over(dS) + chunk.dot(chunk.q_in, do, trans_a=True), dz


def _walk_chunks_back(cotangents, initial_refs, final_refs, visit, walk, factors_ref=None):
    """The backward's loop over the chunks of `walk` (`_Walk`), from the last to the first:
    `visit(chunk, c, do, dA, d_den, dS, dz)` with chunk c's cotangents
    (`_OutputCotangents.load`) and those of the states leaving it (dz None without a
    normaliser), carried from (d_s, d_z) in `initial_refs`; then the cotangents of the states
    entering the walk written to (d_s0, d_z0) in `final_refs` (None: not written; at the walk's
    rows). `factors_ref` (None: none): the factor the cotangent of the state leaving the walk
    reaches that of the state leaving chunk c with, written at rows c * D."""
    (ds_ref, dz_ref), (ds0_ref, dz0_ref) = initial_refs, final_refs
    normalize, acc = dz_ref is not None, cotangents.chunk_options["acc"]
    D = cotangents.inputs[0].shape[1]  # q's features

    def body(i, carry):
        (dS, dz), factor = _unpack(carry[0], normalize), carry[1]
        c = walk.stop - 1 - i
        chunk, do, dA, d_den = cotangents.load(c)
        visit(chunk, c, do, dA, d_den, dS, dz)
        if factors_ref is not None:
            factor = _write_factor(factors_ref, c, chunk, factor)
        return _pack(*_carry_back_chunk(chunk, do, cotangents.whole_d_den(c), dS, dz)), factor

    states = walk.start(ds_ref, dz_ref, D, acc)
    factor = None if factors_ref is None else jnp.ones((1, D), acc)
    carry, _ = jax.lax.fori_loop(0, walk.stop - walk.first, body, (states, factor))
    dS, dz = _unpack(carry, normalize)
    if ds0_ref is None:
        return
    rows = walk.rows(D)
    ds0_ref[rows, :] = dS.astype(ds0_ref.dtype)
    if normalize:
        dz0_ref[rows] = dz[0].astype(dz0_ref.dtype)


def _backward_operands(refs, C: int, has_decay, has_valid, has_segments, eps, chunk_options):
    """(inputs (`_split_refs`), (s0, z0), (d_s, d_z), `_OutputCotangents`) from the iterator
    `refs` of a kernel given the backward's operands: q, k, v, [g], [valid], [runs, before],
    s0, [z0], d_out, d_s, [den, d_den, d_z]; z0 and d_z None without a normaliser."""
    normalize = eps is not None
    inputs = _split_refs(refs, has_decay, has_valid, has_segments)
    s0_ref, z0_ref = _state_refs(refs, normalize)
    do_ref, ds_ref = next(refs), next(refs)
    den_ref, dden_ref, dz_ref = (next(refs), next(refs), next(refs)) if normalize else (None,) * 3
    cotangents = _OutputCotangents((do_ref, den_ref, dden_ref), inputs, C, eps, chunk_options)
    return inputs, (s0_ref, z0_ref), (ds_ref, dz_ref), cotangents


def backward_kernel(
    *refs, C, num_chunks, walk_chunks, has_decay, has_valid, has_segments, eps, passes, **chunk_options
):
    """refs: q, k, v, [g], [valid], [runs, before], s0, [z0], d_out, d_s, [den, d_den, d_z]
    -> dq, dk, dv, d_s0, [d_z0], [q . dq, k . dk] (of the prepared chunks, with a decay:
    `_Chunk.log_decay_cotangent`). The grid's last axis has `passes` programs per sequence
    (`_run_passes`): with 1 it runs every pass, with 2 the pass that gives dq and the one that
    gives the rest, with 3 the pass that gives dq, one that gives dk, d_s0 and d_z0 and one
    that gives dv (each of the last two walking back with the states' cotangents).

    With `walk_chunks` < `num_chunks`, `passes` programs a walk (`forward_kernel`'s walks):
    s0 and z0 hold the states entering each walk, d_s and d_z the cotangents of those leaving
    it ([walks * D, ...]: `backward_states_kernel`'s walks joined by `pallas.py`), and d_s0 and
    d_z0 are written at each walk's rows.

    eps None: no normaliser. Else d_out is the normalised output's cotangent, den the
    forward's, and d_den that of den (-sum_m d_out * out / (den + eps), made by `pallas.py`):
    num's cotangent is d_out / (den + eps), and den's, an implicit column of ones in v, adds
    d_den[t] to every kept score's cotangent and d_den[t] * z to q[t]'s state term; z's
    cotangent dz is carried beside dS. Only the first value block's programs take den's part
    of dq and dk (they are summed over the blocks); each computes the same d_z0."""
    normalize, refs = eps is not None, iter(refs)
    inputs, (s0_ref, z0_ref), (ds_ref, dz_ref), cotangents = _backward_operands(
        refs, C, has_decay, has_valid, has_segments, eps, chunk_options
    )
    dq_ref, dk_ref, dv_ref = next(refs), next(refs), next(refs)
    ds0_ref, dz0_ref = _state_refs(refs, normalize)
    dG_refs = list(refs) or [None, None]
    acc, D = chunk_options["acc"], inputs[0].shape[1]
    walk = _Walk.of(pl.program_id(3) // passes, walk_chunks, num_chunks, own_start=True)

    def forward(c, carry):  # dq, from the state entering each chunk
        S, z = _unpack(carry, normalize)
        chunk, do, dA, d_den = cotangents.load(c)
        _write_query_cotangent(chunk, c, C, do, dA, d_den, S, z, dq_ref, dG_refs[0])
        return _pack(*_carry_over_chunk(chunk, S, z))

    def query_pass():
        jax.lax.fori_loop(walk.first, walk.stop, forward, walk.start(s0_ref, z0_ref, D, acc))

    def walking_back(parts):  # dk and/or dv, from the last chunk to the first
        def visit(chunk, c, do, dA, d_den, dS, dz):
            refs = (dk_ref, dv_ref, dG_refs[1])
            _write_key_value_cotangents(chunk, c, C, do, dA, dS, dz, cotangents.first_block, refs, parts)

        final = (ds0_ref, dz0_ref) if "key" in parts else (None, None)
        return lambda: _walk_chunks_back(cotangents, (ds_ref, dz_ref), final, visit, walk)

    # program_id(3) itself where one walk makes the sequence: the kernels Triton compiles without
    # walks stay as they were (a remainder moves ptxas's register allocation).
    program = pl.program_id(3) % passes if walk.index is not None else pl.program_id(3)
    _run_passes(program, passes, query_pass, walking_back)


def backward_states_kernel(
    *refs, C, num_chunks, walk_chunks, has_decay, has_valid, has_segments, eps, write_chunks, **chunk_options
):
    """The parallel backward's first kernel (`pallas.Tuning.parallel_backward`), two programs a
    walk (the grid's last axis: the walks forward, then those back): refs: q, k, v, [g],
    [valid], [runs, before], s0, [z0], d_out, d_s, [den, d_den, d_z] (`backward_kernel`'s)
    -> states, [z states] (the states entering each chunk, as `chunk_states_kernel` writes
    them), d states, [dz states] (the cotangents of the states leaving each chunk, chunk c's
    at rows c * D), d_s0, [d_z0], and with several walks (`walk_chunks` < `num_chunks`) s,
    [z], [factors, totals] as `chunk_states_kernel` writes them, then [d factors]. The first
    program walks the chunks forward carrying the state, the second backward carrying its
    cotangent; neither makes a score or a gradient of q, k or v. With several walks each starts
    from s0 and z0, or d_s and d_z (zero: `pallas.py` joins the walks), d_s0 and d_z0 hold the
    cotangents of the states entering each walk [walks * D, ...], and d factors the factor each
    walk's last cotangent reaches the states leaving each of its chunks with.

    `write_chunks` False: nothing is written for each chunk (no states, d states, factors or d
    factors), only each walk's final states, total factor and first states' cotangents (the
    one-pass backward's walks: `backward_kernel`)."""
    normalize, refs = eps is not None, iter(refs)
    inputs, (s0_ref, z0_ref), (ds_ref, dz_ref), cotangents = _backward_operands(
        refs, C, has_decay, has_valid, has_segments, eps, chunk_options
    )
    states_ref, z_states_ref = _state_refs(refs, normalize) if write_chunks else (None, None)
    d_states_ref, dz_states_ref = _state_refs(refs, normalize) if write_chunks else (None, None)
    ds0_ref, dz0_ref = _state_refs(refs, normalize)
    walks = walk_count(walk_chunks, num_chunks)
    program = pl.program_id(3)
    walk = _Walk.of(program % walks, walk_chunks, num_chunks)
    s_ref, z_ref = _state_refs(refs, normalize) if walks > 1 else (None, None)
    factor_refs = _factor_refs(refs, walk, has_decay or has_segments, write_chunks)
    d_factors_ref = next(refs) if factor_refs is not None and write_chunks else None

    def states_pass():
        visit = _state_writer(states_ref, z_states_ref)
        finals = (s_ref, z_ref, None)
        _walk_chunks(inputs, (s0_ref, z0_ref), finals, visit, C, walk, chunk_options, factor_refs)

    write = _state_writer(d_states_ref, dz_states_ref)

    def write_cotangents(chunk, c, do, dA, d_den, dS, dz):
        write(chunk, c, dS, dz)

    def cotangents_pass():
        finals = (ds0_ref, dz0_ref)
        _walk_chunks_back(cotangents, (ds_ref, dz_ref), finals, write_cotangents, walk, d_factors_ref)

    pl.when(program < walks)(states_pass)
    pl.when(program >= walks)(cotangents_pass)


def chunk_gradients_kernel(
    *refs, C, num_chunks, walk_chunks, has_decay, has_valid, has_segments, eps, passes, **chunk_options
):
    """The parallel backward's second kernel: refs: q, k, v, [g], [valid], [runs, before],
    d_out, [den, d_den], states, [z states], d states, [dz states] (`backward_states_kernel`'s),
    [walks, [z walks], [factors], d walks, [dz walks], [d factors]] (`_Joins`, of the states
    and of their cotangents) -> dq, dk, dv, [q . dq, k . dk] (as `backward_kernel`'s).
    `passes` programs a chunk (the grid's last axis, `_run_passes`): one for all its
    gradients; or one for dq, from the states entering the chunk, and one for dk and dv, from
    the cotangents of those leaving it; or one each for dq, dk and dv. Every chunk's gradients
    at once."""
    normalize, refs = eps is not None, iter(refs)
    inputs = _split_refs(refs, has_decay, has_valid, has_segments)
    do_ref = next(refs)
    den_ref, dden_ref = (next(refs), next(refs)) if normalize else (None, None)
    cotangents = _OutputCotangents((do_ref, den_ref, dden_ref), inputs, C, eps, chunk_options)
    states_ref, z_states_ref = _state_refs(refs, normalize)
    d_states_ref, dz_states_ref = _state_refs(refs, normalize)
    options = dict(
        walk_chunks=walk_chunks,
        num_chunks=num_chunks,
        normalize=normalize,
        factored=has_decay or has_segments,
    )
    joins, d_joins = _Joins(refs, **options), _Joins(refs, **options)
    dq_ref, dk_ref, dv_ref = next(refs), next(refs), next(refs)
    dG_refs = list(refs) or [None, None]
    c = pl.program_id(3) // passes
    D, acc = inputs[0].shape[1], chunk_options["acc"]  # q's features

    def query_part():
        chunk, do, dA, d_den = cotangents.load(c)
        S, z = joins.chunk_state(states_ref, z_states_ref, c, D, acc)
        _write_query_cotangent(chunk, c, C, do, dA, d_den, S, z, dq_ref, dG_refs[0])

    def from_leaving(parts):  # dk and/or dv
        def part():
            chunk, do, dA, _ = cotangents.load(c)
            dS, dz = d_joins.chunk_state(d_states_ref, dz_states_ref, c, D, acc)
            refs = (dk_ref, dv_ref, dG_refs[1])
            _write_key_value_cotangents(chunk, c, C, do, dA, dS, dz, cotangents.first_block, refs, parts)

        return part

    _run_passes(pl.program_id(3) % passes, passes, query_part, from_leaving)


def _run_passes(program, passes: int, query, key_value):
    """The backward's parts that program `program` of `passes` runs (one, two or three programs
    a sequence, or a chunk in the parallel backward): every part; or dq, then dk and dv; or dq,
    then dk, then dv. `query()` gives dq, `key_value(parts)()` dk and/or dv (parts: "key",
    "value")."""
    if passes == 1:
        query()
        key_value(("key", "value"))()
        return
    pl.when(program == 0)(query)
    if passes == 2:
        pl.when(program == 1)(key_value(("key", "value")))
        return
    pl.when(program == 1)(key_value(("key",)))
    pl.when(program == 2)(key_value(("value",)))
