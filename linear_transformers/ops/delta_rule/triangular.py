"""The inverse of a unit lower-triangular matrix, (I + A)^-1 with A strictly lower triangular,
by forward substitution in jnp, with its gradient in closed form.

Legend: C the matrix size (a chunk's steps); `x` in a suffix: any leading (batch) shape.

Why not `lax.linalg.triangular_solve`: on CPU it calls LAPACK's trsm through an FFI handler
that fans a batch out into XLA's intra-op thread pool from a thread of that same pool and
blocks on it (jaxlib 0.10.2, `jax::ParallelBatchMap`). Two such solves scheduled at once on a
machine with two threads wait on each other for ever: the chunked delta rule's forward and
backward solves do, on a 2-core CPU, after a few calls. Substitution row by row is the same
arithmetic as trsm, C - 1 batched vector-matrix products, and runs anywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_transformers.ops import precision
from linear_transformers.ops import sequence_parallel as sp


@jax.custom_vjp
def unit_lower_inverse(a_xCC):
    """(I + A)^-1 for A [..., C, C] strictly lower triangular (entries on and above the diagonal
    are ignored): row i of the inverse is e_i - A[i, :i] times the rows before it."""
    C = a_xCC.shape[-1]
    a_xCC = jnp.tril(a_xCC, -1)
    eye = jnp.broadcast_to(jnp.eye(C, dtype=a_xCC.dtype), a_xCC.shape)

    def row(i, inverse_xCC):
        a_xC = jax.lax.dynamic_index_in_dim(a_xCC, i, axis=-2, keepdims=False)
        new_xC = jax.lax.dynamic_index_in_dim(eye, i, axis=-2, keepdims=False) - jnp.einsum(
            "...c,...cd->...d", a_xC, inverse_xCC, precision=precision.EXACT
        )
        return jax.lax.dynamic_update_index_in_dim(inverse_xCC, new_xC, i, axis=-2)

    return jax.lax.fori_loop(1, C, row, sp.vary_like(eye, a_xCC))


def _forward(a_xCC):
    inverse_xCC = unit_lower_inverse(a_xCC)
    return inverse_xCC, inverse_xCC


def _backward(inverse_xCC, cotangent_xCC):
    # d(L^-1) = -L^-1 dL L^-1, so dA = -(L^-T G L^-T) on the strictly lower part A lives on.
    t = jnp.swapaxes(inverse_xCC, -1, -2)
    grad = -jnp.einsum("...ij,...jk,...kl->...il", t, cotangent_xCC, t, precision=precision.EXACT)
    return (jnp.tril(grad, -1),)


unit_lower_inverse.defvjp(_forward, _backward)
