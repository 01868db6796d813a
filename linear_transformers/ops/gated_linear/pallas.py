"""The "pallas" form: the chunked recurrence as one Pallas kernel per pass (`pallas_kernels.py`),
lowered to Triton on NVIDIA (and ROCm) GPUs and run by Pallas's interpreter on a CPU.

Legend: B batch, T time, H heads, D key/query features (F, the feature map's, once prepared),
M value features, X decay features (1 or D), C chunk length.

Why Triton, not Mosaic GPU: the Triton lowering serves every NVIDIA GPU from Ampere on and ROCm,
Mosaic GPU only Hopper and later; its generic `pl.pallas_call` kernels (refs, `pl.dot`,
`lax.fori_loop`) run unchanged in interpret mode, which is how the tests check them on a CPU,
and lower for CUDA on a machine without a GPU (`jax.export`), which is how the tests check that
every operation in them has a Triton lowering. JAX deprecates `pl.pallas_call` for Mosaic GPU
in favour of `plgpu.kernel`, a different program (warpgroups, explicit shared memory); the
Triton path is selected by its `CompilerParams`.

What the kernels do not do, and this wrapper does in XLA around them:
- `prepare` (feature maps, the scale, the keys that do not count) and padding: T to a whole
  number of chunks; D and M to a power of two >= 16 (Triton's block shapes), with zeros;
- the normaliser: a second kernel call whose values are ones and whose state is z (16 columns,
  Triton's smallest matmul);
- the decays' cotangent: with q, k and the dq, dk the backward kernel returns, d G[t] = q[t] *
  dq[t] - k[t] * dk[t] (+ d S_T * S_T at the last step) is the cotangent of the log decays
  summed up to t, and each g's is the sum of those at and after it in its segment (0 at a
  segment's first step, whose decay meets a dropped state).

The kernels compute in float32 (float64 for float64 inputs) whatever the input dtype; their
matrix products follow `jax.default_matmul_precision` as XLA's do (TF32 for float32 on an NVIDIA
GPU by default; exact in interpret mode on a CPU).

The form interface is in `forms.py`; the caller binds `chunk_size`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.gated_linear import pallas_kernels, totals

# The chunk length when the caller gives none: 64 (the family's), and 16 with a decay per
# feature, whose exact form for strong decays holds [C, C, D] pair decays.
DEFAULT_CHUNK_SIZE, DEFAULT_CHUNK_SIZE_PER_FEATURE = 64, 16
_MIN_BLOCK = 16  # Triton's smallest matmul dimension
# Eight warps: a program holds some ten [64, 64] float32 tensors at once (the scores, their
# decays, q, k, v, the state and, backward, their cotangents), or [16, 16, D] pair decays per
# feature: 16 registers a thread each at 256 threads. Not tuned on a GPU yet.
TRITON_PARAMS = dict(num_warps=8, num_stages=2)


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
    return max(_MIN_BLOCK, 1 << (n - 1).bit_length())


def _pad_axis(x, axis: int, size: int):
    """x with zeros after its entries along `axis`, up to `size`."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def form(q, k, v, g, valid_BT, reset_BT, s0_BHFM, z0_BHF, *, prepare, eps, acc, chunk_size):
    q, k, v, g = (q, k, v, g) if prepare is None else prepare(q, k, v, g, valid_BT)
    B, T, H, F = q.shape
    M = v.shape[-1]
    per_feature = g is not None and g.shape[-1] > 1
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE_PER_FEATURE if per_feature else DEFAULT_CHUNK_SIZE
    elif chunk_size < _MIN_BLOCK or chunk_size & (chunk_size - 1):
        raise ValueError(
            f'implementation="pallas": chunk_size must be a power of two >= {_MIN_BLOCK} (a Triton '
            f"block), got {chunk_size}."
        )
    C = min(chunk_size, _block_size(T))
    Tp, Fp, Mp = -(-T // C) * C, _block_size(F), _block_size(M)
    if g is not None:
        g = g.astype(acc)
        g = _pad_axis(_pad_axis(g, 3, Fp) if per_feature else g[..., 0], 1, Tp)
    q, k = (_pad_axis(_pad_axis(x, 3, Fp), 1, Tp) for x in (q, k))
    runs = before = None
    if reset_BT is not None:
        reset = _pad_axis(reset_BT.astype(jnp.int32), 1, Tp)
        runs = totals.runs(reset)
        before = runs - reset
    config = dict(C=C, per_feature=per_feature, mode=kernel_mode(), acc=jnp.dtype(acc))
    s0 = _pad_axis(_pad_axis(s0_BHFM.astype(acc), 2, Fp), 3, Mp)
    normalize = z0_BHF is not None
    out_dtype = jnp.dtype(acc) if normalize else v.dtype
    v = _pad_axis(_pad_axis(v, 3, Mp), 1, Tp)
    num, s = _attend(config, out_dtype, q, k, v, g, runs, before, s0)
    num, s = num[:, :T, :, :M], s[:, :, :F, :M]
    if not normalize:
        return num, (s, None)
    ones = jnp.ones((B, Tp, H, _MIN_BLOCK), v.dtype)
    z0 = jnp.broadcast_to(_pad_axis(z0_BHF.astype(acc), 2, Fp)[..., None], (B, H, Fp, _MIN_BLOCK))
    den, z = _attend(config, out_dtype, q, k, ones, g, runs, before, z0)
    return totals.finish(num, den[:, :T, :, 0], eps, v.dtype), (s, z[:, :, :F, 0])


def _call(kernel, config, inputs, outputs):
    """`kernel` (bound to its options) over a (B, H) grid, one program per sequence, every array
    whole in its block but for the batch and head axes (squeezed). `inputs`: (array,
    time_major); `outputs`: (shape and dtype, time_major), the first [B, T, H, M]."""
    B, _, H, _ = outputs[0][0].shape

    def spec(shape, time_major: bool):
        if len(shape) == 2:  # [B, T]: segment counts
            return pl.BlockSpec((None, shape[1]), lambda b, h: (b, 0))
        if time_major:  # [B, T, H(, X)]
            return pl.BlockSpec(
                (None, shape[1], None, *shape[3:]), lambda b, h: (b, 0, h) + (0,) * (len(shape) - 3)
            )
        return pl.BlockSpec((None, None, *shape[2:]), lambda b, h: (b, h, 0, 0))  # [B, H, D, M]

    mode = config["mode"]
    # Inside `shard_map` (a device's block of a sequence axis) every input and output varies
    # over the axes any input varies over.
    axes = sp.varying_axes([x for x, _ in inputs])
    if mode == "interpret" and axes:
        # Pallas's interpreter (jax 0.10) evaluates the kernel as traced, with types that vary
        # over no mesh axis, and `shard_map` refuses to mix them with its inputs' types.
        raise NotImplementedError(
            'implementation="pallas" inside jax.shard_map (a sequence_axis, or inputs that vary '
            f"over the manual mesh axes {sorted(axes)}) runs only as the GPU "
            'kernel: Pallas\'s CPU interpreter cannot run it there. Use implementation="chunked" '
            "on a CPU."
        )
    arrays = sp.vary([x for x, _ in inputs], axes)
    axis_type = jax.typeof(arrays[0]).manual_axis_type
    return pl.pallas_call(
        kernel,
        grid=(B, H),
        in_specs=[spec(x.shape, time_major) for x, time_major in inputs],
        out_specs=[spec(x.shape, time_major) for x, time_major in outputs],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=axis_type) for x, _ in outputs],
        interpret=mode == "interpret",
        compiler_params=pltriton.CompilerParams(**TRITON_PARAMS) if mode == "triton" else None,
    )(*arrays)


