"""The Pallas kernel of the gated family against XLA's chunked form and against the memory roof,
timed in one run: the accelerator benchmark's "kernel" part.

Legend: B batch, N sequence length, H heads, D key/query features, M value features.

Cases (`kind`): "gated-{decay}/{impl}" (`gated_bench`'s: decay none, step or feature; impl
"pallas" or "chunked") and "copy-{decay}", the roof: one elementwise pass that reads the
forward's inputs (q, k, v and the log decays) and writes an output of its size, the bytes the
forward must move at least. Every row has `bytes` (what its forward reads and writes) and
`gb_per_s` (bytes / time: for a forward, the bandwidth it achieved; the copy's is the device's,
measured). The copy runs forward only.

A kernel row may name a `tuning` (`pallas.Tuning`: value blocks, warps, pipeline stages), the
launch it was timed with ("default" where it names none); `comparison` and the goals read the
default launch, `tunings` sets each other launch against it, and `fastest` names each case's
fastest launch, at which the goals are read again (the launch a default could take).

Every kernel row that ran is checked before its time counts: `rel_err`, its result (the output,
or every gradient) against XLA's chunked form on the same inputs upcast to float32 with
full-precision products, max over the results of |got - want| / |want|. Past `REL_ERR_LIMIT`
(or NaN) the row's status says "wrong" and no table or goal reads its time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarking import attention_bench, gated_bench
from linear_transformers.ops.gated_linear import pallas

DECAYS = ("none", "step", "feature")
# The goals of the kernel (bf16, N = 16384): the forward within this many times the copy of its
# bytes; forward+backward at least this many times faster than cuDNN flash attention; a decay
# within this factor of no decay (forward+backward).
ROOF_GOAL = 3.0
CUDNN_GOAL = 10.0
DECAY_GOAL = 1.3
# Launches to try beside the default (`pallas.Tuning`, the op's chunk length, and JAX's default
# matmul precision), in the order they are timed (a run out of time cuts the last): the parallel
# forward and backward write the states entering every chunk (and backward the cotangents of those
# leaving it), then make every chunk's output or gradients at once, FLA's design (fewer registers,
# no spills at chunks of 32 but in the normalised gradients with a decay per step; their forward
# alone is the parallel forward's time, their backward the difference); the parallel forms walking
# each sequence's chunks in eight stretches at once (their one serial part, 512 chunks of 32 at N =
# 16384, cut eight-fold, and eight times the B * H = 64 programs walking: `pallas.Tuning.walks`), at
# chunks of 32 and 64; the one-pass kernels walking two stretches (128 programs, one wave on an
# H100's 132 SMs where a decay's 236 to 255 registers a thread leave one program an SM) and eight
# (more programs to hide each other's latency), after a kernel that walks the stretches from zero
# writing only their ends; chunks of 64 halve the steps of a program's loop but spill registers
# (`experiments/kernel_resources.py`), chunks of 16 double them and spill nothing; dk and dv in
# programs of their own (three programs a sequence or chunk backward: fewer spills, the walk back
# made twice; with the parallel forms at chunks of 64, no spills without a decay per feature); the
# parallel forms at 64 with value blocks of 32 (twice the programs walking the chunks, the
# sequential part), and at 32 with four warps (no spills there at 72 to 255 registers, so more
# programs an SM); TF32 products of the kernels' float32 values, where by default bf16 inputs
# multiply in bf16 (twice the tensor-core instructions, more shared-memory traffic:
# `pallas.products`); value blocks give M / value_block programs per (batch, head), where B *
# H = 64 at the goals' shape leaves an H100's 132 SMs half idle; the backward's passes in one
# program; fewer warps or more pipeline stages trade registers for latency hiding. A launch that
# changes only the backward (`BACKWARD_ONLY`) is not timed forward, where it is the default launch.
TUNINGS = (
    {"parallel_forward": True, "parallel_backward": True},
    {"parallel_forward": True, "parallel_backward": True, "walks": 8},
    {"parallel_forward": True, "parallel_backward": True, "walks": 8, "chunk_size": 64},
    {"walks": 2},
    {"walks": 8},
    {"parallel_forward": True, "parallel_backward": True, "chunk_size": 64},
    {"parallel_forward": True, "parallel_backward": True, "chunk_size": 64, "split_key_value": True},
    {"parallel_forward": True, "parallel_backward": True, "chunk_size": 64, "value_block": 32},
    {"parallel_forward": True, "parallel_backward": True, "num_warps": 4},
    {"matmul_precision": "tensorfloat32"},
    {"chunk_size": 64},
    {"chunk_size": 16},
    {"split_key_value": True},
    {"value_block": 32},
    {"value_block": 16},
    {"split_backward": False},
    {"num_warps": 4},
    {"num_stages": 3},
)
DEFAULT_TUNING = "default"
BACKWARD_ONLY = frozenset({"split_backward", "split_key_value", "parallel_backward"})


def times_pass(tuning: dict | None, pass_: str) -> bool:
    """Whether the sweep times launch `tuning` for `pass_`: not the forward of a launch that
    changes only the backward (its forward is the default launch's)."""
    return pass_ != "forward" or not tuning or not set(tuning) <= BACKWARD_ONLY


# bf16 operands land between 1e-3 and 1e-2 of a float32 result, TF32 products near 3e-4.
REL_ERR_LIMIT = 2e-2


def tuning_label(tuning: dict | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((tuning or {}).items())) or DEFAULT_TUNING


def is_default_launch(row: dict) -> bool:
    """The row is not the kernel at one of `TUNINGS` (a CSV's empty cell included)."""
    return (row.get("tuning") or DEFAULT_TUNING) == DEFAULT_TUNING


def copy_kind(decay: str) -> str:
    return f"copy-{decay}"


def forward_bytes(specs) -> int:
    """What a forward reads (every spec but the output cotangent, the last) and writes (an
    output the size of v, the third)."""
    read = sum(s.size * s.dtype.itemsize for s in specs[:-1])
    return int(read + specs[2].size * specs[2].dtype.itemsize)


def _copy(q, k, v, *rest):
    """Reads q, k, v and the log decays once, writes one [B, N, H, M] array (M = D); `rest`:
    ([log decay,] the output cotangent, unused)."""
    out = q + k + v
    if len(rest) == 2:
        g = rest[0]
        out = out + (g if g.ndim == 4 else g[..., None]).astype(out.dtype)
    return out


def run_case(
    opts: gated_bench.GatedBenchOptions,
    kind: str,
    pass_: str,
    n: int,
    budget: int,
    *,
    tuning: dict | None = None,
) -> dict:
    """One case: a gated kind as `gated_bench` defines it, or the copy of its decay's bytes;
    a pallas kind launched as `tuning` says (None: the default), whose "chunk_size", if any, is
    the op's chunk length, "matmul_precision" `jax.default_matmul_precision` while the case is
    traced, and the rest `pallas.Tuning`'s."""
    batch = opts.batch_for(n)
    copy = kind.startswith("copy-")
    gated_kind = f"gated-{kind.removeprefix('copy-')}/pallas" if copy else kind
    decay, impl = gated_bench.parse_kind(gated_kind)
    launch = dict(tuning or {})
    chunk_size = launch.pop("chunk_size", opts.chunk_size)
    precision = launch.pop("matmul_precision", None)
    chunk = None if copy else gated_bench.chunk_size_used(kind, chunk_size)
    labels = {"decay": decay, "impl": "copy" if copy else impl}
    row = attention_bench.case_row(opts, kind, pass_, n, batch, chunk, labels, per_sample_peak=False)
    specs = gated_bench.input_specs(opts, gated_kind, batch, n)
    row["bytes"] = forward_bytes(specs)
    if copy:
        if pass_ != "forward":
            raise ValueError(f"{kind} is the forward's roof: it has no {pass_!r} pass.")
        fn = _copy
    else:
        fn = attention_bench.pass_fn(gated_bench.attention_fn(kind, chunk_size), pass_)
    inputs = functools.partial(gated_bench.random_inputs, opts, gated_kind, batch, n)
    if tuning is not None:
        if impl != "pallas" or copy:
            raise ValueError(f"a tuning is a launch of the pallas kernel; {kind} has none.")
        row["tuning"] = tuning_label(tuning)

    def check(row, compiled):  # the kernel's result, from the executable just timed
        row["rel_err"] = relative_error(compiled(*inputs()), _reference(opts, decay, pass_, n, inputs))
        if not row["rel_err"] <= REL_ERR_LIMIT:  # NaN too
            limit = f"{REL_ERR_LIMIT:g} against the float32 chunked form"
            row["status"] = f"wrong: rel_err {row['rel_err']:.3g} > {limit}"

    # Both read when the case is traced, inside time_case.
    with pallas.tuning(**launch), jax.default_matmul_precision(precision):
        kernel = impl == "pallas" and not copy
        row = attention_bench.time_case(opts, row, fn, specs, inputs, budget, check=check if kernel else None)
    row["gb_per_s"] = row["bytes"] / (row["time_ms"] * 1e6) if row["status"] == "ok" else float("nan")
    return row


def relative_error(got, want) -> float:
    """max over the leaves of |got - want| / |want| (Frobenius norms, float32); NaN where any
    leaf has a NaN or infinity."""
    errors = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = (jnp.ravel(x).astype(jnp.float32) for x in (g, w))
        errors.append(float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)))
    return float("nan") if not np.all(np.isfinite(errors)) else max(errors)


