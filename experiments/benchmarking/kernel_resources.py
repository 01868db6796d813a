"""What the Pallas kernels of the gated family cost a GPU before they run: each kernel lowered as
on a GPU (Triton IR, from this machine, which needs none), compiled by Triton for a GPU
architecture, and read back from ptxas: registers per thread, bytes spilled to local memory,
shared memory. A kernel that Triton cannot compile shows here as a failed row.

Legend: N sequence length, D key/query features = value features M.

Cases: every (kernel, decay, launch): kernel "forward" or "backward" (the one-pass kernels of
`ops/gated_linear/pallas_forward.py` and `pallas_backward.py`; with `parallel`, "chunk_states"
and "chunk_outputs" forward, "backward_states" and "chunk_gradients" backward; with `walks`
and no `parallel`, "chunk_states" and "backward_states" walking the stretches before them),
decay none, head, step or feature, launch `pallas.Tuning`'s value block, warps and pipeline
stages. The kernels take one (batch, head) per program, so B and
H do not change them; N changes only their loop's bound.

Why here and not on a GPU: a GPU is lent rarely, and for minutes; the registers a program needs
(255 is a thread's most, past it values spill to local memory) decide how far a kernel is from
its roof before any timing. These figures are the compiler's, not measurements of speed, and
the Triton version that compiles here (the `triton` package) need not be the one inside the
jaxlib that runs the kernel on a GPU.

Needs the `triton` package (the dev extra, Linux); the ptxas it assembles with reads the
resources.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pathlib
import re
import subprocess
import tempfile
from typing import Literal
from unittest import mock

import jax
import jax.numpy as jnp

from experiments.benchmarking import report
from linear_transformers import ops
from linear_transformers.ops.gated_linear import pallas

DECAYS = ("none", "head", "step", "feature")
# A GPU of each compute capability (as Triton names them), by the device kind JAX knows it by.
GPU_KINDS = {80: "NVIDIA A100", 90: "NVIDIA H100", 100: "NVIDIA B200"}


def gpu_kind(arch: int) -> str:
    """The device kind of compute capability `arch`; a clear error for one not in `GPU_KINDS`."""
    if arch not in GPU_KINDS:
        raise ValueError(f"arch must be one of {sorted(GPU_KINDS)}, got {arch}.")
    return GPU_KINDS[arch]


COLUMNS = (
    "kernel decay chunk_size value_block num_warps num_stages registers spill_stores spill_loads "
    "stack_bytes smem_bytes mma_instructions shared_loads status"
).split()


@dataclasses.dataclass(frozen=True)
class KernelResourcesOptions:
    """
    decays: Log decay shapes: none, head ([H]), step ([B, N, H]) or feature ([B, N, H, D]).
    value_blocks: Value features per program (`pallas.Tuning.value_block`; 0: all of them).
    num_warps: Warps per program (Triton's num_warps).
    num_stages: Triton's software pipeline stages.
    arch: The GPU's compute capability, as Triton names it: 80 (A100), 90 (H100, H200) or 100
      (B200).
    n: Sequence length traced (only the kernels' loop bound).
    head_dim: D = M, the key and value features of a head.
    dtype: Input dtype.
    chunk_size: Chunk length (0: the kernel's default, 32).
    normalize: The paper's attention: elu features and the normaliser in the same kernels
      (else the identity, unnormalised, as the gated models use it).
    parallel: The parallel forward and backward (`pallas.Tuning.parallel_forward` and
      `parallel_backward`: their states and per-chunk kernels) instead of the one-pass ones.
    split_key_value: The backward's dk and dv in programs of their own
      (`pallas.Tuning.split_key_value`).
    walks: The walks over each sequence's chunks (`pallas.Tuning.walks`): above 1, with
      `parallel` each walk's kernel writes factors and its final state, and each chunk's adds
      its walk's first state; without, a kernel walks the stretches from zero, writing only
      their ends, and the one-pass kernels walk each from the state joined for it.
    matmul_precision: `jax.default_matmul_precision` while the kernels are traced ("": JAX's
      default, where bfloat16 inputs multiply in bfloat16; "tensorfloat32": TF32 products of
      the kernels' float32 values).
    """

    decays: tuple[str, ...] = DECAYS
    value_blocks: tuple[int, ...] = (0, 32, 16)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (2,)
    arch: int = 90
    n: int = 1024
    head_dim: int = 64
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    chunk_size: int = 0
    normalize: bool = False
    parallel: bool = False
    split_key_value: bool = False
    walks: int = 1
    matmul_precision: str = ""

    def __post_init__(self):
        unknown = [d for d in self.decays if d not in DECAYS]
        if unknown or not self.decays:
            raise ValueError(f"unknown or no decays {unknown}; expected some of {DECAYS}.")
        for block in self.value_blocks:
            if block:
                pallas.Tuning(value_block=block)  # its own error for a bad value
        pallas.Tuning(walks=self.walks)  # its own error
        gpu_kind(self.arch)  # its own error for an unknown one
        with jax.default_matmul_precision(self.matmul_precision or None):
            pass  # JAX's own error, naming the values it takes


def triton_modules(
    decay: str,
    *,
    n: int,
    head_dim: int,
    dtype,
    chunk_size: int | None,
    tuning: dict,
    arch: int = 90,
    normalize: bool = False,
    matmul_precision: str | None = None,
):
    """{kernel name: Triton IR text} of the forward and backward kernels of one gated call
    (normalised with elu features, or unnormalised with the identity), traced as on an NVIDIA
    GPU (lowered for CUDA here: no GPU needed) at `jax.default_matmul_precision(matmul_precision)`
    (None: JAX's default)."""
    spec = jax.ShapeDtypeStruct
    shape = {"head": (2,), "step": (1, n, 2), "feature": (1, n, 2, head_dim)}.get(decay)
    g = None if shape is None else spec(shape, jnp.float32)
    qkv = spec((1, n, 2, head_dim), jnp.dtype(dtype))

    def value_and_grads(q, k, v, g):
        def loss(q, k, v, g):
            out = ops.gated_linear_attention(
                q,
                k,
                v,
                log_decay=g,
                normalize=normalize,
                feature_map="elu" if normalize else None,
                implementation="pallas",
                chunk_size=chunk_size,
            )
            return jnp.sum(out.astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2) if g is None else (0, 1, 2, 3))(q, k, v, g)

    precision = jax.default_matmul_precision(matmul_precision)
    with _capturing_triton_ir() as modules, pallas.tuning(**tuning), precision:
        export_for_cuda(value_and_grads, qkv, qkv, qkv, g, arch=arch)
    return modules


def export_for_cuda(fn, *specs, arch: int = 90):
    """`jax.export` of `jax.jit(fn)` for CUDA on any machine, its Triton kernels lowered for a
    GPU of compute capability `arch` (`GPU_KINDS`). From jax 0.11 the Triton lowering asks the
    GPU for its compute capability; where the machine has none, an abstract device names it."""
    device = jax.sharding.AbstractDevice(device_kind=gpu_kind(arch), num_cores=None, platform="gpu")
    skip_check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[skip_check])(*specs)


@contextlib.contextmanager
def _capturing_triton_ir():
    """{kernel name: Triton IR text} of every kernel lowered inside the block, the pallas form
    traced as on a GPU. JAX has no public way to the Triton IR text of a `pallas_call` (its
    `debug=True` prints it with locations Triton's parser does not read), so this wraps the
    function of JAX's Triton lowering that makes the module."""
    from jax._src.pallas.triton import pallas_call_registration

    lowering = pallas_call_registration.lowering
    make_module = lowering.lower_jaxpr_to_triton_module
    modules = {}

    def capture(jaxpr, *args, **kwargs):
        result = make_module(jaxpr, *args, **kwargs)
        module = result.module.operation
        modules[module.attributes["sym_name"].value] = module.get_asm(enable_debug_info=False)
        return result

    with (
        mock.patch.object(lowering, "lower_jaxpr_to_triton_module", capture),
        mock.patch.object(pallas, "kernel_mode", lambda platform=None: "triton"),
    ):
        yield modules


def compile_resources(ir_text: str, *, arch: int, num_warps: int, num_stages: int) -> dict:
    """Triton's compilation of one kernel for `arch`, and what ptxas says it uses: registers
    (per thread), spill stores and loads and the stack frame (bytes per thread), shared memory
    (bytes per program); status "ok" or why it failed."""
    # Triton 3.9 warns that fused multiply-adds stop being its default in 3.10: keep them.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    triton = _triton()
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nvidia

    row = {"status": "ok"}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp, "kernel.ttir")
        path.write_text(ir_text)
        try:
            kernel = triton.compile(
                str(path),
                target=GPUTarget("cuda", arch, 32),
                options=dict(num_warps=num_warps, num_stages=num_stages),
            )
        except Exception as e:  # noqa: BLE001 - Triton's failure is the row's finding
            row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            return row
        row["smem_bytes"] = kernel.metadata.shared
        row.update(ptx_counts(kernel.asm["ptx"]))
        ptx = pathlib.Path(tmp, "kernel.ptx")
        ptx.write_text(kernel.asm["ptx"])
        # The ptxas Triton itself assembles this architecture's PTX with (Triton 3.9 ships two).
        ptxas = nvidia.get_ptxas(arch).path
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        done = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", str(ptx), "-o", os.devnull], capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"{ptxas} -v failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    row.update(ptxas_usage(done.stderr))
    return row


def ptx_counts(ptx: str) -> dict:
    """Instructions in a kernel's PTX (static counts: each once, however often it runs):
    tensor-core matrix products (`wgmma.mma_async`, `mma.sync`: a TF32 product takes twice the
    bfloat16 one's, k = 8 against 16) and loads from shared memory (`ld.shared`, `ldmatrix`)."""
    ops = re.findall(r"^\s*(?:@!?%\w+\s+)?([a-z]+(?:\.[a-z_]+)?)", ptx, flags=re.MULTILINE)
    return {
        "mma_instructions": sum(op in ("wgmma.mma_async", "mma.sync") for op in ops),
        "shared_loads": sum(op in ("ld.shared", "ldmatrix.sync") for op in ops),
    }


def ptxas_usage(info: str) -> dict:
    """Registers, spills and stack frame from `ptxas -v`'s report of one kernel."""
    found = {
        "registers": re.search(r"Used (\d+) registers", info),
        "spill_stores": re.search(r"(\d+) bytes spill stores", info),
        "spill_loads": re.search(r"(\d+) bytes spill loads", info),
        "stack_bytes": re.search(r"(\d+) bytes stack frame", info),
    }
    missing = [name for name, match in found.items() if match is None]
    if missing:
        raise ValueError(f"ptxas -v reported no {missing}: {info!r}")
    return {name: int(match[1]) for name, match in found.items()}


def _triton():
    try:
        import triton
    except ImportError as e:
        raise ImportError(
            "experiments.kernel_resources compiles with Triton: pip install triton (in the dev extra, "
            'pip install -e ".[dev]", on Linux).'
        ) from e
    return triton


def chunk_size(given: int) -> int:
    """The chunk length the kernels run with (`given`, or the pallas form's default: 0)."""
    return given or pallas.DEFAULT_CHUNK_SIZE


def run(opts: KernelResourcesOptions, out_dir: str | None = None, log=print) -> list[dict]:
    """Every (decay, value block, kernel, warps, stages) row; with `out_dir`, kernel_resources.csv
    and .md there."""
    rows = []
    for decay, block in itertools.product(opts.decays, opts.value_blocks):
        modules = triton_modules(
            decay,
            n=opts.n,
            head_dim=opts.head_dim,
            dtype=opts.dtype,
            chunk_size=opts.chunk_size or None,
            tuning={
                "value_block": block or None,
                "parallel_forward": opts.parallel,
                "parallel_backward": opts.parallel,
                "split_key_value": opts.split_key_value,
                "walks": opts.walks,
            },
            arch=opts.arch,
            normalize=opts.normalize,
            matmul_precision=opts.matmul_precision or None,
        )
        for (name, ir_text), warps, stages in itertools.product(
            modules.items(), opts.num_warps, opts.num_stages
        ):
            row = {
                "kernel": name.removesuffix("_kernel"),
                "decay": decay,
                "chunk_size": chunk_size(opts.chunk_size),
                "value_block": block or opts.head_dim,
                "num_warps": warps,
                "num_stages": stages,
            }
            row.update(compile_resources(ir_text, arch=opts.arch, num_warps=warps, num_stages=stages))
            log(" ".join(f"{k}={row.get(k, '-')}" for k in COLUMNS))
            rows.append(row)
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report.write_csv(out / "kernel_resources.csv", rows)
        title = f"Pallas kernels compiled by Triton {_triton_version()} for sm_{opts.arch}"
        attention = "elu features, normalised" if opts.normalize else "identity features, unnormalised"
        shape = f"{opts.dtype}, D = M = {opts.head_dim}, {attention}"
        if opts.split_key_value:
            shape += ", the backward's dk and dv in programs of their own"
        if opts.walks > 1:
            shape += f", {opts.walks} walks over each sequence's chunks"
        shape += f", matmul precision {opts.matmul_precision or 'JAX default'}"
        table = report.markdown_table(rows, COLUMNS)
        (out / "kernel_resources.md").write_text(f"# {title}\n\n{shape}\n\n{table}\n")
        log(f"wrote {out / 'kernel_resources.csv'}, {out / 'kernel_resources.md'}")
    return rows


def _triton_version() -> str:
    return _triton().__version__
