"""The inverse of a unit lower-triangular matrix, (I + A)^-1 with A strictly lower triangular:
forward substitution inside diagonal blocks, then blocks merged pairwise, with its gradient in
closed form.

Legend: C the matrix size (a chunk's steps), b the block size, n blocks; `x` in a suffix: any
leading (batch) shape.

Why not `lax.linalg.triangular_solve`: on CPU it calls LAPACK's trsm through an FFI handler
that fans a batch out into XLA's intra-op thread pool from a thread of that same pool and
blocks on it (jaxlib 0.10.2, `jax::ParallelBatchMap`). Two such solves scheduled at once on a
machine with two threads wait on each other for ever: the chunked delta rule's forward and
backward solves do, on a 2-core CPU, after a few calls.

Why blocks: substitution over all C rows reads the whole [C, C] inverse at every row, C^3
memory traffic in C small steps (at C = 64 it took most of the chunked forward). Substituting
inside b x b diagonal blocks reads b^3 per block; two inverted neighbours X0, X1 of the lower
triangle [[L0, 0], [L10, L1]] merge by [[X0, 0], [-X1 L10 X0, X1]]: log2(C / b) levels of
matmuls. The same arithmetic FLA's `solve_tril` uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import precision
from linear_transformers.ops import sequence_parallel as sp

BLOCK_SIZE = 16


def _substitute(a_xCC):
    """(I + A)^-1 by forward substitution: row i is e_i - A[i, :i] times the rows before it."""
    C = a_xCC.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(C, dtype=a_xCC.dtype), a_xCC.shape)

    def row(i, inverse_xCC):
        a_xC = jax.lax.dynamic_index_in_dim(a_xCC, i, axis=-2, keepdims=False)
        new_xC = jax.lax.dynamic_index_in_dim(eye, i, axis=-2, keepdims=False) - jnp.einsum(
            "...c,...cd->...d", a_xC, inverse_xCC, precision=precision.EXACT
        )
        return jax.lax.dynamic_update_index_in_dim(inverse_xCC, new_xC, i, axis=-2)

    return jax.lax.fori_loop(1, C, row, sp.vary_like(eye, a_xCC))


def _inverse(a_xCC, block_size):
    C = a_xCC.shape[-1]
    a_xCC = jnp.tril(a_xCC, -1)
    if C <= block_size:
        return _substitute(a_xCC)
    n = 1 << (-(-C // block_size) - 1).bit_length()  # Blocks, a power of two: zero rows pad A.
    size = n * block_size
    a_xSS = jnp.pad(a_xCC, [(0, 0)] * (a_xCC.ndim - 2) + [(0, size - C)] * 2)

    def block(r, c, s):  # A's block of rows r*s:(r+1)*s and columns c*s:(c+1)*s.
        return a_xSS[..., r * s : (r + 1) * s, c * s : (c + 1) * s]

    inverse_xnbb = _substitute(jnp.stack([block(i, i, block_size) for i in range(n)], axis=-3))
    s = block_size
    while n > 1:
        x0, x1 = inverse_xnbb[..., 0::2, :, :], inverse_xnbb[..., 1::2, :, :]
        l10 = jnp.stack([block(2 * m + 1, 2 * m, s) for m in range(n // 2)], axis=-3)
        x10 = -jnp.einsum("...ij,...jk,...kl->...il", x1, l10, x0, precision=precision.EXACT)
        top = jnp.concatenate([x0, jnp.zeros_like(x0)], axis=-1)
        inverse_xnbb = jnp.concatenate([top, jnp.concatenate([x10, x1], axis=-1)], axis=-2)
        n, s = n // 2, 2 * s
    return inverse_xnbb[..., 0, :C, :C]


@jax.custom_vjp
def unit_lower_inverse(a_xCC):
    """(I + A)^-1 for A [..., C, C] strictly lower triangular (entries on and above the diagonal
    are ignored)."""
    return _inverse(a_xCC, BLOCK_SIZE)


def _forward(a_xCC):
    inverse_xCC = unit_lower_inverse(a_xCC)
    return inverse_xCC, inverse_xCC


def _backward(inverse_xCC, cotangent_xCC):
    # d(L^-1) = -L^-1 dL L^-1, so dA = -(L^-T G L^-T) on the strictly lower part A lives on.
    t = jnp.swapaxes(inverse_xCC, -1, -2)
    grad = -jnp.einsum("...ij,...jk,...kl->...il", t, cotangent_xCC, t, precision=precision.EXACT)
    return (jnp.tril(grad, -1),)


unit_lower_inverse.defvjp(_forward, _backward)
