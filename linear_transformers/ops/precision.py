"""Contractions that accumulate in float32 whatever the inputs' precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum_in(acc, spec: str, *operands):
    """`jnp.einsum(spec, *operands)` accumulated and returned in `acc` (float32 for bf16 inputs).

    On GPU/TPU the operands stay in their dtype (`preferred_element_type`: bf16 tensor-core
    products, float32 sums). On CPU they are cast to `acc` first: XLA's CPU runtime has no
    bf16 x bf16 -> f32 kernel for the dots some layouts compile to (jax 0.10.2, under jit:
    "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"), and CPUs gain
    nothing from bf16 products.
    """
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, *(x.astype(jnp.promote_types(x.dtype, acc)) for x in operands))
    return jnp.einsum(spec, *operands, preferred_element_type=acc)
