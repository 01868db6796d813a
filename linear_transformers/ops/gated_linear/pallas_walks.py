"""The walks over each sequence's chunks in stretches (`pallas.Tuning.walks`): how many, of
how many chunks, the outputs their kernels write, and their join in XLA.

Legend: B batch, H heads, D key/query features, M value features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops.gated_linear import pallas_kernels, totals


class Walks:
    """The walks over the chunks of each sequence (`pallas.Tuning.walks`): `count` of
    `chunks` chunks each (the last may have fewer); `joined`: more than one, each from zero,
    joined here; `factored`: each has factors to write (a decay or segments)."""

    def __init__(self, config, num_chunks: int, g, runs):
        self.chunks = -(-num_chunks // min(config.tuning.walks, num_chunks))
        self.count = pallas_kernels.walk_count(self.chunks, num_chunks)
        self.joined = self.count > 1
        self.factored = self.joined and (g is not None or runs is not None)
        self.num_chunks, self.acc = num_chunks, config.acc

    def starts(self, s0, z0):
        """The states every walk starts from: (s0, z0), or zeros where the walks are joined."""
        if not self.joined:
            return s0, z0
        return jnp.zeros_like(s0), None if z0 is None else jnp.zeros_like(z0)

    def finals(self, s0, z0):
        """The outputs of each walk's final states, [B, H, walks * D(, M)], (s0, z0)'s layouts."""
        B, H, D, M = s0.shape
        finals = [(jax.ShapeDtypeStruct((B, H, self.count * D, M), s0.dtype), "state")]
        if z0 is not None:
            finals += [(jax.ShapeDtypeStruct((B, H, self.count * D), z0.dtype), "row")]
        return finals

    def factors(self, s0, *, backward: bool = False, chunks: bool = True):
        """The outputs of the factors the walks write: [each walk's first state's to each chunk
        (`chunks`), and out of the walk], [backward: each walk's last cotangent's to each
        chunk]."""
        if not self.factored:
            return []
        B, H, D, _ = s0.shape
        row = lambda n: (jax.ShapeDtypeStruct((B, H, n * D), self.acc), "row")  # noqa: E731
        if backward:
            return [row(self.num_chunks)]
        return [row(self.num_chunks), row(self.count)] if chunks else [row(self.count)]

    def join(self, first, finals, factors, dtype, *, reverse: bool = False):
        """(each walk's first states: (s [B, H, walks * D, M] in `dtype`, z [B, H, walks * D]
        or None), the last walk's final states), from the sequence's first states `first`
        (s0, z0), each walk's final states from zero `finals` and `factors` (`factors()`'s:
        the totals last). Reverse: the walks from the last (the states' cotangents: `first`
        the final states', the result's last the initial states').

        A fold over the walks, as `block.py` folds the devices' blocks: elementwise, so XLA
        makes each result in one fusion (compiled for a CPU at eight walks: two without a
        normaliser, where `totals.scan_totals`'s associative scan takes fourteen)."""
        (s0, z0), (s, z) = first, finals
        B, H, D, M = s0.shape

        def walk(x, w, *rest):  # walk w's [B, H, D, ...] of x [B, H, walks * D, ...]
            return None if x is None else x.reshape(B, H, self.count, D, *rest)[:, :, w]

        state, starts = (s0, z0), [None] * self.count
        for w in reversed(range(self.count)) if reverse else range(self.count):
            starts[w] = state
            a = walk(factors[-1], w) if self.factored else None
            state = totals.apply_totals(state, (a, None, walk(s, w, M), walk(z, w)))
        s_first = jnp.stack([x for x, _ in starts], axis=2).reshape(B, H, self.count * D, M)
        z_first = None if z0 is None else jnp.stack([x for _, x in starts], axis=2).reshape(B, H, -1)
        return (s_first.astype(dtype), z_first), state

    @staticmethod
    def join_operands(first, factors):
        """The operands `pallas_kernels._Joins` reads: each walk's first states (`join`'s) and
        [the factors to each chunk]."""
        s_first, z_first = first
        operands = [(s_first, "state")] + ([(z_first, "row")] if z_first is not None else [])
        return operands + [(f, "row") for f in factors]
