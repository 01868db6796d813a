"""How the Pallas kernels of the "pallas" form are launched: `Tuning` (their grid and Triton's
options, which change no result; `tuning` sets it for the calls traced inside a block), the
static `Config` of one call, and `call`, one kernel over the (batch, head, value block, pass)
grid with its operands' and outputs' layouts.

Legend: B batch, T time, H heads, D key/query features, M value features, X decay features (1
or D), C chunk length.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from linear_transformers.ops import sequence_parallel as sp
from linear_transformers.ops.gated_linear import inputs

MIN_BLOCK = 16  # Triton's smallest matmul dimension


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
      (the paper's attention with a decay per step, chunks of 32: 1224 bytes a thread, 572 split;
      BENCHMARKS.md).
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
      loops' work done in parallel. With a decay the one-pass backward writes two such arrays
      too (the state each chunk carries over and the cotangent of the state leaving it, whose
      product is the decays' gradient through the carried state: `pallas_kernels.py`).
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
        if block is not None and (block < MIN_BLOCK or block & (block - 1)):
            raise ValueError(f"value_block must be a power of two >= {MIN_BLOCK} or None, got {block}.")
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


def current_tuning() -> Tuning:
    """The `Tuning` of the calls traced now (`tuning`'s)."""
    return _TUNING.get()


@dataclasses.dataclass(frozen=True)
class Config:
    """The kernels' static options: chunk length C; a decay per feature; the kernel mode; the
    accumulation dtype; the `inputs.Preparation` the kernels apply to each chunk (None: the
    inputs come prepared); the feature count before padding (the padding features, which a
    feature map may not keep at 0, are zeroed after it); the launch's `Tuning`; the
    normaliser's eps (None: no normaliser); how the matrix products take their operands
    (`pallas.products`: "bfloat16", "tensorfloat32", or None: as they are, in acc)."""

    C: int
    per_feature: bool
    mode: str
    acc: Any
    prepare: inputs.Preparation | None
    features: int
    tuning: Tuning
    eps: float | None
    products: str | None

    @property
    def snapshots(self):
        """The dtype of the parallel forms' states (and their cotangents) entering or leaving each
        chunk: bfloat16 where the products take it (half the bytes, the same results), else acc.
        Their normalisers stay in acc (a sum, not a product)."""
        return jnp.dtype(jnp.bfloat16) if self.products == "bfloat16" else self.acc

    def value_block(self, M: int) -> int:
        """The value features of one program, for M (padded) value features."""
        return min(self.tuning.value_block or M, M)


def call(kernel, config, value_block: int, operands, outputs, *, passes: int = 1):
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


def bind(kernel, config, q, g, valid, runs, **options):
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


def operands(q, k, v, g, valid, runs, before, s0, z0):
    return [
        (x, layout)
        for x, layout in zip(
            (q, k, v, g, valid, runs, before, s0, z0),
            ("time", "time", "values", "time", "counts", "counts", "counts", "state", "row"),
        )
        if x is not None
    ]
