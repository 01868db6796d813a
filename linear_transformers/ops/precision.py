"""The library's precision policy, and the contractions that carry it out.

Matrix products follow JAX's convention: they run at `jax.default_matmul_precision`, whose
default is each platform's fast float32 mode. For float32 inputs that is full float32 on a CPU,
TF32 (inputs rounded to 10 mantissa bits, products summed in float32) on NVIDIA GPUs from
Ampere on, and bfloat16 passes on TPUs: about 1e-3 relative error per product on a GPU. Wrap a
call in `with jax.default_matmul_precision("highest"):` (or set `JAX_DEFAULT_MATMUL_PRECISION=
highest`) for float32 products everywhere. bfloat16 and float16 inputs multiply in their own
dtype and accumulate in float32 (`einsum_in`). In a bfloat16 call the gated family's Pallas
kernels round their float32 scores and states to bfloat16 for each product too, while the
precision asks for no more than a bfloat16 pass; at TF32 they round each float32 operand to the
nearest TF32 value (`round_to_tf32`), which Triton's TF32 products would truncate
(`gated_linear/pallas.products`).

What the matmul precision never touches, on any platform:

- states and normalisers (s = sum phi(k) v^T, z = sum phi(k)) and KV-cache softmax statistics
  are carried between chunks, steps and devices in float32 (float64 for float64 inputs) and
  added with float32 additions;
- softmax's maximum and sum, and LayerNorm's mean and variance, are float32 reductions;
- sums written as products with a 0/1 matrix (the decays' cumulative log sums, which XLA runs
  faster as a matmul than as `cumsum`) are pinned to `EXACT`: rounding a log decay of 30 to
  TF32 would change its decay by 1.5%; the Pallas kernels take them in three bfloat16 parts on
  tensor cores, as exact (`gated_linear/pallas_chunk.sums`);
- products that make a discrete choice are pinned to `EXACT` too: LSH's hash projections, so
  that every platform puts a key in the same bucket (at TF32 some keys changed buckets, and
  their outputs by far more than rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The precision of the matmuls above that must not round their inputs, whatever
# `jax.default_matmul_precision` says.
EXACT = jax.lax.Precision.HIGHEST


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


def round_to_tf32(x_f32):
    """float32 -> float32 holding the nearest TF32 value (8 exponent bits, 10 significand bits;
    ties away from zero, as CUDA's `cvt.rna.tf32.f32`); NaN and inf kept. An
    NVIDIA tensor core's TF32 product reads the TF32 part of a float32 operand as it is, the 13
    low bits ignored (truncated: Triton's TF32 products), where this rounds it first. Integer
    operations on the bits, which Pallas also lowers to Triton (`lax.reduce_precision` has no
    Triton lowering)."""
    bits = jax.lax.bitcast_convert_type(x_f32, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)
    return jnp.where(jnp.isnan(x_f32), x_f32, rounded)
