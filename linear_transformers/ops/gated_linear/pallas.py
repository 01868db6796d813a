"""The "pallas" form: the chunked recurrence as one Pallas kernel per pass (`pallas_kernels.py`),
lowered to Triton on NVIDIA (and ROCm) GPUs and run by Pallas's interpreter on a CPU.

Legend: B batch, T time, H heads, D key/query features (F, the feature map's, once prepared),
M value features, X decay features (1 or D), C chunk length.

Why Triton, not Mosaic GPU: the Triton lowering serves every NVIDIA GPU from Ampere on and ROCm,
Mosaic GPU only Hopper and later; its generic `pl.pallas_call` kernels (refs, `pl.dot`,
`lax.fori_loop`) run unchanged in interpret mode, which is how the tests check them on a CPU,
and lower for CUDA on a machine without a GPU (`jax.export`), which is how the tests check that
every operation in them has a Triton lowering. For Mosaic GPU JAX deprecated `pl.pallas_call`
in favour of `plgpu.kernel`, a different program (warpgroups, explicit shared memory), and jax
0.12 lowers `pl.pallas_call` only to Triton and Mosaic TPU; the
Triton path is selected by its `CompilerParams`. From jax 0.11 the Triton lowering itself warns
that it is deprecated and will be removed (for Mosaic GPU, or Triton's own bindings through
`jax_triton`); these kernels' lowering for CUDA and their interpreted runs pass their tests
with jax 0.10.2, 0.11.2 and 0.12.0.1.

The normaliser runs in the same programs as the values, as an implicit column of ones in v
(`pallas_kernels.forward_kernel`): q and k are read once for both.

What the kernels read: the caller's q, k, v and log decays, each chunk prepared as it is loaded
(the `inputs.Preparation`: feature map, scale, the keys that do not count, the finite part of v
and g), where the feature map is pointwise (elu, relu, identity); with any other (FAVOR+) XLA
prepares the inputs first. Their gradients go back through the same preparation, in the kernel.

The form's files: this one pads the inputs and binds the forward (`pallas_forward.py`) to its
backward (`pallas_backward.py`); `pallas_launch.py` launches a kernel (`Tuning`, `Config`);
`pallas_walks.py` cuts the sequences into walks and joins them; `pallas_kernels.py` holds the
kernels, `pallas_chunk.py` one chunk of them.

What the kernels do not do, and these files do in XLA around them:
- padding: T to a whole number of chunks (the padding steps are keys that do not count); D and
  M to a power of two >= 16 (Triton's block shapes), with zeros;
- the normaliser's cotangent: d den = -sum_m d out * out / (den + eps), a reduction over all
  value features, which a program of one value block does not see;
- with several walks (`Tuning.walks`), their join: the state entering each walk, from the
  walks' final states and factors (a fold over the walks), and backward the same for the
  cotangents, for the parallel forms' chunks or the one-pass kernels' walks to start from;
- the decays' cotangent (per feature, or summed over the features with a decay per step),
  formed within each chunk by the backward kernels (`pallas_kernels.py`): for step t, q . dq
  less k . dk of the prepared q and k from t to the end of its segment in the chunk (without
  each step's own score q[t] . k[t], the same in both: `pallas_kernels.off_diagonal`), plus
  what t's decay gives through the state leaving the chunk (its keys before t, and the state
  carried through the chunk times that state's cotangent); 0 at a segment's first step, whose
  decay meets a dropped state; taken back through the decays' preparation. XLA adds the
  kernels' query and key sides (and, after the one-pass backward, the carried state's part,
  one value per chunk).

The kernels compute in float32 (float64 for float64 inputs) whatever the input dtype, and their
matrix products sum in it. Each product takes its operands as `products` says, rounded by the
kernels (`pallas_chunk.Chunk.operand`), and the decays' gradient takes q and k as the products
did. With bfloat16 inputs, bfloat16 operands (the scores, the states and the rescaled q and k
each rounded before a product, as FLA's kernels multiply), unless `jax.default_matmul_precision`
asks for more than a bfloat16 pass. Compiled for an H100 that halves the tensor-core
instructions against TF32 and cuts the shared-memory loads by a quarter to a half
(BENCHMARKS.md); the values and gradients stay within 1.1e-2 of the float64 reference's scale
where float32 products give 4e-3 (bfloat16 outputs alone round by 4e-3). Otherwise the products
follow `jax.default_matmul_precision` as XLA's do: TF32 for float32 on a GPU by default, each
operand rounded to the nearest TF32 value (`precision.round_to_tf32`) where Triton would hand
the tensor cores its float32 bits to truncate (the decays' gradient 15 times further from the
reference at the median: BENCHMARKS.md, "TF32 products"); exact in interpret mode on a CPU by
default. The sums written as products with a 0/1 matrix (the decays' log sums, the decays'
cotangent) keep float32's full precision whatever it says (`pallas_chunk.sums`: three bfloat16
parts on tensor cores).

The form interface is in `forms.py`; the caller binds `chunk_size`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_transformers.ops import input_checks
from linear_transformers.ops.gated_linear import pallas_backward, pallas_forward, pallas_launch, totals
from linear_transformers.ops.gated_linear.pallas_launch import MIN_BLOCK, Config, Tuning, tuning

__all__ = ["DEFAULT_CHUNK_SIZE", "Config", "Tuning", "form", "kernel_mode", "products", "tuning"]

# The chunk length when the caller gives none, for every decay: the longest whose kernels spill
# few registers when compiled for an H100 (bf16 inputs and products, D = M = 64, eight warps;
# Triton 3.9: BENCHMARKS.md, "The Pallas kernel", `experiments/kernel_resources.py`). With a
# decay per step or head, chunks of 64 spill 36 bytes and 0.9 KB a thread forward and backward,
# chunks of 32 nothing forward and 76 bytes backward; with a decay per feature, at 64 0.8 and
# 5.1 KB, at 32 nothing forward and 0.6 KB backward.
DEFAULT_CHUNK_SIZE = 32


def kernel_mode(platform: str | None = None) -> str:
    """ "triton" on a GPU, "interpret" on a CPU; a clear error elsewhere (TPUs: use "chunked")."""
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        return "triton"
    if platform == "cpu":
        return "interpret"
    raise ValueError(
        f'implementation="pallas" is a GPU kernel (Triton); on {platform!r} use "chunked", the '
        f"default, which runs everywhere."
    )


def _block_size(n: int) -> int:
    return max(MIN_BLOCK, 1 << (n - 1).bit_length())


def _pad_axis(x, axis: int, size: int):
    """x with zeros after its entries along `axis`, up to `size`."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def form(q, k, v, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, eps, acc, chunk_size):
    # With a pointwise feature map the kernels prepare each chunk as they load it: they read the
    # caller's arrays, with no prepared copy of q, k, v and g written and read again. A scale
    # that is an array (a kernel's options are numbers) is applied before them, where its
    # gradient is JAX's.
    in_kernel = prepare is not None and prepare.pointwise and input_checks.is_number(prepare.scale)
    raw_dtype = jnp.result_type(q, k, v)
    if not in_kernel:
        q, k, v, g = (q, k, v, g) if prepare is None else prepare(q, k, v, g, valid_BT)
    B, T, H, F = q.shape
    M = v.shape[-1]
    per_feature = g is not None and g.shape[-1] > 1
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE
    elif chunk_size < MIN_BLOCK or chunk_size & (chunk_size - 1):
        raise ValueError(
            f'implementation="pallas": chunk_size must be a power of two >= {MIN_BLOCK} (a Triton '
            f"block), got {chunk_size}."
        )
    C = min(chunk_size, _block_size(T))
    Tp, Fp, Mp = -(-T // C) * C, _block_size(F), _block_size(M)
    if g is not None:
        g = _pad_axis(_pad_axis(g, 3, Fp) if per_feature else g[..., 0], 1, Tp)
        g = g if in_kernel else g.astype(acc)
    q, k = (_pad_axis(_pad_axis(x, 3, Fp), 1, Tp) for x in (q, k))
    valid = None
    if in_kernel and (valid_BT is not None or Tp > T):  # padding steps are keys that do not count
        valid = jnp.ones((B, T), jnp.int32) if valid_BT is None else valid_BT.astype(jnp.int32)
        valid = _pad_axis(valid, 1, Tp)
    runs = before = None
    if reset_BT is not None:
        reset = _pad_axis(reset_BT.astype(jnp.int32), 1, Tp)
        runs = totals.runs(reset)
        before = runs - reset
    mode = kernel_mode()
    config = Config(
        C=C,
        per_feature=per_feature,
        mode=mode,
        acc=jnp.dtype(acc),
        prepare=prepare if in_kernel else None,
        features=F,
        tuning=pallas_launch.current_tuning(),
        eps=None if z0_BHF is None else _static_eps(eps),
        products=products(raw_dtype, acc, mode),
    )
    s0 = _pad_axis(_pad_axis(s0_BHFM.astype(acc), 2, Fp), 3, Mp)
    z0 = None if z0_BHF is None else _pad_axis(z0_BHF.astype(acc), 2, Fp)
    v = _pad_axis(_pad_axis(v, 3, Mp), 1, Tp)
    out, s, z, clean = _attend(config, q, k, v, g, valid, runs, before, s0, z0)
    out, s, z = out[:, :T, :, :M], s[:, :, :F, :M], None if z is None else z[:, :, :F]
    # What the non-finite guard checks, as the kernel saw the raw v and g (prepared before it,
    # they are finite already: then the guard checks them itself).
    clean = jnp.all(clean != 0) if in_kernel else None
    return out, (s, z), clean


# Values of `jax.default_matmul_precision`: those that leave bfloat16 inputs at one bfloat16 pass
# (`Precision.DEFAULT`), those at which Triton multiplies float32 operands as TF32 (`DEFAULT` and
# `HIGH`: JAX's default on a GPU), and those that name TF32 on any platform.
_BFLOAT16_PRECISIONS = (None, "default", "bfloat16", "fastest")
_TRITON_TF32_PRECISIONS = _BFLOAT16_PRECISIONS + ("high", "bfloat16_3x", "tensorfloat32")
_TF32_PRECISIONS = ("tensorfloat32", "TF32_TF32_F32")


def products(dtype, acc, mode: str) -> str | None:
    """How the kernels' matrix products take their operands, for inputs of `dtype` accumulated
    in `acc` in kernel `mode` (`kernel_mode`), at `jax.default_matmul_precision`:
    "bfloat16" (cast to it) for bfloat16 inputs accumulated in float32 while the precision asks
    for no more than a bfloat16 pass (JAX's default), or for any inputs where it names that
    pass; otherwise in float32, "tensorfloat32" (rounded to TF32, `precision.round_to_tf32`)
    where it asks for TF32 or leaves a Triton product at TF32 (JAX's default for float32 on a
    GPU); else None: as they are, at that precision (a float64 state asks for float64 sums)."""
    precision = jax.config.jax_default_matmul_precision
    if jnp.dtype(acc) != jnp.float32:
        return None
    bfloat16_inputs = jnp.dtype(dtype) == jnp.bfloat16
    if precision == "BF16_BF16_F32" or (bfloat16_inputs and precision in _BFLOAT16_PRECISIONS):
        return "bfloat16"
    if precision in _TF32_PRECISIONS or (mode == "triton" and precision in _TRITON_TF32_PRECISIONS):
        return "tensorfloat32"
    return None


def _static_eps(eps) -> float:
    try:
        return float(eps)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            'implementation="pallas" takes eps as a number known when the call is traced (its '
            f"kernels' static option), got the traced {eps!r}; pass a Python float."
        ) from None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(config, q, k, v, g, valid, runs, before, s0, z0):
    """(out [B, T, H, M] in v's dtype, s [B, H, D, M], z [B, H, D] or None, clean [B, H, value
    blocks]) of padded inputs, prepared by the kernels (`config.prepare`) or before them; z0
    None: no normaliser; clean (int32): 1 where the program's raw v were finite and log decays
    <= 0 (`pallas_chunk.Chunk.clean`)."""
    out, s, z, _, clean, _ = pallas_forward.forward(config, q, k, v, g, valid, runs, before, s0, z0)
    return out, s, z, clean


def _attend_fwd(config, q, k, v, g, valid, runs, before, s0, z0):
    out, s, z, den, clean, walked = pallas_forward.forward(config, q, k, v, g, valid, runs, before, s0, z0)
    if config.tuning.parallel_backward:  # it walks every chunk's states itself
        walked = None
    return (out, s, z, clean), (q, k, v, g, valid, runs, before, s0, z0, out, den, walked)


_attend.defvjp(_attend_fwd, pallas_backward.backward)
