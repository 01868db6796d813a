"""Figure 1 of the paper: time and peak memory of attention as the sequence length N grows.

Legend: B batch, N sequence length (the paper's N, as the tables name it), H heads, D key/query
features, M value features.

Every case is compiled first; XLA's peak memory for it decides whether it runs (a case that would
not fit in the memory budget is recorded as skipped, with the figure). The batch shrinks as N
grows, B = max(1, tokens // N), as in the paper, and results are also given per sample.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarking import measure, peers
from linear_transformers import ops

KINDS = (
    "softmax",
    "softmax-cudnn",
    "causal-linear/chunked",
    "causal-linear/associative_scan",
    "causal-linear/scan",
    "linear",
    "lsh-1",
    "lsh-4",
    "lsh-8",
)
# The paper's Reformer baselines (causal LSH, R rounds, chunks of 32, 8 buckets: the cost does
# not depend on the bucket count); opt-in with --kinds, so the default run stays as documented.
LSH_CHUNK, LSH_BUCKETS = 32, 8
PASSES = ("forward", "forward+backward")


@dataclasses.dataclass(frozen=True)
class AttentionBenchOptions:
    lengths: tuple[int, ...] = tuple(2**p for p in range(9, 17))
    tokens: int = 4096  # batch = max(1, tokens // N)
    heads: int = 8
    head_dim: int = 64  # D
    value_dim: int = 64  # M
    dtype: str = "float32"
    kinds: tuple[str, ...] = ()  # () = every kind this device can run
    passes: tuple[str, ...] = PASSES
    chunk_size: int = ops.DEFAULT_CHUNK_SIZE
    memory_fraction: float = 0.6  # of the device's free memory, per case
    max_call_seconds: float = 5.0  # a kind slower than this at N skips the longer lengths
    min_repeats: int = 3
    min_seconds: float = 0.5
    seed: int = 0
    peers: tuple[str, ...] = ()  # "fast-transformers": time the authors' library beside ours

    def __post_init__(self):
        peers.check_peers(self.peers)
        for kind in self.kinds:
            if kind not in KINDS:
                raise ValueError(f"unknown attention kind {kind!r}; expected some of {KINDS}.")
        for p in self.passes:
            if p not in PASSES:
                raise ValueError(f"unknown pass {p!r}; expected some of {PASSES}.")
        bad = [n for n in self.lengths if n < 1]
        if bad or not self.lengths:
            raise ValueError(f"lengths must be positive integers, got {self.lengths}.")
        if self.tokens < 1 or self.heads < 1 or self.head_dim < 1 or self.value_dim < 1:
            raise ValueError("tokens, heads, head_dim and value_dim must be >= 1.")


def default_kinds(platform: str) -> tuple[str, ...]:
    """cuDNN flash attention exists only on NVIDIA GPUs."""
    return tuple(k for k in KINDS if not k.startswith("lsh-") and (k != "softmax-cudnn" or platform == "gpu"))


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
        return lambda q, k, v: ops.causal_linear_attention(q, k, v, impl=impl, chunk_size=chunk_size)
    raise ValueError(f"unknown attention kind {kind!r}; expected one of {KINDS}.")


def pass_fn(attend, pass_: str):
    """forward: (q, k, v, g) -> out; forward+backward: -> (dq, dk, dv) for cotangent g."""
    if pass_ == "forward":
        return lambda q, k, v, g: attend(q, k, v)

    def forward_backward(q, k, v, g):
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(g)

    return forward_backward


def random_inputs(opts: AttentionBenchOptions, batch: int, n: int):
    """Random q, k, v and an output cotangent (for the backward pass) of one case, from opts.seed."""
    dtype = jnp.dtype(opts.dtype)
    keys = jax.random.split(jax.random.key(opts.seed), 4)
    shape_q = (batch, n, opts.heads, opts.head_dim)
    shape_v = (batch, n, opts.heads, opts.value_dim)
    return tuple(
        jax.random.normal(key, shape, dtype) for key, shape in zip(keys, (shape_q, shape_q, shape_v, shape_v))
    )


def run_case(
    opts: AttentionBenchOptions, kind: str, pass_: str, n: int, budget: int, *, skip_reason: str | None = None
) -> dict:
    """Compile one case, read its peak memory, and time it unless it is over the budget or
    `skip_reason` says why not (then only the memory figure is kept)."""
    batch = max(1, opts.tokens // n)
    row = {
        "kind": kind,
        "pass": pass_,
        "n": n,
        "batch": batch,
        "heads": opts.heads,
        "head_dim": opts.head_dim,
        "value_dim": opts.value_dim,
        "dtype": opts.dtype,
        "chunk_size": opts.chunk_size if kind == "causal-linear/chunked" else None,
        "time_ms": math.nan,
        "time_per_sample_ms": math.nan,
        "peak_mib": math.nan,
        "peak_per_sample_mib": math.nan,
        "repeats": 0,
        "status": "ok",
    }
    fn = jax.jit(pass_fn(attention_fn(kind, opts.chunk_size), pass_))
    specs = [
        jax.ShapeDtypeStruct(x, jnp.dtype(opts.dtype))
        for x in (
            (batch, n, opts.heads, opts.head_dim),
            (batch, n, opts.heads, opts.head_dim),
            (batch, n, opts.heads, opts.value_dim),
            (batch, n, opts.heads, opts.value_dim),
        )
    ]
    try:
        compiled = fn.lower(*specs).compile()
    except Exception as e:  # noqa: BLE001 - e.g. cuDNN rejecting a dtype: record why, go on
        row["status"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    peak = measure.peak_bytes(compiled)
    if peak is not None:
        row["peak_mib"] = peak / 2**20
        row["peak_per_sample_mib"] = peak / 2**20 / batch
        if peak > budget:
            row["status"] = f"skipped: needs {peak / 2**30:.1f} GiB, budget {budget / 2**30:.1f} GiB"
            return row
    if skip_reason:
        row["status"] = skip_reason
        return row
    timing = measure.time_compiled(
        compiled, *random_inputs(opts, batch, n), min_repeats=opts.min_repeats, min_seconds=opts.min_seconds
    )
    row.update(
        time_ms=timing.median_s * 1e3,
        time_per_sample_ms=timing.median_s * 1e3 / batch,
        repeats=timing.repeats,
    )
    return row


def run(opts: AttentionBenchOptions, *, log=print) -> list[dict]:
    """Every (kind, pass, N) case, shortest N first; returns one row per case."""
    device = jax.devices()[0]
    kinds = opts.kinds or default_kinds(device.platform)
    budget = measure.memory_budget_bytes(device, opts.memory_fraction)
    too_slow: dict[tuple[str, str], str] = {}
    rows = []
    for n in sorted(opts.lengths):
        for kind in kinds:
            for pass_ in opts.passes:
                row = run_case(opts, kind, pass_, n, budget, skip_reason=too_slow.get((kind, pass_)))
                if (kind, pass_) not in too_slow:
                    if row["time_ms"] / 1e3 > opts.max_call_seconds:
                        too_slow[(kind, pass_)] = (
                            f"skipped: {row['time_ms'] / 1e3:.1f} s per call at N={n} > max_call_seconds"
                        )
                rows.append(row)
                log(format_row(row))
                if opts.peers and kind in peers.ATTENTION_KINDS:
                    rows.append(_peer_case(opts, kind, pass_, n, row, too_slow, budget))
                    log(format_row(rows[-1]))
    return rows


def _peer_case(
    opts: AttentionBenchOptions, kind: str, pass_: str, n: int, ours: dict, too_slow: dict, budget: int
) -> dict:
    """The authors' library on our case's shapes; skipped where ours was skipped for memory,
    where theirs would need more than the budget (`peers.attention_peak_bytes`), or where
    theirs grew too slow at a shorter N."""
    peer_kind = "fast-transformers:" + peers.ATTENTION_KINDS[kind]
    reason = too_slow.get((peer_kind, pass_))
    needs = peers.attention_peak_bytes(kind, pass_, n, ours["batch"], opts.heads)
    if ours["status"].startswith("skipped: needs"):
        reason = "skipped: over the memory budget (as ours)"
    elif needs > budget:
        reason = f"skipped: needs at least {needs / 2**30:.1f} GiB, budget {budget / 2**30:.1f} GiB"
    if reason:
        return {
            **ours,
            "kind": peer_kind,
            "chunk_size": None,
            "time_ms": math.nan,
            "time_per_sample_ms": math.nan,
            "peak_mib": math.nan,
            "peak_per_sample_mib": math.nan,
            "repeats": 0,
            "status": reason,
        }
    row = peers.attention_row(
        kind,
        pass_,
        n,
        ours["batch"],
        opts.heads,
        opts.head_dim,
        opts.value_dim,
        opts.dtype,
        min_repeats=opts.min_repeats,
        min_seconds=opts.min_seconds,
        seed=opts.seed,
    )
    if row["time_ms"] / 1e3 > opts.max_call_seconds:
        too_slow[(peer_kind, pass_)] = (
            f"skipped: {row['time_ms'] / 1e3:.1f} s per call at N={n} > max_call_seconds"
        )
    return row


def format_row(row: dict) -> str:
    return (
        f"N={row['n']:>6} B={row['batch']:>3} {row['kind']:<31} {row['pass']:<16} "
        f"{row['time_ms']:>10.2f} ms {row['peak_mib']:>10.1f} MiB  {row['status']}"
    )


def speedups(rows: list[dict], baseline: str = "causal-linear/chunked") -> list[dict]:
    """time(kind) / time(baseline) for every N and pass where both ran."""
    times = {(r["kind"], r["pass"], r["n"]): r["time_ms"] for r in rows if r["status"] == "ok"}
    out = []
    for (kind, pass_, n), t in sorted(times.items(), key=lambda x: (x[0][2], x[0][1], x[0][0])):
        base = times.get((baseline, pass_, n))
        if base and kind != baseline:
            out.append({"n": n, "pass": pass_, "kind": kind, f"slower_than_{baseline}": t / base})
    return out


def memory_slopes(rows: list[dict], pass_: str = "forward+backward") -> dict[str, float]:
    """Log-log slope of peak memory per sample vs N, over the lengths where B == 1 (pure N)."""
    slopes = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        pts = [
            (r["n"], r["peak_mib"])
            for r in rows
            if r["kind"] == kind and r["pass"] == pass_ and r["batch"] == 1 and np.isfinite(r["peak_mib"])
        ]
        if len(pts) >= 2:
            n, mem = np.log(np.array(pts)).T
            slopes[kind] = float(np.polyfit(n, mem, 1)[0])
    return slopes


def run_and_report(opts: AttentionBenchOptions, out_dir, *, log=print) -> dict:
    """Run every case, print the tables, write attention.csv/json/png under out_dir."""
    import pathlib

    from experiments.benchmarking import report

    out_dir = pathlib.Path(out_dir)
    machine = measure.machine_description()
    log(f"machine: {machine}")
    rows = run(opts, log=log)
    ours_rows = [r for r in rows if not r["kind"].startswith("fast-transformers:")]
    ratios = speedups(ours_rows)
    slopes = memory_slopes(ours_rows)
    peer_ratios = peers.same_run_ratios(
        rows, ("n", "batch", "pass"), "time_ms", peers.ATTENTION_KINDS, "kind"
    )
    files = {
        "csv": report.write_csv(out_dir / "attention.csv", rows),
        "json": report.write_json(
            out_dir / "attention.json",
            machine=machine,
            options=dataclasses.asdict(opts),
            rows=rows,
            speedups=ratios,
            memory_slopes=slopes,
            peer_ratios=peer_ratios,
        ),
    }
    plotted = "forward+backward" if "forward+backward" in opts.passes else opts.passes[0]
    mine = [r for r in rows if r["pass"] == plotted]
    kinds = list(dict.fromkeys(r["kind"] for r in mine))
    panels = [
        {
            "xlabel": "sequence length N",
            "ylabel": f"{plotted} time per sample (ms)",
            "series": {k: [(r["n"], r["time_per_sample_ms"]) for r in mine if r["kind"] == k] for k in kinds},
        },
        {
            "xlabel": "sequence length N",
            "ylabel": "peak memory per sample (MiB, XLA)",
            "series": {
                k: [
                    (r["n"], r["peak_per_sample_mib"] if r["status"] == "ok" else math.nan)
                    for r in mine
                    if r["kind"] == k
                ]
                for k in kinds
            },
        },
    ]
    files["png"] = report.plot_series(
        out_dir / "attention.png",
        panels,
        title=(
            f"{machine['device']}, {opts.dtype}, H={opts.heads}, D={opts.head_dim}, "
            f"M={opts.value_dim}, batch=max(1, {opts.tokens}/N); jax {machine['jax']}"
        ),
    )
    log(
        "\n"
        + report.markdown_table(
            rows, ["n", "batch", "kind", "pass", "time_ms", "time_per_sample_ms", "peak_mib", "status"]
        )
    )
    if ratios:
        log("\ntime / time(causal-linear/chunked):\n" + report.markdown_table(ratios, list(ratios[0].keys())))
    if peer_ratios:
        log(
            "\nthe authors' library in this run (theirs_over_ours > 1: ours is faster):\n"
            + report.markdown_table(peer_ratios, list(peer_ratios[0]))
        )
        files["peers_csv"] = report.write_csv(out_dir / "attention_peers.csv", peer_ratios)
    log(
        "\nlog-log slope of peak memory vs N (batch 1): "
        + ", ".join(f"{k} {v:.2f}" for k, v in slopes.items())
    )
    log("wrote " + ", ".join(str(p) for p in files.values()))
    return {
        "rows": rows,
        "speedups": ratios,
        "memory_slopes": slopes,
        "peer_ratios": peer_ratios,
        "files": files,
    }