# The reference results of the last cases (a kernel's launches of one decay and pass share one).
_REFERENCES: dict = {}


def _reference(opts, decay: str, pass_: str, n: int, inputs):
    """XLA's chunked form of `decay` on `inputs()` upcast to float32, products at full
    precision: the pass's result (`attention_bench.pass_fn`)."""
    key = (opts, decay, pass_, n)
    if key not in _REFERENCES:
        if len(_REFERENCES) >= 2:
            del _REFERENCES[next(iter(_REFERENCES))]
        fn = attention_bench.pass_fn(gated_bench.attention_fn(f"gated-{decay}/chunked", None), pass_)
        with jax.default_matmul_precision("highest"):
            _REFERENCES[key] = jax.jit(fn)(*(x.astype(jnp.float32) for x in inputs()))
    return _REFERENCES[key]


def comparison(rows: list[dict]) -> list[dict]:
    """Per (N, decay, pass): the kernel's, XLA's and the copy's ms, the kernel's GB/s and its
    time over the copy's (forward) and XLA's over the kernel's."""
    ran = default_launches(rows)
    nan = float("nan")

    def field(row, name):
        return row[name] if row else nan

    out = []
    for n in dict.fromkeys(r["n"] for r in rows if "n" in r):
        for decay in DECAYS:
            copy = ran.get((n, copy_kind(decay), "forward"))
            for pass_ in attention_bench.PASSES:
                kernel = ran.get((n, f"gated-{decay}/pallas", pass_))
                xla = ran.get((n, f"gated-{decay}/chunked", pass_))
                if not (kernel or xla):
                    continue
                kernel_ms, xla_ms, copy_ms = (field(r, "time_ms") for r in (kernel, xla, copy))
                out.append(
                    {
                        "n": n,
                        "decay": decay,
                        "pass": pass_,
                        "pallas_ms": kernel_ms,
                        "xla_chunked_ms": xla_ms,
                        "copy_ms": copy_ms,
                        "pallas_gb_per_s": field(kernel, "gb_per_s"),
                        "copy_gb_per_s": field(copy, "gb_per_s"),
                        "pallas_over_copy": kernel_ms / copy_ms if pass_ == "forward" else nan,
                        "xla_over_pallas": xla_ms / kernel_ms,
                    }
                )
    return out