def _kernel_options(config, q, g, runs):
    T = q.shape[1]
    return dict(
        C=config["C"],
        num_chunks=T // config["C"],
        has_decay=g is not None,
        has_segments=runs is not None,
        per_feature=config["per_feature"],
        acc=config["acc"],
    )


def _time_inputs(q, k, v, g, runs, before):
    return [(x, True) for x in (q, k, v, g, runs, before) if x is not None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(config, out_dtype, q, k, v, g, runs, before, s0):
    """(out [B, T, H, M] in `out_dtype`, s [B, H, D, M]) of padded, prepared inputs."""
    return _forward(config, out_dtype, q, k, v, g, runs, before, s0)


def _forward(config, out_dtype, q, k, v, g, runs, before, s0):
    kernel = functools.partial(pallas_kernels.forward_kernel, **_kernel_options(config, q, g, runs))
    B, T, H, _ = q.shape
    out = jax.ShapeDtypeStruct((B, T, H, v.shape[-1]), out_dtype)
    inputs = _time_inputs(q, k, v, g, runs, before) + [(s0, False)]
    return tuple(_call(kernel, config, inputs, [(out, True), (s0, False)]))


def _attend_fwd(config, out_dtype, q, k, v, g, runs, before, s0):
    out, s = _forward(config, out_dtype, q, k, v, g, runs, before, s0)
    return (out, s), (q, k, v, g, runs, before, s0, s)


def _attend_bwd(config, out_dtype, residuals, cotangents):
    q, k, v, g, runs, before, s0, s = residuals
    d_out, d_s = cotangents
    kernel = functools.partial(pallas_kernels.backward_kernel, **_kernel_options(config, q, g, runs))
    inputs = _time_inputs(q, k, v, g, runs, before) + [
        (s0, False),
        (d_out, True),
        (d_s.astype(s0.dtype), False),
    ]
    # With a decay, dq and dk come out in float32: the decays' cotangent is their difference.
    dqk = q if g is None else jax.ShapeDtypeStruct(q.shape, config["acc"])
    outputs = [(dqk, True), (dqk, True), (v, True), (s0, False)]
    dq, dk, dv, ds0 = _call(kernel, config, inputs, outputs)
    dg = None if g is None else _log_decay_cotangent(q, k, dq, dk, s, d_s, runs, before, g)
    no_cotangent = tuple(None if x is None else np.zeros(x.shape, jax.dtypes.float0) for x in (runs, before))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv, dg, *no_cotangent, ds0


def _log_decay_cotangent(q, k, dq, dk, s, d_s, runs, before, g):
    """d g [B, T, H(, D)]: the sum over the steps at and after t in t's segment of d G (the
    module docstring), 0 at a segment's first step."""
    acc = g.dtype
    dG = q.astype(acc) * dq.astype(acc) - k.astype(acc) * dk.astype(acc)  # [B, T, H, D]
    last = jnp.sum(d_s.astype(acc) * s.astype(acc), axis=-1)  # [B, H, D]
    if g.ndim == 3:
        dG, last = jnp.sum(dG, axis=-1), jnp.sum(last, axis=-1)
    dG = dG.at[:, -1].add(last)
    if runs is None:
        return jax.lax.cumsum(dG, axis=1, reverse=True)
    reset = runs != before
    ends = jnp.concatenate([reset[:, 1:], jnp.zeros_like(reset[:, :1])], axis=1)  # t ends its segment
    ends = jnp.broadcast_to(ends.reshape(ends.shape + (1,) * (dG.ndim - 2)), dG.shape)

    def combine(later, earlier):  # reverse scan: `later` in time comes first
        x_later, end_later = later
        x_earlier, end_earlier = earlier
        return jnp.where(end_earlier, x_earlier, x_later + x_earlier), end_later | end_earlier

    sums, _ = jax.lax.associative_scan(combine, (dG, ends), reverse=True, axis=1)
    return jnp.where(reset.reshape(reset.shape + (1,) * (dG.ndim - 2)), 0, sums)


_attend.defvjp(_attend_fwd, _attend_bwd)
