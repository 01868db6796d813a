"""What a decay costs: `gated_linear_attention` with each shape of log decay against plain
`causal_linear_attention`, timed in the same run.

Legend: B batch, N sequence length, H heads, D key/query features (F = D: the gated cases use
the identity feature map), M value features.

Cases (`kind`): "causal-linear/chunked" (the paper's op: elu, normalised, no decay; the
baseline every ratio is taken against) and "gated-{decay}/{impl}" with decay

  none     no decay (normalize=False, identity feature map, scale D**-0.5)
  head     [H], a constant per head (RetNet, Lightning)
  step     [B, N, H], per head and step (Mamba-2, simple GLA)
  feature  [B, N, H, D], per key feature and step (GLA)

and impl "chunked" (the op's default) or "quadratic" (the dense [N, N] reference; [N, N, D]
with per-feature decays), which runs only where XLA's peak memory for it fits the budget.
Forward+backward is the VJP with respect to q, k, v and the log decay. Log decays are
`log_sigmoid(logits + decay_logit_bias)` of standard normal logits, in float32 (the op
accumulates decays in float32 whatever the input dtype): with the default bias of 3 a step
keeps ~95% of the state (between 0.75 and 0.99 for 95% of the draws), as trained gates do.
Timing, memory and the skipping rules are `attention_bench`'s.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from experiments.benchmarking import attention_bench, measure
from linear_transformers import ops

BASELINE = "causal-linear/chunked"
DECAYS = ("none", "head", "step", "feature")
IMPLS = ("chunked", "quadratic")
PASSES = attention_bench.PASSES
DTYPES = ("float32", "bfloat16")
# The goal the table states: a decay costs at most this much over plain causal linear
# (chunked, forward+backward, same run).
GOAL_RATIO = 1.3
GOAL_PASS = "forward+backward"
GOAL_DECAYS = ("head", "step", "feature")


@dataclasses.dataclass(frozen=True)
class GatedBenchOptions:
    lengths: tuple[int, ...] = (4096, 16384)
    tokens: int = 4096  # batch = max(1, tokens // N), unless `batch` is set
    batch: int | None = None
    heads: int = 8
    head_dim: int = 64  # D (= F)
    value_dim: int = 64  # M
    dtype: str = "float32"
    decays: tuple[str, ...] = DECAYS
    impls: tuple[str, ...] = IMPLS
    passes: tuple[str, ...] = PASSES
    chunk_size: int | None = None  # None: the op's default (64)
    decay_logit_bias: float = 3.0
    memory_fraction: float = 0.6  # of the device's free memory, per case
    max_call_seconds: float = 5.0  # a case slower than this at N skips the longer lengths
    min_repeats: int = 3
    min_seconds: float = 0.5
    seed: int = 0

    def __post_init__(self):
        for name, values, known in (
            ("decay", self.decays, DECAYS),
            ("impl", self.impls, IMPLS),
            ("pass", self.passes, PASSES),
        ):
            for value in values:
                if value not in known:
                    raise ValueError(f"unknown {name} {value!r}; expected some of {known}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}.")
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive integers, got {self.lengths}.")
        if self.tokens < 1 or self.heads < 1 or self.head_dim < 1 or self.value_dim < 1:
            raise ValueError("tokens, heads, head_dim and value_dim must be >= 1.")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"batch must be None or >= 1, got {self.batch}.")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be None or >= 1, got {self.chunk_size}.")

    def batch_for(self, n: int) -> int:
        return self.batch or max(1, self.tokens // n)

    def kinds(self) -> tuple[str, ...]:
        """The baseline first, then every decay in the chunked form, then the references."""
        return (BASELINE,) + tuple(f"gated-{d}/{i}" for i in self.impls for d in self.decays)


def parse_kind(kind: str) -> tuple[str | None, str]:
    """(decay, impl) of a kind; decay None for the baseline."""
    if kind == BASELINE:
        return None, "chunked"
    head, _, impl = kind.partition("/")
    decay = head.removeprefix("gated-")
    if not head.startswith("gated-") or decay not in DECAYS or impl not in IMPLS:
        raise ValueError(f"unknown gated benchmark kind {kind!r}.")
    return decay, impl


def chunk_size_used(kind: str, chunk_size: int | None) -> int | None:
    """The chunk length a kind runs with (None for the dense reference)."""
    decay, impl = parse_kind(kind)
    if impl != "chunked":
        return None
    if chunk_size is not None:
        return chunk_size
    return ops.DEFAULT_CHUNK_SIZE


def attention_fn(kind: str, chunk_size: int | None):
    """(q, k, v[, log_decay]) -> out for one kind (chunk_size None: the op's default)."""
    decay, impl = parse_kind(kind)
    if decay is None:
        return lambda q, k, v: ops.causal_linear_attention(q, k, v, impl="chunked", chunk_size=chunk_size)
    chunk = chunk_size if impl == "chunked" else None
    if decay == "none":
        return lambda q, k, v: ops.gated_linear_attention(q, k, v, impl=impl, chunk_size=chunk)
    return lambda q, k, v, g: ops.gated_linear_attention(q, k, v, log_decay=g, impl=impl, chunk_size=chunk)


def decay_shape(decay: str | None, batch: int, n: int, heads: int, head_dim: int):
    return {
        None: None,
        "none": None,
        "head": (heads,),
        "step": (batch, n, heads),
        "feature": (batch, n, heads, head_dim),
    }[decay]


def input_specs(opts: GatedBenchOptions, kind: str, batch: int, n: int) -> list[jax.ShapeDtypeStruct]:
    """Shapes of (q, k, v[, log_decay], output cotangent) for one case."""
    dtype = jnp.dtype(opts.dtype)
    qk = jax.ShapeDtypeStruct((batch, n, opts.heads, opts.head_dim), dtype)
    vo = jax.ShapeDtypeStruct((batch, n, opts.heads, opts.value_dim), dtype)
    g = decay_shape(parse_kind(kind)[0], batch, n, opts.heads, opts.head_dim)
    return [qk, qk, vo] + ([] if g is None else [jax.ShapeDtypeStruct(g, jnp.float32)]) + [vo]


def random_inputs(opts: GatedBenchOptions, kind: str, batch: int, n: int):
    """Random inputs of `input_specs`, from opts.seed; the log decay is log_sigmoid of
    standard normal logits shifted by opts.decay_logit_bias (every value < 0)."""
    specs = input_specs(opts, kind, batch, n)
    keys = jax.random.split(jax.random.key(opts.seed), len(specs))
    out = [jax.random.normal(key, s.shape, s.dtype) for key, s in zip(keys, specs)]
    if len(specs) == 5:
        out[3] = jax.nn.log_sigmoid(out[3] + opts.decay_logit_bias)
    return tuple(out)


def pass_fn(attend, pass_: str):
    """forward: (*primals, g) -> out; forward+backward: -> the VJP of every primal (q, k, v and
    the log decay when there is one) for the output cotangent g."""
    if pass_ == "forward":
        return lambda *args: attend(*args[:-1])

    def forward_backward(*args):
        _, vjp = jax.vjp(attend, *args[:-1])
        return vjp(args[-1])

    return forward_backward


def run_case(
    opts: GatedBenchOptions, kind: str, pass_: str, n: int, budget: int, *, skip_reason: str | None = None
) -> dict:
    """Compile one case, read its peak memory, and time it unless it is over the budget or
    `skip_reason` says why not (then only the memory figure is kept)."""
    batch = opts.batch_for(n)
    decay, impl = parse_kind(kind)
    row = {
        "kind": kind,
        "decay": decay or "none (normalised, elu)",
        "impl": impl,
        "pass": pass_,
        "n": n,
        "batch": batch,
        "heads": opts.heads,
        "head_dim": opts.head_dim,
        "value_dim": opts.value_dim,
        "dtype": opts.dtype,
        "chunk_size": chunk_size_used(kind, opts.chunk_size),
        "time_ms": math.nan,
        "time_per_sample_ms": math.nan,
        "peak_mib": math.nan,
        "repeats": 0,
        "status": "ok",
    }
    fn = jax.jit(pass_fn(attention_fn(kind, opts.chunk_size), pass_))
    try:
        compiled = fn.lower(*input_specs(opts, kind, batch, n)).compile()
    except Exception as e:  # noqa: BLE001 - record why, go on with the other cases
        row["status"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return row
    peak = measure.peak_bytes(compiled)
    if peak is not None:
        row["peak_mib"] = peak / 2**20
        if peak > budget:
            row["status"] = f"skipped: needs {peak / 2**30:.1f} GiB, budget {budget / 2**30:.1f} GiB"
            return row
    if skip_reason:
        row["status"] = skip_reason
        return row
    timing = measure.time_compiled(
        compiled,
        *random_inputs(opts, kind, batch, n),
        min_repeats=opts.min_repeats,
        min_seconds=opts.min_seconds,
    )
    row.update(time_ms=timing.median_s * 1e3, time_per_sample_ms=timing.median_s * 1e3 / batch)
    row["repeats"] = timing.repeats
    return row


def run(opts: GatedBenchOptions, *, log=print) -> list[dict]:
    """Every (N, kind, pass) case, shortest N first, the baseline first at each N; returns one
    row per case, each with its time over the baseline's (same N and pass, this run)."""
    device = jax.devices()[0]
    budget = measure.memory_budget_bytes(device, opts.memory_fraction)
    too_slow: dict[tuple[str, str], str] = {}
    rows = []
    for n in sorted(opts.lengths):
        for kind in opts.kinds():
            for pass_ in opts.passes:
                row = run_case(opts, kind, pass_, n, budget, skip_reason=too_slow.get((kind, pass_)))
                if (kind, pass_) not in too_slow and row["time_ms"] / 1e3 > opts.max_call_seconds:
                    too_slow[(kind, pass_)] = (
                        f"skipped: {row['time_ms'] / 1e3:.1f} s per call at N={n} > max_call_seconds"
                    )
                rows.append(row)
                log(attention_bench.format_row(row))
    return add_ratios(rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row with `vs_causal_linear`: its time / the baseline's at the same N and pass (NaN
    where either did not run)."""
    key = f"slower_than_{BASELINE}"
    ratios = {(r["kind"], r["pass"], r["n"]): r[key] for r in attention_bench.speedups(rows, BASELINE)}
    out = []
    for r in rows:
        ratio = 1.0 if r["kind"] == BASELINE and r["status"] == "ok" else math.nan
        out.append({**r, "vs_causal_linear": ratios.get((r["kind"], r["pass"], r["n"]), ratio)})
    return out


def goal_checks(rows: list[dict]) -> list[dict]:
    """The stated goal per decay and N: chunked forward+backward <= GOAL_RATIO x the baseline."""
    out = []
    for r in rows:
        decay, impl = parse_kind(r["kind"])
        if decay in GOAL_DECAYS and impl == "chunked" and r["pass"] == GOAL_PASS:
            ratio = r["vs_causal_linear"]
            verdict = "not run" if math.isnan(ratio) else ("met" if ratio <= GOAL_RATIO else "missed")
            out.append({"n": r["n"], "decay": decay, "vs_causal_linear": ratio, "goal": verdict})
    return out


def ratio_table(rows: list[dict]) -> list[dict]:
    """One row per (N, pass): the baseline's ms and every other kind's time / baseline's."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    out = []
    for n in dict.fromkeys(r["n"] for r in rows):
        for pass_ in dict.fromkeys(r["pass"] for r in rows):
            mine = {r["kind"]: r for r in rows if r["n"] == n and r["pass"] == pass_}
            if not mine:
                continue
            line = {"n": n, "pass": pass_}
            base = mine.get(BASELINE)
            line[f"{BASELINE} ms"] = base["time_ms"] if base else math.nan
            for kind in kinds:
                if kind != BASELINE and kind in mine:
                    line[kind] = mine[kind]["vs_causal_linear"]
            out.append(line)
    return out


def run_and_report(opts: GatedBenchOptions, out_dir, *, log=print) -> dict:
    """Run every case, print the tables, write gated.csv/json/png under out_dir."""
    import pathlib

    from experiments.benchmarking import report

    out_dir = pathlib.Path(out_dir)
    machine = measure.machine_description()
    log(f"machine: {machine}")
    rows = run(opts, log=log)
    ratios = ratio_table(rows)
    goals = goal_checks(rows)
    files = {
        "csv": report.write_csv(out_dir / "gated.csv", rows),
        "json": report.write_json(
            out_dir / "gated.json",
            machine=machine,
            options=dataclasses.asdict(opts),
            rows=rows,
            ratios=ratios,
            goal={"ratio": GOAL_RATIO, "pass": GOAL_PASS, "baseline": BASELINE, "checks": goals},
        ),
    }
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    panels = [
        {
            "xlabel": "sequence length N",
            "ylabel": f"{pass_} time per sample (ms)",
            "series": {
                k: [(r["n"], r["time_per_sample_ms"]) for r in rows if r["kind"] == k and r["pass"] == pass_]
                for k in kinds
            },
        }
        for pass_ in opts.passes
    ]
    batch = f"B={opts.batch}" if opts.batch else f"B=max(1, {opts.tokens}/N)"
    files["png"] = report.plot_series(
        out_dir / "gated.png",
        panels,
        title=(
            f"decayed vs plain causal linear attention: {machine['device']}, {opts.dtype}, "
            f"H={opts.heads}, D={opts.head_dim}, M={opts.value_dim}, {batch}; jax {machine['jax']}"
        ),
    )
    log(
        "\n"
        + report.markdown_table(
            rows,
            ["n", "batch", "kind", "pass", "chunk_size", "time_ms", "vs_causal_linear", "peak_mib", "status"],
        )
    )
    log(
        f"\ntime / time({BASELINE}), same run ({BASELINE} in ms):\n"
        + report.markdown_table(ratios, list(dict.fromkeys(k for r in ratios for k in r)))
    )
    if goals:
        log(
            f"\ngoal: a decay costs at most {GOAL_RATIO}x plain causal linear {GOAL_PASS} "
            f"(chunked, same run):\n" + report.markdown_table(goals, list(goals[0]))
        )
    log("wrote " + ", ".join(str(p) for p in files.values()))
    return {"rows": rows, "ratios": ratios, "goals": goals, "files": files}