def _ran(rows: list[dict]):
    """The rows of cases that ran."""
    return (r for r in rows if r.get("status") == "ok" and "kind" in r and "n" in r)


def default_launches(rows: list[dict]) -> dict:
    """{(n, kind, pass): row} of the rows that ran, at the kernel's default launch."""
    return {(r["n"], r["kind"], r["pass"]): r for r in _ran(rows) if is_default_launch(r)}


def fastest_launches(rows: list[dict]) -> dict:
    """{(n, kind, pass): row} of the rows that ran, each case's fastest: its default launch or
    one of `TUNINGS` (a kind timed at one launch, the copy and cuDNN, at that one)."""
    fastest = {}
    for r in _ran(rows):
        key = (r["n"], r["kind"], r["pass"])
        if key not in fastest or r["time_ms"] < fastest[key]["time_ms"]:
            fastest[key] = r
    return fastest


def _against_default(launched: list[dict], rows: list[dict], ratio: str) -> list[dict]:
    """Per row of `launched`: its launch and ms, the default launch's ms in `rows` (same N,
    kind and pass) and default / its, as `ratio`."""
    default = default_launches(rows)
    out = []
    for r in launched:
        base = default.get((r["n"], r["kind"], r["pass"]))
        base_ms = base["time_ms"] if base else float("nan")
        out.append(
            {
                "n": r["n"],
                "decay": r["decay"],
                "pass": r["pass"],
                "tuning": r.get("tuning") or DEFAULT_TUNING,
                "pallas_ms": r["time_ms"],
                "default_ms": base_ms,
                ratio: base_ms / r["time_ms"],
            }
        )
    return out


def fastest(rows: list[dict]) -> list[dict]:
    """Per (N, decay, pass) the kernel ran at: its fastest launch, its ms and the default
    launch's, and default / fastest (1 where the default is the fastest)."""
    launched = [r for r in fastest_launches(rows).values() if r["kind"].endswith("/pallas")]
    return _against_default(launched, rows, "default_over_fastest")


def tunings(rows: list[dict]) -> list[dict]:
    """Per launch the kernel was tried with: its ms and the default launch's (same N, decay and
    pass), and default / it (> 1: the launch is faster)."""
    launched = [r for r in rows if r.get("status") == "ok" and not is_default_launch(r)]
    return _against_default(launched, rows, "default_over_tuned")
