"""Figure 1 of the paper: time and peak memory of attention as the sequence length N grows.

Legend: B batch, N sequence length (the paper's N, as the tables name it), H heads, D key/query
features, M value features.

Every case is compiled first; XLA's peak memory for it decides whether it runs (a case that would
not fit in the memory budget is recorded as skipped, with the figure). The batch shrinks as N
grows, B = max(1, tokens // N), as in the paper, and results are also given per sample. The
sweep over (N, kind, pass) cases (`sweep`, `time_case`) is also gated_bench's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from experiments.benchmarking import measure, peers, report
from linear_transformers import ops
from linear_transformers.ops.gated_linear import pallas

KINDS = (
    "softmax",
    "softmax-cudnn",
    "causal-linear/chunked",
    "causal-linear/associative_scan",
    "causal-linear/scan",
    "causal-linear/pallas",
    "linear",
    "lsh-1",
    "lsh-4",
    "lsh-8",
)
BASELINE = "causal-linear/chunked"
# The Pallas kernel (a GPU's: Pallas's interpreter on a CPU, which no timing should read).
PALLAS = "causal-linear/pallas"
# The paper's Reformer baselines (causal LSH, R rounds, chunks of 32, 8 buckets: the cost does
# not depend on the bucket count); opt-in with --kinds, so the default run stays as documented.
LSH_CHUNK, LSH_BUCKETS = 32, 8
PASSES = ("forward", "forward+backward")


@dataclasses.dataclass(frozen=True)
class SweepOptions(measure.CaseOptions):
    """The shapes of a sweep over (N, kind, pass) cases (`sweep`; gated_bench's too).

    lengths: Sequence lengths N.
    tokens: Batch = max(1, tokens // N).
    heads: Heads H.
    head_dim: Query/key features per head D.
    value_dim: Value features per head M.
    passes: forward, forward+backward.
    max_call_seconds: Stop growing N for a case once one call takes longer.
    """

    lengths: tuple[int, ...] = tuple(2**p for p in range(9, 17))
    tokens: int = 4096
    heads: int = 8
    head_dim: int = 64
    value_dim: int = 64
    passes: tuple[str, ...] = PASSES
    max_call_seconds: float = 5.0

    def __post_init__(self):
        measure.check_known("pass", self.passes, PASSES)
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive integers, got {self.lengths}.")
        if self.tokens < 1 or self.heads < 1 or self.head_dim < 1 or self.value_dim < 1:
            raise ValueError("tokens, heads, head_dim and value_dim must be >= 1.")


@dataclasses.dataclass(frozen=True)
class AttentionBenchOptions(SweepOptions):
    """What `run` measures.

    dtype: Input dtype.
    kinds: Kinds to run (default: all this device can run, but the opt-in LSH baselines lsh-1,
        lsh-4, lsh-8).
    chunk_size: Chunk length of the chunked form (default: the library's, ops.DEFAULT_CHUNK_SIZE).
    peers: Also time these libraries on the same cases, in this run: fast-transformers (the
        authors'; needs torch and pytorch-fast-transformers importable).
    """

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kinds: tuple[str, ...] = ()
    chunk_size: int | None = None
    peers: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "chunk_size", self.chunk_size or ops.DEFAULT_CHUNK_SIZE)
        peers.check_peers(self.peers)
        measure.check_known("attention kind", self.kinds, KINDS)


def default_kinds(platform: str) -> tuple[str, ...]:
    """cuDNN flash attention exists only on NVIDIA GPUs, the Pallas kernel only runs compiled
    there."""
    gpu_only = ("softmax-cudnn", PALLAS)
    return tuple(k for k in KINDS if not k.startswith("lsh-") and (k not in gpu_only or platform == "gpu"))


def attention_fn(kind: str, chunk_size: int):
    """(q, k, v) -> out for one benchmark kind."""
    if kind == "softmax":
        # The library's default: blocks of queries on CPU, jax.nn.dot_product_attention elsewhere.
        return lambda q, k, v: ops.softmax_attention(q, k, v, causal=True)
    if kind == "softmax-cudnn":
        return lambda q, k, v: ops.softmax_attention(q, k, v, causal=True, implementation="cudnn")
    if kind == "linear":
        return ops.linear_attention
    if kind.startswith("lsh-"):
        rounds = int(kind.split("-")[1])
        return lambda q, k, v: ops.lsh_attention(
            q,
            v,
            ops.lsh_rotations(jax.random.key(0), rounds, q.shape[-1], LSH_BUCKETS),
            chunk_size=LSH_CHUNK,
            causal=True,
        )
    if kind.startswith("causal-linear/"):
        impl = kind.split("/", 1)[1]
        chunk_size = None if impl == "pallas" else chunk_size  # the kernel's own default launch
        return lambda q, k, v: ops.causal_linear_attention(
            q, k, v, implementation=impl, chunk_size=chunk_size
        )
    raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}.")


def pass_fn(attend, pass_: str):
    """forward: (*primals, g) -> out; forward+backward: -> the VJP of every primal (q, k, v, and
    more where `attend` takes more) for the output cotangent g."""
    if pass_ == "forward":
        return lambda *args: attend(*args[:-1])

    def forward_backward(*args):
        _, vjp = jax.vjp(attend, *args[:-1])
        return vjp(args[-1])

    return forward_backward


def input_specs(opts, batch: int, n: int, *extra: jax.ShapeDtypeStruct) -> list[jax.ShapeDtypeStruct]:
    """Shapes of (q, k, v, *extra, output cotangent) of one case."""
    dtype = jnp.dtype(opts.dtype)
    qk = jax.ShapeDtypeStruct((batch, n, opts.heads, opts.head_dim), dtype)
    vo = jax.ShapeDtypeStruct((batch, n, opts.heads, opts.value_dim), dtype)
    return [qk, qk, vo, *extra, vo]


def normal_inputs(specs, seed: int) -> tuple:
    """Standard normal arrays of `specs`, from `seed`."""
    keys = jax.random.split(jax.random.key(seed), len(specs))
    return tuple(jax.random.normal(key, s.shape, s.dtype) for key, s in zip(keys, specs))


def random_inputs(opts: AttentionBenchOptions, batch: int, n: int):
    """Random q, k, v and an output cotangent (for the backward pass) of one case, from opts.seed."""
    return normal_inputs(input_specs(opts, batch, n), opts.seed)


def case_row(opts, kind: str, pass_: str, n: int, batch: int, chunk_size, labels=(), per_sample_peak=True):
    """A case's row before it runs: what it is, then its figures (NaN) and status."""
    figures = ("time_ms", "time_per_sample_ms", "peak_mib") + ("peak_per_sample_mib",) * per_sample_peak
    return {
        "kind": kind,
        **dict(labels),
        "pass": pass_,
        "n": n,
        "batch": batch,
        "heads": opts.heads,
        "head_dim": opts.head_dim,
        "value_dim": opts.value_dim,
        "dtype": opts.dtype,
        "chunk_size": chunk_size,
        **dict.fromkeys(figures, math.nan),
        "repeats": 0,
        "status": "ok",
    }


def time_case(
    opts, row: dict, fn, specs, inputs, budget: int, skip_reason: str | None = None, check=None
) -> dict:
    """Compile `fn` for `specs`, read its peak memory, and time it on `inputs()` unless it is over
    the budget or `skip_reason` says why not (then only the memory figure is kept); then, where
    it ran, `check(row, compiled)` (the same executable) may add to the row."""
    try:
        compiled = jax.jit(fn).lower(*specs).compile()
    except Exception as e:  # noqa: BLE001 - e.g. cuDNN rejecting a dtype: record why, go on
        row["status"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    timing = measure.fit_and_time(row, compiled, inputs, budget, opts, skip_reason=skip_reason)
    if "peak_per_sample_mib" in row:
        row["peak_per_sample_mib"] = row["peak_mib"] / row["batch"]
    if timing:
        row.update(time_ms=timing.median_s * 1e3, time_per_sample_ms=timing.median_s * 1e3 / row["batch"])
        if check is not None:
            check(row, compiled)
    return row


def run_case(
    opts: AttentionBenchOptions, kind: str, pass_: str, n: int, budget: int, *, skip_reason: str | None = None
) -> dict:
    """One (kind, pass, N) case (`time_case`)."""
    batch = max(1, opts.tokens // n)
    chunk = {BASELINE: opts.chunk_size, PALLAS: pallas.DEFAULT_CHUNK_SIZE}.get(kind)
    row = case_row(opts, kind, pass_, n, batch, chunk)
    fn = pass_fn(attention_fn(kind, opts.chunk_size), pass_)
    specs = input_specs(opts, batch, n)
    return time_case(
        opts, row, fn, specs, functools.partial(random_inputs, opts, batch, n), budget, skip_reason
    )


def sweep(opts, kinds, run_case, *, extra=None, log=print) -> list[dict]:
    """Every (N, kind, pass) case, shortest N first: `run_case(opts, kind, pass_, n, budget,
    skip_reason=...)`, then `extra(opts, row, too_slow, budget)`'s rows (the peer's). A (kind,
    pass) slower than opts.max_call_seconds per call is only compiled (memory) at longer N."""
    budget = opts.budget_bytes()
    too_slow: dict[tuple[str, str], str] = {}
    rows = []
    for n in sorted(opts.lengths):
        for kind in kinds:
            for pass_ in opts.passes:
                found = [run_case(opts, kind, pass_, n, budget, skip_reason=too_slow.get((kind, pass_)))]
                found += extra(opts, found[0], too_slow, budget) if extra else []
                for row in found:
                    if (row["kind"], pass_) not in too_slow and row["time_ms"] / 1e3 > opts.max_call_seconds:
                        too_slow[(row["kind"], pass_)] = (
                            f"skipped: {row['time_ms'] / 1e3:.1f} s per call at N={n} > max_call_seconds"
                        )
                    rows.append(row)
                    log(format_row(row))
    return rows


def run(opts: AttentionBenchOptions, *, log=print) -> list[dict]:
    """Every (kind, pass, N) case, shortest N first; returns one row per case."""
    kinds = opts.kinds or default_kinds(jax.devices()[0].platform)
    return sweep(opts, kinds, run_case, extra=peer_rows if opts.peers else None, log=log)


def peer_rows(opts: AttentionBenchOptions, ours: dict, too_slow: dict, budget: int) -> list[dict]:
    """The authors' library on our case's shapes (none if it has no such kind); skipped where
    ours was skipped for memory, where theirs would need more than the budget
    (`peers.attention_peak_bytes`), or where theirs grew too slow at a shorter N."""
    kind, pass_, n, batch = ours["kind"], ours["pass"], ours["n"], ours["batch"]
    if kind not in peers.ATTENTION_KINDS:
        return []
    row = case_row(opts, "fast-transformers:" + peers.ATTENTION_KINDS[kind], pass_, n, batch, None)
    needs = peers.attention_peak_bytes(kind, pass_, n, batch, opts.heads)
    if ours["status"].startswith("skipped: needs"):
        row["status"] = "skipped: over the memory budget (as ours)"
    elif needs > budget:
        row["status"] = f"skipped: needs at least {needs / 2**30:.1f} GiB, budget {budget / 2**30:.1f} GiB"
    elif (row["kind"], pass_) in too_slow:
        row["status"] = too_slow[(row["kind"], pass_)]
    elif opts.dtype != "float32":
        row["status"] = "unavailable: the peer runs in float32 only"
    else:
        call = peers.attention_call(
            kind, pass_, n, batch, opts.heads, opts.head_dim, opts.value_dim, seed=opts.seed
        )
        timing = measure.time_call(call, min_repeats=opts.min_repeats, min_seconds=opts.min_seconds)
        ms = timing.median_s * 1e3
        row.update(time_ms=ms, time_per_sample_ms=ms / batch, repeats=timing.repeats)
    return [row]


def format_row(row: dict) -> str:
    return (
        f"N={row['n']:>6} B={row['batch']:>3} {row['kind']:<31} {row['pass']:<16} "
        f"{row['time_ms']:>10.2f} ms {row['peak_mib']:>10.1f} MiB  {row['status']}"
    )


def speedups(rows: list[dict], baseline: str = BASELINE) -> list[dict]:
    """time(kind) / time(baseline) for every N and pass where both ran."""
    pairs = report.paired(rows, ("pass", "n"), "kind", baseline, "time_ms")
    return [
        {
            "n": r["n"],
            "pass": r["pass"],
            "kind": r["kind"],
            f"slower_than_{baseline}": r["time_ms"] / b["time_ms"],
        }
        for r, b in sorted(pairs, key=lambda p: (p[0]["n"], p[0]["pass"], p[0]["kind"]))
    ]


def memory_slopes(rows: list[dict], pass_: str = "forward+backward") -> dict[str, float]:
    """Log-log slope of peak memory per sample vs N, over the lengths where B == 1 (pure N)."""
    return report.log_log_slopes([r for r in rows if r["pass"] == pass_ and r["batch"] == 1], "n", "peak_mib")


def per_sample_panels(rows: list[dict], passes, memory: bool) -> list[dict]:
    """Time per sample vs N for each of `passes`, then (`memory`) the last one's peak memory
    per sample, a line per kind (cases that did not run left out)."""

    def lines(pass_, field):
        ran = [
            {**r, field: r[field] if r["status"] == "ok" else math.nan} for r in rows if r["pass"] == pass_
        ]
        return report.series(ran, "n", field, lambda r: r["kind"])

    found = {f"{p} time per sample (ms)": lines(p, "time_per_sample_ms") for p in passes}
    if memory:
        found["peak memory per sample (MiB, XLA)"] = lines(passes[-1], "peak_per_sample_mib")
    return report.panels("sequence length N", found)


def summarize(opts: AttentionBenchOptions, rows: list[dict], machine: dict) -> report.Report:
    ours = [r for r in rows if not r["kind"].startswith("fast-transformers:")]
    ratios, slopes = speedups(ours), memory_slopes(ours)
    peer_ratios = peers.same_run_ratios(
        rows, ("n", "batch", "pass"), "time_ms", peers.ATTENTION_KINDS, "kind"
    )
    plotted = "forward+backward" if "forward+backward" in opts.passes else opts.passes[0]
    return report.Report(
        rows,
        ("n", "batch", "kind", "pass", "time_ms", "time_per_sample_ms", "peak_mib", "status"),
        tables=[
            report.Table(ratios, f"time / time({BASELINE})"),
            report.Table(peer_ratios, peers.RATIOS_HEADING, csv="peers"),
        ],
        extra={"speedups": ratios, "memory_slopes": slopes, "peer_ratios": peer_ratios},
        panels=per_sample_panels(rows, [plotted], memory=True),
        title=(
            f"{machine['device']}, {opts.dtype}, H={opts.heads}, D={opts.head_dim}, "
            f"M={opts.value_dim}, batch=max(1, {opts.tokens}/N); jax {machine['jax']}"
        ),
        notes=[
            "\nlog-log slope of peak memory vs N (batch 1): "
            + ", ".join(f"{k} {v:.2f}" for k, v in slopes.items())
        ],
    )


def run_and_report(opts: AttentionBenchOptions, out_dir, *, log=print) -> dict:
    """Run every case, print the tables, write attention.csv/json/png (and attention_peers.csv)."""
    return report.run_and_report("attention", opts, out_dir, run, summarize, log=log)
