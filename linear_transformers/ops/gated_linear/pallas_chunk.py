"""One chunk of the Pallas kernels (`pallas_kernels.py`): its inputs loaded and prepared
(`inputs.Preparation`: feature map, scale, the keys that do not count, the finite part of v and
g, where `pallas.py` leaves that to the kernels), its masks and decays, and what it does to the
state and its cotangent (`Chunk`).

Legend: B batch, T time (a whole number of chunks), D key/query features (feature-map
features, after `prepare`), M value features, C chunk length, X decay features (1 or D).

Within a chunk, with L[t, s] the log decays summed over (s, t], P[t] those up to t and Q[s]
those after s (within the chunk), and Gamma their total:

  A[t, s]   = sum_x q[t] k[s] exp(L[t, s, x])              t >= s, same segment (else 0)
  out[t]    = A[t] @ v + reads[t] * (q[t] * exp(P[t])) @ S
  S        <- survives * exp(Gamma) * S + (tail * k * exp(Q))^T @ v

`reads[t]`: no segment began in the chunk up to t (the query reads the state carried in);
`tail[s]`: s is in the chunk's last segment (it reaches the state carried out); `survives`: no
segment began in the chunk. Segments come in as two int32 [B, T] counts of segment starts, up to
and including t (`runs`) and before t (`before`); without segments neither is passed. The keys
that count come in as an int32 [B, T] (`valid`, nonzero: counts) where some do not.

Every sum of log decays is a sum of same-sign terms (a cumulative sum, or a product with a 0/1
matrix at float32's full precision on tensor cores: `sums`), never the difference of two running
sums, and every exponent is <= 0: exact and finite whatever the decays, as the XLA forms are
(`totals.py`). With a decay per feature a chunk's scores are, as in the chunked form
(`chunk_scores.py`), one matmul of q and k rescaled from the chunk's midpoint where its decays
stay within exp(+-FACTOR_RANGE) of it (exact to a relative eps * FACTOR_RANGE), else every
pair's decay on its own (`lax.cond` per chunk): a loop over the chunk's keys, each with its
decays to every later step of the chunk, [C, D] at a time, where all the pairs' decays at once
would be [C, C, D] (FLA's GLA kernels loop over the keys of a chunk's diagonal blocks the same
way); so a decay per feature takes the chunks the others take.

Only what Pallas lowers to Triton, and Triton compiles, is used here (no value slicing, 2-D
matmuls, forward `cumsum` of [C, D] blocks only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from linear_transformers.ops.gated_linear.chunk_scores import FACTOR_RANGE
from linear_transformers.ops.precision import EXACT, round_to_tf32


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


class Chunk:
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
                suffix = sums(after, g)
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
        self.q_in = times(self.q, self.into)
        self.k_out = times(self.k, self.out_of)

    def operand(self, x):
        """x as the matrix products take it (`pallas.products`): cast to bfloat16, rounded to
        TF32 (`precision.round_to_tf32`; Triton would hand the tensor cores the float32 bits,
        of which they read the TF32 part, truncated), or as it is."""
        if self.products == "bfloat16":
            return x.astype(jnp.bfloat16)
        if self.products == "tensorfloat32":
            return round_to_tf32(x)
        return x

    def dot(self, a, b, *, trans_a=False, trans_b=False):
        """a @ b (each transposed as asked), summed in float32 (float64 for float64 inputs), of
        the operands as the products take them (`operand`)."""
        return pltriton.dot(self.operand(a), self.operand(b), trans_a=trans_a, trans_b=trans_b)

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
        """x . dx of a prepared chunk and its cotangent (dx without each step's own score's
        part, `pallas_kernels.off_diagonal`), summed at and after each step within the chunk
        and the step's segment: per feature [C, D], or summed over the features too [C] with
        a decay per step."""
        keep = self.keep  # [i, t]: i >= t in t's segment
        if self.per_feature:
            return sums(keep, x * dx, transpose=True)
        # x as the scores' products took it: each pair's part of q . dq and of k . dk is then
        # the same product, and cancels, where x unrounded would leave its rounding
        x = self.operand(x).astype(x.dtype)
        return jnp.sum(jnp.where(keep, jnp.sum(x * dx, axis=1, keepdims=True), 0), axis=0)

    def through_leaving_state(self, k_leaving, carried):
        """What each step's log decay gives through the state leaving the chunk, per feature
        [C, D] or per step [C]: the decay scales every key written to it before the step
        (`k_leaving` [C, D], k * dk of dk's part through that state, 0 outside the chunk's last
        segment, summed over the keys before each step: those terms alone, never all of them
        less those at and after the step, whose rounding a strong decay's small sum would not
        survive) and the state carried through the chunk (`carried` [1, D],
        `pallas_kernels.carried_product`; None: added after the kernel)."""
        C = k_leaving.shape[0]
        earlier = jnp.transpose(_later(C))  # [t, j]: j < t
        if self.per_feature:
            # At the products' precision: terms of their own, not a difference to keep exact
            through = self.dot(earlier.astype(k_leaving.dtype), k_leaving)
            return through if carried is None else through + carried
        keys = jnp.transpose(jnp.sum(k_leaving, axis=1, keepdims=True))  # [1, C]
        through = jnp.sum(jnp.where(earlier, keys, 0), axis=1)
        return through if carried is None else through + jnp.sum(carried)

    def _step_pair_decays(self):
        """exp(L[t, s]) where kept, else 0, [C, C], with one decay per step: L[t, s] = sum_i
        [i <= t] g[i] [i > s], the log decays in (s, t] as a product with a 0/1 matrix at full
        precision (`sums`): a sum of same-sign terms, never a difference of two running sums,
        which would lose eps * |sum|."""
        C = self.g.shape[0]
        i = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
        s = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
        L = sums(_upto(C), jnp.where(i > s, self.g, 0))  # [t, i] @ [i, s]
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
    return sums(signed, g)


def sums(mask, x, *, transpose: bool = False):
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


def times(x, factor):
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
