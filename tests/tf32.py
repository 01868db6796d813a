"""TF32 matrix products on a CPU: what float32 inputs get on an NVIDIA GPU, checked without one.

On NVIDIA GPUs (Ampere and later) JAX's default precision for a float32 matrix product rounds
both operands to TF32 (8 exponent bits, 10 mantissa bits) and sums the products in float32.
XLA's CPU backend ignores the precision and multiplies in float32, so a tolerance meant to hold
on a GPU cannot fail here. `install()` makes it fail where it would: under
`jax.default_matmul_precision("tensorfloat32")` (which binds every product left at the default
precision as `Precision.HIGH`, TF32 on a GPU) every CPU `dot_general` at HIGH rounds its float32
operands to TF32 first (to nearest: `linear_transformers.ops.precision.round_to_tf32`).

It works at lowering (`mlir.register_lowering` for the CPU platform, wrapping JAX's own rule),
so every product is covered, those inside `jnp.einsum`, `@` and `tensordot` included; no public
JAX API rounds the operands of products it did not create. The precision is part of JAX's
compilation cache key, so a function compiled under the emulation is never reused outside it.
On a GPU the same context gives the real TF32 products and `install()` does nothing.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import mlir
from jax._src.lax import lax as lax_internal

from linear_transformers.ops.gated_linear import pallas
from linear_transformers.ops.precision import round_to_tf32

TF32 = "tensorfloat32"
_installed = False

# Where products round float32 operands to TF32 (10 mantissa bits), two forms of one function
# differ by about 1e-3 of their outputs' scale instead of float32's 1e-7 (README, "Precision and
# the devices"): the README's examples differ by up to 1.5e-3 there.
TF32_RELATIVE_TOLERANCE = 5e-3


def _emulating(precision) -> bool:
    """Whether a product asks for TF32: `default_matmul_precision("tensorfloat32")` binds every
    product left at the default as (HIGH, HIGH), which a GPU runs in TF32."""
    if not isinstance(precision, tuple):
        precision = (precision, precision)
    return all(p == jax.lax.Precision.HIGH for p in precision)


def install() -> None:
    """Wrap the CPU lowering of `dot_general` (idempotent; a no-op off the CPU)."""
    global _installed
    if _installed or jax.default_backend() != "cpu":
        return
    entry = mlir._platform_specific_lowerings["cpu"].get(lax_internal.dot_general_p)
    if entry is None:  # a JAX whose internals moved: say so rather than test nothing
        raise RuntimeError("tests/tf32.py: JAX has no CPU lowering rule for dot_general to wrap.")
    rule = entry.rule
    round_rule = mlir.lower_fun(round_to_tf32, multiple_results=False)

    def rounded(ctx, operand, aval):
        if aval.dtype != jnp.float32:
            return operand
        (out,) = round_rule(ctx.replace(avals_in=[aval], avals_out=[aval]), operand)
        return out

    def tf32_rule(ctx, lhs, rhs, *, precision, **params):
        if _emulating(precision):
            lhs_aval, rhs_aval = ctx.avals_in
            lhs, rhs = rounded(ctx, lhs, lhs_aval), rounded(ctx, rhs, rhs_aval)
        return rule(ctx, lhs, rhs, precision=precision, **params)

    mlir.register_lowering(lax_internal.dot_general_p, tf32_rule, platform="cpu")
    _installed = True


def rounds_float32_products() -> bool:
    """Whether this run's float32 matrix products round their operands: on a GPU at any precision
    but float32's (TF32 by default), on the CPU under `tf32_products` (emulated)."""
    if jax.default_backend() == "cpu":
        return _installed and jax.config.jax_default_matmul_precision in (TF32, "high")
    # A GPU's products take float32 operands as the Pallas kernel's Triton products do.
    return pallas.products(jnp.float32, jnp.float32, "triton") is not None


def assert_close(actual, desired, *, atol: float, rtol: float) -> None:
    """Two forms of one function agree: within `atol` and `rtol` (elementwise) at float32
    products; within `TF32_RELATIVE_TOLERANCE` of `desired`'s largest magnitude where this run's
    products round float32 operands (`rounds_float32_products`)."""
    if not rounds_float32_products():
        np.testing.assert_allclose(actual, desired, atol=atol, rtol=rtol)
        return
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    bound = TF32_RELATIVE_TOLERANCE * np.max(np.abs(desired))
    error = np.max(np.abs(actual - desired))
    assert error <= bound, f"forms differ by {error:.3g} at TF32 products, more than {bound:.3g}"


@contextlib.contextmanager
def tf32_products():
    """float32 matrix products at TF32: real on a GPU, emulated on the CPU."""
    install()
    with jax.default_matmul_precision(TF32):
        yield
