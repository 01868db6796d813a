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

What the kernels do not do, and this wrapper does in XLA around them:
- padding: T to a whole number of chunks (the padding steps are keys that do not count); D and
  M to a power of two >= 16 (Triton's block shapes), with zeros;
- the normaliser's cotangent: d den = -sum_m d out * out / (den + eps), a reduction over all
  value features, which a program of one value block does not see;
- with several walks (`Tuning.walks`), their join: the state entering each walk, from the
  walks' final states and factors (a fold over the walks), and backward the same for the
  cotangents, for the parallel forms' chunks or the one-pass kernels' walks to start from;
- the decays' cotangent: with d G[t] = q[t] . dq[t] - k[t] . dk[t] of the prepared q and k
  (per feature, or summed over them with a decay per step; + d S_T * S_T + d z_T * z_T at the
  last step) the cotangent of the log decays summed up to t, each g's is the sum of those at and
  after it in its segment (0 at a segment's first step, whose decay meets a dropped state),
  taken back through the decays' preparation. The backward kernels return the two terms'
  sums within each chunk (from each step to the end of its segment there); XLA adds the sums
  of the later chunks, one value per chunk.

The kernels compute in float32 (float64 for float64 inputs) whatever the input dtype, and their
matrix products sum in it. With bfloat16 inputs the products take bfloat16 operands (the
scores, the states and the rescaled q and k each rounded before a product, as FLA's kernels
multiply), unless `jax.default_matmul_precision` asks for more than a bfloat16 pass
(`products_dtype`). Compiled for an H100 that halves the tensor-core instructions against TF32
and cuts the shared-memory loads by a fifth to a half (BENCHMARKS.md); the values and
gradients stay within 1.1e-2 of the float64 reference's scale where float32 products give
4e-3 (bfloat16 outputs alone round by 4e-3). Other products follow `jax.default_matmul_precision`
as XLA's do (TF32 for float32 on an NVIDIA GPU by default; exact in interpret mode on a CPU),
but for the sums written as products with a 0/1 matrix (the decays' log sums, the decays'
cotangent), which keep float32's full precision whatever it says (`pallas_chunk.sums`: three
bfloat16 parts on tensor cores).

The form interface is in `forms.py`; the caller binds `chunk_size`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.gated_linear import inputs, pallas_kernels, totals

# The chunk length when the caller gives none, for every decay: the longest whose kernels spill
# few registers when compiled for an H100 (bf16 inputs and products, D = M = 64, eight warps;
# Triton 3.9: BENCHMARKS.md, "The Pallas kernel", `experiments/kernel_resources.py`). With a
# decay per step or head, chunks of 64 spill 36 bytes and 0.7 KB a thread forward and backward,
# chunks of 32 nothing forward and 136 bytes backward; with a decay per feature, at 64 0.8 and
# 5.0 KB, at 32 nothing forward and 0.6 KB backward.
DEFAULT_CHUNK_SIZE = 32
_MIN_BLOCK = 16  # Triton's smallest matmul dimension


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the kernels are launched; not what they compute (every choice gives the same result).

    value_block: the value features one program computes (a power of two >= 16; None: all M).
      Smaller blocks launch M / value_block programs per (batch, head), each recomputing the
      chunk's scores: more programs where B * H alone leaves the GPU's SMs idle, as FLA's grid
      over value blocks. Backward, each program then gives a part of dq and dk, summed after it.
    split_backward: the backward's two passes (the one that gives dq, forward in time; the one
      that gives dk and dv, backward) in programs of their own: twice the programs, each with
      half the work, reading the same bytes. With `parallel_backward`, a chunk's dq and its dk
      and dv in programs of their own.
    split_key_value: with `split_backward`, dk and dv in programs of their own too: three
      programs per sequence (per chunk with `parallel_backward`), both walking back with the
      state's cotangent, so q, k and the output's cotangent are read twice and that walk is
      made twice, where one program holding dk's and dv's values at once spills registers
      (a decay per step, chunks of 32: 136 bytes a thread, 56 split; BENCHMARKS.md).
    parallel_forward: the forward as two kernels: one that walks the chunks carrying only the
      state and writes the state entering each chunk ([T / C, D, M] per sequence: bfloat16
      where the products round it, as with bfloat16 inputs by default, else float32:
      `Config.snapshots`), then one program per chunk that makes its output from that state,
      all chunks at once. It trades those states' bytes (written and read: 256 bytes a token
      each way in bfloat16 at D = M = 64, C = 32, where bf16 q, k, v and out are 512 in all)
      for parallel work where the one-pass forward's loop, a chunk at a time, may leave the GPU
      waiting (FLA's `chunk_fwd_h` and `chunk_fwd_o` split the same way).
    parallel_backward: the backward the same way, as two kernels: one with two programs a
      sequence, one walking the chunks forward to write the state entering each, the other
      backward to write the cotangent of the state leaving each ([T / C, D, M] per sequence
      each, as the forward's, made again rather than kept); then one program per chunk that
      makes its dq, dk and dv from those two (FLA's `chunk_bwd_dh` and `chunk_bwd_dqkwg`). It
      trades two [T / C, D, M] arrays per sequence, each written once and read once, for the
      loops' work done in parallel.
    walks: the walks over each sequence's chunks in as many stretches of the sequence, one
      program each. The walk a chunk at a time is the one serial part of every form:
      `walks` stretches cut its length `walks`-fold and launch that many more programs where
      B * H alone leaves SMs idle (FLA's `chunk_h_split`), for a [D, M] state and a [D]
      factor per walk. Fewer where the sequence has fewer chunks.
      With `parallel_forward` or `parallel_backward`, the walks that write the states (and
      their cotangents) start from a zero state; XLA then joins them (each walk's final state
      and the factor its first state leaves it with: a fold over the walks,
      `totals.apply_totals`), and each chunk's program adds its walk's first state, carried
      to the chunk, to what the walk wrote (a factor per chunk with a decay or segments).
      With a one-pass form, a first kernel walks the stretches from zero writing only those
      ends (reading k and v: not the states entering each chunk), XLA joins them, and each
      stretch's program of the one-pass kernel walks it from the state entering it; the
      backward keeps those states, walks the stretches back from zero (reading q and the
      output's cotangent), joins them, and its passes walk each stretch from its first state
      and the cotangent of its last: the one-pass kernels' bytes, and k and v forward, q and
      the output's cotangent backward, once more, for the parallel forms' parallel walks.
    num_warps, num_stages: Triton's. Eight warps: a program holds some ten [64, 64] float32
      tensors at once (the scores, their decays, q, k, v, the state and, backward, their
      cotangents): 16 registers a thread each at 256 threads.

    The defaults are chosen, not yet tuned on a GPU; `tuning` changes them for the calls traced
    inside it (the accelerator benchmark's sweep)."""

    value_block: int | None = None
    split_backward: bool = True
    split_key_value: bool = False
    parallel_forward: bool = False
    parallel_backward: bool = False
    walks: int = 1
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        block = self.value_block
        if block is not None and (block < _MIN_BLOCK or block & (block - 1)):
            raise ValueError(f"value_block must be a power of two >= {_MIN_BLOCK} or None, got {block}.")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(
                f"num_warps must be a power of two from 1 to 32 (Triton's), got {self.num_warps}."
            )
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}.")
        for name in ("split_backward", "split_key_value", "parallel_forward", "parallel_backward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.split_key_value and not self.split_backward:
            raise ValueError("split_key_value=True needs split_backward=True (dq in programs of its own).")
        if not isinstance(self.walks, int) or isinstance(self.walks, bool) or self.walks < 1:
            raise ValueError(f"walks must be an int >= 1, got {self.walks!r}.")

    @property
    def backward_passes(self) -> int:
        """The backward's programs per sequence (per chunk with `parallel_backward`): 1, 2 or 3."""
        return 1 + self.split_backward + self.split_key_value


_TUNING = contextvars.ContextVar("pallas_tuning", default=Tuning())


@contextlib.contextmanager
def tuning(**options):
    """The kernels launched as `Tuning(**options)` says (unnamed options keep their values) for
    the calls traced inside the block; a `jax.jit` function traced before keeps its own."""
    token = _TUNING.set(dataclasses.replace(_TUNING.get(), **options))
    try:
        yield
    finally:
        _TUNING.reset(token)


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
    # With a pointwise feature map the kernels prepare each chunk as they load it: they read the
    # caller's arrays, with no prepared copy of q, k, v and g written and read again.
    in_kernel = prepare is not None and prepare.pointwise
    raw_dtype = jnp.result_type(q, k, v)
    if not in_kernel:
        q, k, v, g = (q, k, v, g) if prepare is None else prepare(q, k, v, g, valid_BT)
    B, T, H, F = q.shape
    M = v.shape[-1]
    per_feature = g is not None and g.shape[-1] > 1
    if chunk_size is None:
        chunk_size = DEFAULT_CHUNK_SIZE
    elif chunk_size < _MIN_BLOCK or chunk_size & (chunk_size - 1):
        raise ValueError(
            f'implementation="pallas": chunk_size must be a power of two >= {_MIN_BLOCK} (a Triton '
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
    config = Config(
        C=C,
        per_feature=per_feature,
        mode=kernel_mode(),
        acc=jnp.dtype(acc),
        prepare=prepare if in_kernel else None,
        features=F,
        tuning=_TUNING.get(),
        eps=None if z0_BHF is None else _static_eps(eps),
        products=products_dtype(raw_dtype),
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


# The values of `jax.default_matmul_precision` that ask for nothing above one bfloat16 pass.
_BFLOAT16_PRECISIONS = (None, "default", "bfloat16", "BF16_BF16_F32")


def products_dtype(dtype):
    """The dtype the kernels' matrix products take their operands in, for inputs of `dtype`:
    bfloat16 for bfloat16 inputs while `jax.default_matmul_precision` asks for no more than a
    bfloat16 pass (JAX's default); else None: in the accumulation dtype, at that precision."""
    precision = jax.config.jax_default_matmul_precision
    if jnp.dtype(dtype) == jnp.bfloat16 and precision in _BFLOAT16_PRECISIONS:
        return jnp.dtype(jnp.bfloat16)
    return None


def _static_eps(eps) -> float:
    try:
        return float(eps)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            'implementation="pallas" takes eps as a number known when the call is traced (its '
            f"kernels' static option), got the traced {eps!r}; pass a Python float."
        ) from None


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernels' static options: chunk length C; a decay per feature; the kernel mode; the
    accumulation dtype; the `inputs.Preparation` the kernels apply to each chunk (None: the
    inputs come prepared); the feature count before padding (the padding features, which a
    feature map may not keep at 0, are zeroed after it); the launch's `Tuning`; the
    normaliser's eps (None: no normaliser); the dtype the matrix products' operands are cast
    to (`products_dtype`; None: they stay in acc, at the matmul precision)."""

    C: int
    per_feature: bool
    mode: str
    acc: Any
    prepare: inputs.Preparation | None
    features: int
    tuning: Tuning
    eps: float | None
    products: Any

    @property
    def snapshots(self):
        """The dtype of the parallel forms' states (and their cotangents) entering or leaving each
        chunk: the products' where they round them (bfloat16: half the bytes, the same results),
        else acc. Their normalisers stay in acc (a sum, not a product)."""
        return self.products or self.acc

    def value_block(self, M: int) -> int:
        """The value features of one program, for M (padded) value features."""
        return min(self.tuning.value_block or M, M)


def _call(kernel, config, value_block: int, operands, outputs, *, passes: int = 1):
    """`kernel` (bound to its options) over a (B, H, value blocks, passes) grid: one program per
    sequence, block of `value_block` value features and pass. `operands`, `outputs`: (array, or shape
    and dtype; layout), the first operand q [B, T, H, D], the third v [B, T, H, M]. Layouts:
    "time" [B, T, H(, X)], "counts" [B, T] and "row" [B, H, D] (the normaliser's state), whole
    in every program; "values" [B, T, H, M] and "state" [B, H, D, M], a value block each;
    "part" [M / value_block, B, T, H(, X)], each program's part of a sum; "flags" [B, H,
    M / value_block], an entry per program; "walk flags" [B, H, M / value_block * passes],
    an entry per program where the passes are walks."""
    B, _, H, _ = operands[0][0].shape
    M = operands[2][0].shape[-1]

    def spec(shape, layout: str):
        if layout == "counts":
            return pl.BlockSpec((None, shape[1]), lambda b, h, j, p: (b, 0))
        if layout == "row":
            return pl.BlockSpec((None, None, shape[2]), lambda b, h, j, p: (b, h, 0))
        if layout == "flags":  # [B, H, value blocks]: one entry per program
            return pl.BlockSpec((None, None, None), lambda b, h, j, p: (b, h, j))
        if layout == "walk flags":  # [B, H, value blocks * walks]: one entry per program
            walks = shape[2] * value_block // M
            return pl.BlockSpec((None, None, None), lambda b, h, j, p: (b, h, j * walks + p))
        if layout == "state":
            return pl.BlockSpec((None, None, shape[2], value_block), lambda b, h, j, p: (b, h, 0, j))
        if layout == "values":
            return pl.BlockSpec((None, shape[1], None, value_block), lambda b, h, j, p: (b, 0, h, j))
        rest = tuple(shape[4:] if layout == "part" else shape[3:])
        block, index = (None, shape[1], None, *rest), lambda b, h, j, p: (b, 0, h) + (0,) * len(rest)
        if layout == "part":
            block, index = (
                (None, None, shape[2], None, *rest),
                lambda b, h, j, p: (j, b, 0, h) + (0,) * len(rest),
            )
        return pl.BlockSpec(block, index)

    # Inside `shard_map` (a device's block of a sequence axis) every input and output varies
    # over the axes any input varies over.
    axes = sp.varying_axes([x for x, _ in operands])
    if config.mode == "interpret" and axes:
        # Pallas's interpreter (jax 0.10) evaluates the kernel as traced, with types that vary
        # over no mesh axis, and `shard_map` refuses to mix them with its inputs' types.
        raise NotImplementedError(
            'implementation="pallas" inside jax.shard_map (a sequence_axis, or inputs that vary '
            f"over the manual mesh axes {sorted(axes)}) runs only as the GPU "
            'kernel: Pallas\'s CPU interpreter cannot run it there. Use implementation="chunked" '
            "on a CPU."
        )
    arrays = sp.vary([x for x, _ in operands], axes)
    axis_type = jax.typeof(arrays[0]).manual_axis_type
    triton = dict(num_warps=config.tuning.num_warps, num_stages=config.tuning.num_stages)
    return pl.pallas_call(
        kernel,
        grid=(B, H, M // value_block, passes),
        in_specs=[spec(x.shape, layout) for x, layout in operands],
        out_specs=[spec(x.shape, layout) for x, layout in outputs],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=axis_type) for x, _ in outputs],
        interpret=config.mode == "interpret",
        compiler_params=pltriton.CompilerParams(**triton) if config.mode == "triton" else None,
    )(*arrays)


def _kernel(kernel, config, q, g, valid, runs, **options):
    """`kernel` bound to the static options of these inputs, and to `options`."""
    return functools.partial(
        kernel,
        C=config.C,
        num_chunks=q.shape[1] // config.C,
        has_decay=g is not None,
        has_valid=valid is not None,
        has_segments=runs is not None,
        per_feature=config.per_feature,
        acc=config.acc,
        prepare=config.prepare,
        features=config.features,
        eps=config.eps,
        products=config.products,
        **options,
    )


def _operands(q, k, v, g, valid, runs, before, s0, z0):
    return [
        (x, layout)
        for x, layout in zip(
            (q, k, v, g, valid, runs, before, s0, z0),
            ("time", "time", "values", "time", "counts", "counts", "counts", "state", "row"),
        )
        if x is not None
    ]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(config, q, k, v, g, valid, runs, before, s0, z0):
    """(out [B, T, H, M] in v's dtype, s [B, H, D, M], z [B, H, D] or None, clean [B, H, value
    blocks]) of padded inputs, prepared by the kernels (`config.prepare`) or before them; z0
    None: no normaliser; clean (int32): 1 where the program's raw v were finite and log decays
    <= 0 (`pallas_chunk.Chunk.clean`)."""
    out, s, z, _, clean, _ = _forward(config, q, k, v, g, valid, runs, before, s0, z0)
    return out, s, z, clean


def _forward(config, q, k, v, g, valid, runs, before, s0, z0):
    """`_attend`'s outputs, with the normaliser's den [B, T, H] (float32) before clean (None
    without a normaliser), and after it the one-pass forward's joined walks (`_walk_starts`:
    the states entering each walk and the walks' total factors, which the backward's walks
    start from) or None."""
    if config.tuning.parallel_forward:
        return _parallel_forward(config, q, k, v, g, valid, runs, before, s0, z0)
    B, T, H, M = v.shape
    value_block = config.value_block(M)
    walks = _Walks(config, T // config.C, g, runs)
    starts, walked = (s0, z0), None
    if walks.joined:
        inputs = (q, k, v, g, valid, runs, before)
        starts, final, walk_totals = _walk_starts(config, value_block, walks, inputs, s0, z0)
        walked = starts, walk_totals
    out = jax.ShapeDtypeStruct((B, T, H, M), v.dtype)
    clean = jax.ShapeDtypeStruct((B, H, M // value_block * walks.count), jnp.int32)
    kernel = _kernel(pallas_kernels.forward_kernel, config, q, g, valid, runs, walk_chunks=walks.chunks)
    operands = _operands(q, k, v, g, valid, runs, before, *starts)
    outputs = [(out, "values"), (starts[0], "state")]  # each walk's final states, at its rows
    if z0 is not None:
        outputs += [(starts[1], "row"), (jax.ShapeDtypeStruct((B, T, H), config.acc), "time")]
    outputs += [(clean, "walk flags" if walks.joined else "flags")]
    out, s, *results = _call(kernel, config, value_block, operands, outputs, passes=walks.count)
    z, den = results[:2] if z0 is not None else (None, None)
    if walks.joined:  # the last walk's final states are the join's
        s, z = final
    return out, s, z, den, jnp.min(results[-1].reshape(B, H, -1, walks.count), axis=-1), walked


def _walk_starts(config, value_block: int, walks, inputs, s0, z0):
    """((s, z): the states entering each walk of the one-pass forward, [B, H, walks * D, M]
    and [B, H, walks * D] (z None without a normaliser), the final states, [the walks' total
    factors]), from `chunk_states_kernel`'s walks from zero, each writing only its final
    states and total factor, joined. `inputs`: (q, k, v, g, valid, runs, before)."""
    _, finals, walk_totals, _ = _walk_states(config, value_block, walks, inputs, s0, z0, write_chunks=False)
    return *walks.join((s0, z0), finals, walk_totals, config.acc), walk_totals  # the flags: the forward's


def _walk_states(config, value_block: int, walks, inputs, s0, z0, *, write_chunks: bool):
    """`chunk_states_kernel`'s results: ([the states entering each chunk, [z's]] with
    `write_chunks`, else []; (s, z): the final states, each walk's; [the walks' factors];
    clean [B, H, value blocks]). `inputs`: (q, k, v, g, valid, runs, before)."""
    q, _, _, g, valid, runs, _ = inputs
    B, H, D, M = s0.shape
    normalize = z0 is not None
    outputs = []
    if write_chunks:  # chunk c's at rows c * D
        outputs += [(jax.ShapeDtypeStruct((B, H, walks.num_chunks * D, M), config.snapshots), "state")]
        if normalize:
            outputs += [(jax.ShapeDtypeStruct((B, H, walks.num_chunks * D), config.acc), "row")]
    n = len(outputs)
    outputs += walks.finals(s0, z0) + walks.factors(s0, chunks=write_chunks)
    flags = jax.ShapeDtypeStruct((B, H, M // value_block * walks.count), jnp.int32)
    outputs += [(flags, "walk flags" if walks.joined else "flags")]
    walk = dict(walk_chunks=walks.chunks, write_chunks=write_chunks)
    kernel = _kernel(pallas_kernels.chunk_states_kernel, config, q, g, valid, runs, **walk)
    operands = _operands(*inputs, *walks.starts(s0, z0))
    results = _call(kernel, config, value_block, operands, outputs, passes=walks.count)
    finals = results[n], results[n + 1] if normalize else None
    clean = jnp.min(results[-1].reshape(B, H, -1, walks.count), axis=-1)
    return results[:n], finals, results[n + 1 + normalize : -1], clean


def _parallel_forward(config, q, k, v, g, valid, runs, before, s0, z0):
    """`_forward`'s outputs from `Tuning.parallel_forward`'s two kernels."""
    B, T, H, M = v.shape
    num_chunks = T // config.C
    value_block = config.value_block(M)
    normalize = z0 is not None
    walks = _Walks(config, num_chunks, g, runs)
    inputs = (q, k, v, g, valid, runs, before)
    chunk_states, (s, z), factors, clean = _walk_states(
        config, value_block, walks, inputs, s0, z0, write_chunks=True
    )
    states, z_states = chunk_states[0], chunk_states[1] if normalize else None
    joins = []
    if walks.joined:
        entering, (s, z) = walks.join((s0, z0), (s, z), factors, config.snapshots)
        joins = walks.join_operands(entering, factors[:1])

    outputs = [(jax.ShapeDtypeStruct((B, T, H, M), v.dtype), "values")]
    if normalize:
        outputs += [(jax.ShapeDtypeStruct((B, T, H), config.acc), "time")]
    kernel = _kernel(pallas_kernels.chunk_outputs_kernel, config, q, g, valid, runs, walk_chunks=walks.chunks)
    operands = _operands(q, k, v, g, valid, runs, before, None, None) + [(states, "state")]
    operands += [(z_states, "row")] if normalize else []
    out, *den = _call(kernel, config, value_block, operands + joins, outputs, passes=num_chunks)
    return out, s, z, den[0] if normalize else None, clean, None


class _Walks:
    """The parallel forms' walks over the chunks of each sequence (`Tuning.walks`): `count` of
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


def _attend_fwd(config, q, k, v, g, valid, runs, before, s0, z0):
    out, s, z, den, clean, walked = _forward(config, q, k, v, g, valid, runs, before, s0, z0)
    return (out, s, z, clean), (q, k, v, g, valid, runs, before, s0, z0, s, z, out, den, walked)


def _attend_bwd(config, residuals, cotangents):
    q, k, v, g, valid, runs, before, s0, z0, s, z, out, den, walked = residuals
    d_out, d_s, d_z, _ = cotangents  # the last: of the int32 flags, none
    value_block = config.value_block(v.shape[-1])
    parts = v.shape[-1] // value_block
    inputs = _operands(q, k, v, g, valid, runs, before, None, None)
    d_s = d_s.astype(s0.dtype)
    d_z = None if z0 is None else d_z.astype(z0.dtype)
    chunk_operands = inputs + [(d_out, "values")]  # what a program of one chunk reads
    if z0 is not None:
        # den's cotangent, a sum over every value feature: -sum_m d out * num / (den + eps)**2
        # (FlashAttention's backward reads its stored output the same way).
        d_den = -jnp.sum(d_out.astype(den.dtype) * out.astype(den.dtype), axis=-1) / (den + config.eps)
        chunk_operands += [(den, "time"), (d_den, "time")]

    def walk_operands(s0, z0, d_s, d_z):
        """What the loops over the chunks read (`backward_kernel`'s operands), from these states
        and cotangents."""
        operands = inputs + [(s0, "state")] + ([(z0, "row")] if z0 is not None else [])
        operands += [(d_out, "values"), (d_s, "state")]
        return operands + ([(den, "time"), (d_den, "time"), (d_z, "row")] if z0 is not None else [])

    def summed(x, dtype):
        """An output of x's shape; with several value blocks, each block's part, summed after."""
        if parts == 1:
            return jax.ShapeDtypeStruct(x.shape, dtype), "time"
        return jax.ShapeDtypeStruct((parts, *x.shape), config.acc), "part"

    gradients = [summed(q, q.dtype), summed(k, k.dtype), (v, "values")]
    if g is not None:  # q . dq and k . dk of the prepared q and k: the decays' cotangent
        gradients += 2 * [summed(g, config.acc)]

    def bind(kernel, **options):
        return _kernel(kernel, config, q, g, valid, runs, **options)

    walks = _Walks(config, v.shape[1] // config.C, g, runs)
    ends = (s0, z0, d_s, d_z)
    if config.tuning.parallel_backward:
        dq, dk, dv, *dG, ds0, dz0 = _parallel_backward(
            config, bind, value_block, walks, walk_operands, chunk_operands, gradients, ends
        )
    else:
        dq, dk, dv, *dG, ds0, dz0 = _one_pass_backward(
            config, bind, value_block, walks, walk_operands, gradients, ends, walked
        )
    if parts > 1:
        dq, dk, *dG = (jnp.sum(x, axis=0) for x in (dq, dk, *dG))
        dq, dk = dq.astype(q.dtype), dk.astype(k.dtype)
    dg = None
    if g is not None:
        dg = _log_decay_cotangent(dG[0] - dG[1], config.C, (s, z), (d_s, d_z), runs, before)
        if config.prepare is not None:  # through the preparation the kernels applied
            _, pullback = jax.vjp(
                lambda g: config.prepare.log_decays(g, None if valid is None else valid != 0), g
            )
            (dg,) = pullback(dg)
    no_cotangent = tuple(
        None if x is None else np.zeros(x.shape, jax.dtypes.float0) for x in (valid, runs, before)
    )
    return dq, dk, dv, dg, *no_cotangent, ds0, dz0


def _one_pass_backward(config, bind, value_block: int, walks, walk_operands, gradients, ends, walked):
    """`_parallel_backward`'s results, from `backward_kernel`: its passes a program each per
    sequence, or per walk of it (from the ends `_walk_ends` joins). `walked`: the one-pass
    forward's joined walks (`_forward`'s) or None; the other arguments are
    `_parallel_backward`'s."""
    z0 = ends[1]
    joined = None
    if walks.joined:
        ends, joined = _walk_ends(config, bind, value_block, walks, walk_operands, ends, walked)
    passes = config.tuning.backward_passes
    kernel = bind(pallas_kernels.backward_kernel, passes=passes, walk_chunks=walks.chunks)
    # d_s0 and d_z0: each walk's, at its rows
    states = [(ends[0], "state")] + ([(ends[1], "row")] if z0 is not None else [])
    outputs = gradients[:3] + states + gradients[3:]
    operands, programs = walk_operands(*ends), passes * walks.count
    dq, dk, dv, ds0, *dG = _call(kernel, config, value_block, operands, outputs, passes=programs)
    dz0 = dG.pop(0) if z0 is not None else None
    if joined is not None:  # the first walk's are the join's
        ds0, dz0 = joined
    return (dq, dk, dv, *dG, ds0, dz0)


def _walk_ends(config, bind, value_block: int, walks, walk_operands, ends, walked):
    """((s, z, d_s, d_z): the states entering each walk of the one-pass backward and the
    cotangents of those leaving it, [B, H, walks * D, ...] (z and d_z None without a
    normaliser), (d_s0, d_z0)), from `backward_states_kernel`'s walks from zero, each writing
    only its ends (and total factor), joined; the states entering each walk and the totals
    are the one-pass forward's where it kept them (`walked`, else None: a parallel forward's
    walks wrote every chunk's). `walk_operands`, `ends`: `_parallel_backward`'s."""
    s0, z0, d_s, d_z = ends
    _, _, d_finals, finals, factors = _backward_walks(
        config, bind, value_block, walks, walk_operands, ends, write_chunks=False, walk_states=walked is None
    )
    if walked is None:
        first, _ = walks.join((s0, z0), finals, factors, config.acc)
    else:
        first, factors = walked
    last, joined = walks.join((d_s, d_z), d_finals, factors, config.acc, reverse=True)
    return (*first, *last), joined


def _backward_walks(
    config,
    bind,
    value_block: int,
    walks,
    walk_operands,
    ends,
    *,
    write_chunks: bool,
    walk_states: bool = True,
):
    """`backward_states_kernel`'s results: (the states entering each chunk, the cotangents of
    those leaving it: [S, [z]] each with `write_chunks`, else []; (d_s0, d_z0): each walk's;
    with several walks (s, z), each walk's final states, and [the factors: to each chunk with
    `write_chunks`, out of each walk, back to each chunk with `write_chunks`], else None and
    []; without `walk_states`, only the cotangents' walks: ([], [], (d_s0, d_z0), None,
    [])). Arguments: `_parallel_backward`'s."""
    s0, z0, d_s, d_z = ends
    normalize = z0 is not None
    B, H, D, M = s0.shape
    rows = []
    if write_chunks:
        rows = [(jax.ShapeDtypeStruct((B, H, walks.num_chunks * D, M), config.snapshots), "state")]
        if normalize:
            rows += [(jax.ShapeDtypeStruct((B, H, walks.num_chunks * D), config.acc), "row")]
    finals = walks.finals(s0, z0)
    outputs = rows + rows + finals
    if walks.joined and walk_states:
        outputs += finals + walks.factors(s0, chunks=write_chunks)
        outputs += walks.factors(s0, backward=True) if write_chunks else []
    walk = dict(walk_chunks=walks.chunks, write_chunks=write_chunks, walk_states=walk_states)
    kernel = bind(pallas_kernels.backward_states_kernel, **walk)
    operands = walk_operands(*walks.starts(s0, z0), *walks.starts(d_s, d_z))
    programs = (1 + walk_states) * walks.count
    walked = _call(kernel, config, value_block, operands, outputs, passes=programs)
    n, f = len(rows), len(finals)
    pair = lambda x: (x[0], x[1] if normalize else None)  # noqa: E731
    d_first = pair(walked[2 * n : 2 * n + f])
    if not (walks.joined and walk_states):
        return walked[:n], walked[n : 2 * n], d_first, None, []
    final = pair(walked[2 * n + f : 2 * n + 2 * f])
    return walked[:n], walked[n : 2 * n], d_first, final, walked[2 * n + 2 * f :]


def _parallel_backward(config, bind, value_block: int, walks, walk_operands, chunk_operands, gradients, ends):
    """(dq, dk, dv, [q . dq, k . dk], d_s0, d_z0 or None) from `Tuning.parallel_backward`'s two
    kernels, `bind(kernel, **options)` binding each to its options: `walks` the `_Walks`,
    `walk_operands(s0, z0, d_s, d_z)` those of `backward_kernel`, `chunk_operands` the inputs
    and the output's cotangents, `gradients` the outputs of dq, dk, dv [and the decays'
    parts], `ends` the initial states and the final states' cotangents (s0, z0, d_s, d_z; z0
    and d_z None without a normaliser)."""
    s0, z0, d_s, d_z = ends
    entering, leaving, (ds0, dz0), final, factors = _backward_walks(
        config, bind, value_block, walks, walk_operands, ends, write_chunks=True
    )
    layouts = ["state", "row"][: len(entering)]
    operands = chunk_operands + list(zip(entering, layouts)) + list(zip(leaving, layouts))
    if walks.joined:  # factors: to each chunk, out of each walk, back to each chunk
        first, _ = walks.join((s0, z0), final, factors[:2], config.snapshots)
        last, (ds0, dz0) = walks.join((d_s, d_z), (ds0, dz0), factors[1:2], config.snapshots, reverse=True)
        operands += walks.join_operands(first, factors[:1]) + walks.join_operands(last, factors[2:])
    passes = config.tuning.backward_passes
    kernel = bind(pallas_kernels.chunk_gradients_kernel, walk_chunks=walks.chunks, passes=passes)
    grads = _call(kernel, config, value_block, operands, gradients, passes=walks.num_chunks * passes)
    return (*grads, ds0, dz0)


def _log_decay_cotangent(local, C: int, state, d_state, runs, before):
    """d g [B, T, H(, D)] from `local` of the same shape, the kernels' sums of d G within each
    chunk of C steps (from each step to the end of its segment there; the module docstring),
    without the term at the last step (of the final state (s, z), z None without a normaliser,
    and its cotangent): each step's sum gains that of the later chunks its segment reaches, 0 at
    a segment's first step."""
    (s, z), (d_s, d_z) = state, d_state
    last = jnp.sum(d_s.astype(local.dtype) * s.astype(local.dtype), axis=-1)  # [B, H, D]
    if z is not None:
        last = last + d_z.astype(local.dtype) * z.astype(local.dtype)
    if local.ndim == 3:
        last = jnp.sum(last, axis=-1)
    B, T = local.shape[:2]
    by_chunk = local.reshape(B, T // C, C, *local.shape[2:])
    heads = by_chunk[:, :, 0]  # each chunk's first step's sum
    if runs is None:
        sums = jax.lax.cumsum(heads.at[:, -1].add(last), axis=1, reverse=True)
    else:
        # reaches: the step's segment reaches the next chunk's first step (the end, after the
        # last chunk): its count of segment starts is the same there.
        by_step = runs.reshape(B, -1, C)
        next_runs = jnp.concatenate([by_step[:, 1:, 0], runs[:, -1:]], axis=1)
        reaches = totals.expand(by_step == next_runs[:, :, None], by_chunk.ndim)
        heads = heads.at[:, -1].add(jnp.where(reaches[:, -1, 0], last, 0))
        ends = jnp.broadcast_to(~reaches[:, :, 0], heads.shape)  # the chunk's first segment ends in it

        def combine(later, earlier):  # reverse scan: `later` in time comes first
            x_later, end_later = later
            x_earlier, end_earlier = earlier
            return jnp.where(end_earlier, x_earlier, x_later + x_earlier), end_later | end_earlier

        sums, _ = jax.lax.associative_scan(combine, (heads, ends), reverse=True, axis=1)
    # From each chunk's next chunk's first step to its segment's end.
    after = jnp.concatenate([sums[:, 1:], last[:, None]], axis=1)[:, :, None]
    if runs is None:
        return (by_chunk + after).reshape(local.shape)
    dg = by_chunk + jnp.where(reaches, after, 0)
    reset = totals.expand((runs != before).reshape(by_step.shape), by_chunk.ndim)
    return jnp.where(reset, 0, dg).reshape(local.shape)


_attend.defvjp(_attend_fwd, _attend_bwd)
