"""The Pallas kernels of the "pallas" form: the chunked recurrence of one (batch, head) per
program, its state kept on chip from the first chunk to the last. Each chunk is loaded, prepared
and computed with by `pallas_chunk.Chunk` (its scores, its output from the state entering it,
the state leaving it, and their cotangents); here are the loops over the chunks, what each
kernel reads and writes, and the walks.

Legend: B batch, T time (a whole number of chunks), H heads, D key/query features (feature-map
features, after `prepare`), M value features, C chunk length, X decay features (1 or D).

Each program walks its sequence chunk by chunk with `lax.fori_loop`, carrying the [D, M] state
in float32 (float64 for float64 inputs).

The backward kernel recomputes what it needs: one pass forward over the chunks (carrying S)
gives dq; one pass backward (carrying dS, the cotangent of the state) gives dk, dv and the
initial state's cotangent. Nothing the size of the sequence is kept between the passes, which
share nothing but their inputs, so they may run in programs of their own
(`pallas.Tuning.split_backward`; with `split_key_value` the backward pass runs twice, in
programs of its own for dk and for dv). Each cotangent goes back through the chunk's preparation
before it is written.

With a decay the passes also write the decays' cotangent within each chunk, as FLA's chunk
kernels form it: for a step t of chunk c, q . dq (of the scores and of the reads of the state
entering the chunk) less k . dk (of the scores alone) of the prepared chunk, each summed from t
to the end of its segment in the chunk, plus what t's decay gives through the state leaving the
chunk: k . dk of the keys before t, of dk's part through that state
(`Chunk.through_leaving_state`), and, for every step, the state carried through the chunk
times the cotangent of the one leaving it (`carried_product`). Nothing is summed across
chunks: a sum over the later chunks of q . dq less k . dk, and the final state times its
cotangent, give the same in exact arithmetic, but their terms cancel, and rounded (a state
rounded for the products against its rounded cotangent) they leave errors many times a small
gradient (bfloat16 products, a strong decay per head: 28 for a true 0.02). The carried state
and its cotangent are in different passes of the one-pass backward: its forward pass writes
the state each chunk carries over and its backward pass the cotangent of the state leaving
each chunk, for `pallas_backward.py` to multiply; the parallel backward's programs have both.

The parallel forms (`pallas.Tuning.parallel_forward`, `parallel_backward`) cut each loop down
to the state's update: a loop writes the state entering every chunk (backward, a second loop
the cotangent of the state leaving every chunk), and then one program per chunk makes its
output (`chunk_outputs_kernel`) or its gradients (`chunk_gradients_kernel`) from them, with
the same per-chunk functions as the one-pass kernels. With `pallas.Tuning.walks` the loop is
cut into walks over stretches of the sequence, a program each, each from a zero state: S
entering chunk c is then what its walk wrote plus the state entering the walk (joined by
`pallas_walks.py` from each walk's final state and total factor) carried to c, rows scaled by the
factor the walk wrote for c, the product of the chunks' decays since the walk's start (0 past a
segment's start): `carry_over_normaliser` applied to a row of ones, chunk by chunk (`_Joins`).
Backward the same holds for the cotangents, from the end of each walk. The one-pass kernels
walk in stretches the same way, each stretch's program from the state entering it (and,
backward, the cotangent of the state leaving it), which `pallas_walks.py` joins from a first walk of
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

from linear_transformers.ops.gated_linear.pallas_chunk import Chunk, times


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
    last chunk), [z, den], clean (`Chunk.clean` of every chunk: int32 1 or 0).

    With `walk_chunks` < `num_chunks` each sequence is walked in stretches of that many chunks,
    one program a walk (the grid's last axis, `_Walk`), each from the state entering its walk
    (s0 and z0 hold each walk's, [walks * D, ...]: `chunk_states_kernel`'s walks joined by
    `pallas_walks.py`); s, z and clean are each walk's, at its rows and its entry.

    eps None: no normaliser. Else the normaliser runs in the same program, its state z [1, D]
    carried beside S as an implicit column of ones in v: den[t] = the scores' row sum +
    q_in[t] . z, and out = num / (den + eps), written in out's dtype; den (float32 [T]) is
    kept for the backward. Programs of other value blocks compute the same z and den and write
    the same values. `chunk_options`: per_feature, acc, prepare, features (`Chunk`)."""
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
    `initial_refs`; then the states after the last chunk and the guard's flag (`Chunk.clean`
    of every chunk) written to (s, z, clean) in `final_refs` (all None: not written; s and z
    at the walk's rows). `factor_refs` (factors, total; None: none): the factor each of the
    walk's first state's rows reaches chunk c with, written at rows c * D of factors [num chunks
    * D], and the one it leaves the walk with to total (`pallas_walks.Walks`)."""
    (s0_ref, z0_ref), (s_ref, z_ref, clean_ref) = initial_refs, final_refs
    normalize, acc = z0_ref is not None, chunk_options["acc"]
    D = inputs[0].shape[1]  # q's features

    def body(c, carry):
        (S, z), clean, factor = _unpack(carry[0], normalize), carry[1], carry[2]
        chunk = Chunk(c, inputs, C, **chunk_options)
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
    one program a walk (the grid's last axis, `_Walk`), each from s0 and z0 (zero:
    `pallas_walks.py` joins the walks): the states each writes are its own, s and z hold each
    walk's final ones [walks * D, ...], and with a decay or segments each walk writes the
    factor its first state reaches each of its chunks with (factors [num_chunks * D]) and
    leaves it with (totals [walks * D]), which `_Joins` reads.

    `write_chunks` False: neither the states entering each chunk, the factors to each chunk
    nor clean are written, only each walk's final states and total factor (the one-pass
    kernels' walks, which start from their joined states: `forward_kernel`, whose programs
    write clean)."""
    normalize, refs = eps is not None, iter(refs)
    inputs = _split_refs(refs, has_decay, has_valid, has_segments)
    s0_ref, z0_ref = _state_refs(refs, normalize)
    states_ref, z_states_ref = _state_refs(refs, normalize) if write_chunks else (None, None)
    s_ref, z_ref = _state_refs(refs, normalize)
    walk = _Walk.of(pl.program_id(3), walk_chunks, num_chunks)
    factor_refs = _factor_refs(refs, walk, has_decay or has_segments, write_chunks)
    clean_ref = next(refs) if write_chunks else None
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
    (`Chunk.dot`) where they round it (`pallas.Config.products`), as the chunks' programs use
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
    walks' joined in XLA, `pallas_walks.py`) and, with a decay or segments, the factor each reaches
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
        S = S.astype(acc) + times(walks_ref[first, :].astype(acc), _column(factor))
        if z is not None:
            z = z + times(z_walks_ref[first][None, :], factor)
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
    chunk = Chunk(c, inputs, C, **chunk_options)
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
        chunk = Chunk(c, self.inputs, C, **self.chunk_options)
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
    (z None without a normaliser), written to dq_ref, with q . dq to dG_ref (None: no decay;
    dq there without each step's own score's part, `off_diagonal`)."""
    rows = pl.ds(c * C, C)
    if dG_ref is not None:
        dA, own = off_diagonal(dA)
    dq = chunk.query_cotangent(dA)  # first: the order Triton schedules in, and spills least
    entering = chunk.dot(do, S, trans_b=True)
    if z is not None:
        entering = entering + d_den * z
    dq = dq + times(entering, chunk.into)
    if dG_ref is not None:
        dG_ref[rows] = chunk.log_decay_cotangent(chunk.q, dq)
        dq = dq + own * chunk.k
    dq_ref[rows, :] = chunk.raw_cotangent("q", dq).astype(dq_ref.dtype)


def _write_key_value_cotangents(chunk, c, C: int, do, dA, dS, dz, first_block, refs, parts, entering=None):
    """Chunk c's dk and dv, or one of them (`parts`: "key" and/or "value"), from its cotangents
    and those of the states leaving it (dz None without a normaliser; its part of dk taken in
    the first value block's programs only), written to refs (dk, dv, and with a decay the key
    side of the decays' cotangent: k . dk of dk's part from the scores, without each step's
    own score's (`off_diagonal`), less what the decays give through the state leaving the
    chunk, `Chunk.through_leaving_state`, with the carried state's part where `entering`, the
    states entering the chunk (S, z), is not None)."""
    dk_ref, dv_ref, dG_ref = refs
    rows = pl.ds(c * C, C)
    key, value = "key" in parts, "value" in parts
    # In this order (dv's products first, dk written first) ptxas allocates best when a program
    # makes both with bfloat16 products (dv made and written first: 22 more registers without a
    # decay; with TF32 products both orders spill within 28 bytes: BENCHMARKS.md).
    if value:
        dv = chunk.dot(chunk.scores(), do, trans_a=True) + chunk.dot(chunk.k_out, dS)
    if key:
        if dG_ref is not None:
            dA, own = off_diagonal(dA)
        dk = chunk.key_cotangent(dA)
        if dG_ref is not None:
            dG = chunk.log_decay_cotangent(chunk.k, dk)
        leaving = chunk.dot(chunk.v, dS, trans_b=True)
        if dz is not None:
            leaving = leaving + dz * first_block
        leaving = times(leaving, chunk.out_of)
        dk = dk + leaving
        if dG_ref is not None:
            carried = None if entering is None else carried_product(chunk, *entering, dS, dz, first_block)
            dG_ref[rows] = dG - chunk.through_leaving_state(chunk.k * leaving, carried)
            dk = dk + own * chunk.q
        dk_ref[rows, :] = chunk.raw_cotangent("k", dk).astype(dk_ref.dtype)
    if value:
        dv_ref[rows, :] = chunk.raw_cotangent("v", dv).astype(dv_ref.dtype)


def carried_product(chunk, S, z, dS, dz, first_block):
    """[1, D]: sum_m of the state the chunk carries over from the one entering it (S, z: z
    None without a normaliser; its part in the first value block's programs only) times the
    cotangent of the state leaving it (dS, dz), per feature: its decays' cotangent through the
    state carried through it (0 where a segment starts in it)."""
    product = jnp.transpose(jnp.sum(chunk.carry_over(S.astype(dS.dtype)) * dS, axis=1, keepdims=True))
    if z is not None:
        product = product + chunk.carry_over_normaliser(z) * dz * first_block
    return product


def off_diagonal(dA):
    """(dA with its diagonal 0, its diagonal [C, 1]): the scores' cotangent without each
    step's own score q[t] . k[t], and that score's cotangent. Its part of q[t] . dq[t] and of
    k[t] . dk[t] is the same, so it cancels in the decays' cotangent, their difference
    (`Chunk.log_decay_cotangent`), exactly only where neither holds it: rounded in each, where
    strong decays make the difference small (and a decay per head sums it over every step),
    the rounding would be most of it (float32, a head decaying by exp(-12) a step: 1.4 times
    its gradient). dq and dk take the diagonal's part after (its decay is exp(0) = 1)."""
    rows, columns = (jax.lax.broadcasted_iota(jnp.int32, dA.shape, axis) for axis in (0, 1))
    diagonal = rows == columns
    return jnp.where(diagonal, 0, dA), jnp.sum(jnp.where(diagonal, dA, 0), axis=1, keepdims=True)


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
    -> dq, dk, dv, d_s0, [d_z0], with a decay [the query and key sides of the decays' cotangent
    (`_write_query_cotangent`, `_write_key_value_cotangents`), carried, [z carried], leaving,
    [z leaving]] (the state each chunk carries over, `Chunk.carry_over`, and the cotangent of
    the state leaving it, chunk c's at rows c * D: `carried_product`'s factors). The grid's
    last axis has `passes` programs per sequence (`_run_passes`): with 1 it runs every pass,
    with 2 the pass that gives dq and the one that gives the rest, with 3 the pass that gives
    dq, one that gives dk, d_s0 and d_z0 (and, with a decay, leaving) and one that gives dv
    (each of the last two walking back with the states' cotangents).

    With `walk_chunks` < `num_chunks`, `passes` programs a walk (`forward_kernel`'s walks):
    s0 and z0 hold the states entering each walk, d_s and d_z the cotangents of those leaving
    it ([walks * D, ...]: the forward's walks and `backward_states_kernel`'s, joined by
    `pallas_walks.py`), and d_s0 and d_z0 are written at each walk's rows.

    eps None: no normaliser. Else d_out is the normalised output's cotangent, den the
    forward's, and d_den that of den (-sum_m d_out * out / (den + eps), made by
    `pallas_backward.py`): num's cotangent is d_out / (den + eps), and den's, an implicit
    column of ones in v, adds d_den[t] to every kept score's cotangent and d_den[t] * z to
    q[t]'s state term; z's cotangent dz is carried beside dS. Only the first value block's
    programs take den's part of dq and dk (they are summed over the blocks); each computes the
    same d_z0."""
    normalize, refs = eps is not None, iter(refs)
    inputs, (s0_ref, z0_ref), (ds_ref, dz_ref), cotangents = _backward_operands(
        refs, C, has_decay, has_valid, has_segments, eps, chunk_options
    )
    dq_ref, dk_ref, dv_ref = next(refs), next(refs), next(refs)
    ds0_ref, dz0_ref = _state_refs(refs, normalize)
    dG_refs, write_carried, write_leaving = [None, None], _state_writer(None, None), _state_writer(None, None)
    if has_decay:
        dG_refs = [next(refs), next(refs)]
        write_carried = _state_writer(*_state_refs(refs, normalize))
        write_leaving = _state_writer(*_state_refs(refs, normalize))
    acc, D = chunk_options["acc"], inputs[0].shape[1]
    walk = _Walk.of(pl.program_id(3) // passes, walk_chunks, num_chunks, own_start=True)

    def forward(c, carry):  # dq, from the state entering each chunk
        S, z = _unpack(carry, normalize)
        chunk, do, dA, d_den = cotangents.load(c)
        _write_query_cotangent(chunk, c, C, do, dA, d_den, S, z, dq_ref, dG_refs[0])
        write_carried(chunk, c, chunk.carry_over(S), None if z is None else chunk.carry_over_normaliser(z))
        return _pack(*_carry_over_chunk(chunk, S, z))

    def query_pass():
        jax.lax.fori_loop(walk.first, walk.stop, forward, walk.start(s0_ref, z0_ref, D, acc))

    def walking_back(parts):  # dk and/or dv, from the last chunk to the first
        def visit(chunk, c, do, dA, d_den, dS, dz):
            refs = (dk_ref, dv_ref, dG_refs[1])
            _write_key_value_cotangents(chunk, c, C, do, dA, dS, dz, cotangents.first_block, refs, parts)
            if "key" in parts:
                write_leaving(chunk, c, dS, dz)

        final = (ds0_ref, dz0_ref) if "key" in parts else (None, None)
        return lambda: _walk_chunks_back(cotangents, (ds_ref, dz_ref), final, visit, walk)

    # program_id(3) itself where one walk makes the sequence: the kernels Triton compiles without
    # walks stay as they were (a remainder moves ptxas's register allocation).
    program = pl.program_id(3) % passes if walk.index is not None else pl.program_id(3)
    _run_passes(program, passes, query_pass, walking_back)


def backward_states_kernel(
    *refs,
    C,
    num_chunks,
    walk_chunks,
    has_decay,
    has_valid,
    has_segments,
    eps,
    write_chunks,
    walk_states=True,
    **chunk_options,
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
    from s0 and z0, or d_s and d_z (zero: `pallas_walks.py` joins the walks), d_s0 and d_z0 hold the
    cotangents of the states entering each walk [walks * D, ...], and d factors the factor each
    walk's last cotangent reaches the states leaving each of its chunks with.

    `write_chunks` False: nothing is written for each chunk (no states, d states, factors or d
    factors), only each walk's final states, total factor and first states' cotangents (the
    one-pass backward's walks: `backward_kernel`). `walk_states` False (with `write_chunks`
    False): the states entering each walk are known (the one-pass forward's joined ones), so
    one program a walk walks back and writes only d_s0 and [d_z0]."""
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
    s_ref, z_ref = _state_refs(refs, normalize) if walks > 1 and walk_states else (None, None)
    factor_refs = _factor_refs(refs, walk, walk_states and (has_decay or has_segments), write_chunks)
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

    if not walk_states:
        cotangents_pass()
        return
    pl.when(program < walks)(states_pass)
    pl.when(program >= walks)(cotangents_pass)


def chunk_gradients_kernel(
    *refs, C, num_chunks, walk_chunks, has_decay, has_valid, has_segments, eps, passes, **chunk_options
):
    """The parallel backward's second kernel: refs: q, k, v, [g], [valid], [runs, before],
    d_out, [den, d_den], states, [z states], d states, [dz states] (`backward_states_kernel`'s),
    [walks, [z walks], [factors], d walks, [dz walks], [d factors]] (`_Joins`, of the states
    and of their cotangents) -> dq, dk, dv, [the decays' cotangent's query and key sides] (as
    `backward_kernel`'s, the key side with the carried state's part).
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
            entering = None
            if has_decay and "key" in parts:  # for the decays' cotangent
                entering = joins.chunk_state(states_ref, z_states_ref, c, D, acc)
            refs = (dk_ref, dv_ref, dG_refs[1])
            _write_key_value_cotangents(
                chunk, c, C, do, dA, dS, dz, cotangents.first_block, refs, parts, entering
            )

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
