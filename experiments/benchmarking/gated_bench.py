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

and impl "chunked" (the op's default), "reference" (the dense [N, N] form; [N, N, D]
with per-feature decays), which runs only where XLA's peak memory for it fits the budget, or
"pallas" (the Pallas kernel: Triton on a GPU, Pallas's interpreter on a CPU, slow there); and
"delta-{decay}/{impl}", the delta rule (`ops.delta_rule_attention`: DeltaNet, Gated DeltaNet,
KDA for decays none, step, feature) in its chunked form and its scan (one step at a time), with
beta = sigmoid of standard normal logits; its goals: chunked >= DELTA_GOAL_OVER_SCAN x faster
than the scan, and <= DELTA_GOAL_OVER_GATED x the gated chunked form with a per-step decay
(`GATED_PER_STEP`). Both ratios are timed again in rounds, the delta rule's cases and the
gated per-step form once per round in turn (`measure.interleaved_times`, --goal_rounds): the
sweep times one case after another, and on a shared machine whose speed drifts their ratio
drifts with it. The time over the gated form of the same decay is given too.
Forward+backward is the VJP with respect to q, k, v and the log decay. Log decays are
`log_sigmoid(logits + decay_logit_bias)` of standard normal logits, in float32 (the op
accumulates decays in float32 whatever the input dtype): with the default bias of 3 a step
keeps ~95% of the state (between 0.75 and 0.99 for 95% of the draws), as trained gates do.
Timing, memory and the skipping rules are `attention_bench`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from experiments.benchmarking import attention_bench, measure, report
from linear_transformers import _deprecation, ops
from linear_transformers.ops.delta_rule import chunked as delta_chunked
from linear_transformers.ops.gated_linear import pallas

BASELINE = "causal-linear/chunked"
DECAYS = ("none", "head", "step", "feature")
IMPLS = ("chunked", "reference", "pallas")
PASSES = attention_bench.PASSES
DTYPES = ("float32", "bfloat16")
# The goal the table states: a decay costs at most this much over plain causal linear
# (chunked, forward+backward, same run).
GOAL_RATIO = 1.3
GOAL_PASS = "forward+backward"
GOAL_DECAYS = ("head", "step", "feature")
DELTA_IMPLS = ("chunked", "scan")
DELTA_GOAL_OVER_SCAN = 5.0
DELTA_GOAL_OVER_GATED = 2.5
GATED_PER_STEP = "gated-step/chunked"  # what the delta rule's goal is taken against
COLUMNS = ("n", "batch", "kind", "pass", "chunk_size", "time_ms", "vs_causal_linear", "over_gated_step")
COLUMNS += ("scan_over_chunked", "peak_mib", "status")


@dataclasses.dataclass(frozen=True)
class GatedBenchOptions(attention_bench.SweepOptions):
    """What `run` measures (F = D: the gated cases use the identity feature map).

    tokens: Batch = max(1, tokens // N), unless --batch is set.
    batch: Batch B at every N (default: from --tokens).
    dtype: Input dtype (decays: float32).
    decays: Log decay shapes: none, head, step, feature.
    impls: Forms of the gated op: chunked, reference (dense; "quadratic" is its old name),
        pallas (the GPU kernel; interpreted on a CPU, slow there: only when named).
    chunk_size: Chunk length of the chunked forms (default: the op's, 64).
    decay_logit_bias: Log decays = log_sigmoid(normal logits + this); 3: ~0.95 kept per step.
    delta_decays: Log decay shapes of the delta-rule cases (none: no delta-rule case).
    delta_impls: Forms of the delta rule: chunked, scan.
    goal_rounds: Rounds timing the delta rule's cases in turn with the gated per-step form,
        forward+backward, for its goals (0: the sweep's medians instead).
    """

    lengths: tuple[int, ...] = (4096, 16384)
    batch: int | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    decays: tuple[str, ...] = DECAYS
    impls: tuple[str, ...] = ("chunked", "reference")  # pallas on request: interpreted on a CPU
    chunk_size: int | None = None
    decay_logit_bias: float = 3.0
    delta_decays: tuple[str, ...] = ("none", "step", "feature")
    delta_impls: tuple[str, ...] = DELTA_IMPLS
    goal_rounds: int = 5

    def __post_init__(self):
        super().__post_init__()
        if "quadratic" in self.impls:  # the op's old name of its dense form, for one release
            _deprecation.warn("--impls=quadratic", "--impls=reference", where="benchmark_gated")
            impls = tuple("reference" if i == "quadratic" else i for i in self.impls)
            object.__setattr__(self, "impls", impls)
        measure.check_known("decay", self.decays, DECAYS)
        measure.check_known("impl", self.impls, IMPLS)
        measure.check_known("delta decay", self.delta_decays, DECAYS)
        measure.check_known("delta impl", self.delta_impls, DELTA_IMPLS)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {DTYPES}.")
        if self.batch is not None and self.batch < 1:
            raise ValueError(f"batch must be None or >= 1, got {self.batch}.")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be None or >= 1, got {self.chunk_size}.")
        if self.goal_rounds < 0:
            raise ValueError(f"goal_rounds must be >= 0, got {self.goal_rounds}.")

    def batch_for(self, n: int) -> int:
        return self.batch or max(1, self.tokens // n)

    def kinds(self) -> tuple[str, ...]:
        """The baseline first, then every decay in the chunked form, then the references, then
        the delta rule's cases."""
        gated = tuple(f"gated-{d}/{i}" for i in self.impls for d in self.decays)
        return (
            (BASELINE,) + gated + tuple(f"delta-{d}/{i}" for i in self.delta_impls for d in self.delta_decays)
        )


def parse_kind(kind: str) -> tuple[str | None, str]:
    """(decay, impl) of a kind; decay None for the baseline."""
    if kind == BASELINE:
        return None, "chunked"
    head, _, impl = kind.partition("/")
    family, _, decay = head.partition("-")
    impls = {"gated": IMPLS, "delta": DELTA_IMPLS}.get(family, ())
    if decay not in DECAYS or impl not in impls:
        raise ValueError(f"unknown gated benchmark kind {kind!r}.")
    return decay, impl


def is_delta(kind: str) -> bool:
    return kind.startswith("delta-")


def chunk_size_used(kind: str, chunk_size: int | None) -> int | None:
    """The chunk length a kind runs with (None for the dense reference and the scan)."""
    _, impl = parse_kind(kind)
    if impl == "pallas":
        return chunk_size or pallas.DEFAULT_CHUNK_SIZE
    if impl != "chunked":
        return None
    if is_delta(kind):
        return chunk_size or delta_chunked.default_chunk_size()
    return chunk_size or ops.DEFAULT_CHUNK_SIZE


def attention_fn(kind: str, chunk_size: int | None):
    """(q, k, v[, beta][, log_decay]) -> out for one kind (chunk_size None: the op's default)."""
    decay, impl = parse_kind(kind)
    chunk = chunk_size if impl in ("chunked", "pallas") else None
    if is_delta(kind):
        if decay == "none":
            return lambda q, k, v, beta: ops.delta_rule_attention(
                q, k, v, beta, implementation=impl, chunk_size=chunk
            )
        return lambda q, k, v, beta, g: ops.delta_rule_attention(
            q, k, v, beta, log_decay=g, implementation=impl, chunk_size=chunk
        )
    if decay is None:
        return lambda q, k, v: ops.causal_linear_attention(
            q, k, v, implementation="chunked", chunk_size=chunk_size
        )
    if decay == "none":
        return lambda q, k, v: ops.gated_linear_attention(q, k, v, implementation=impl, chunk_size=chunk)
    return lambda q, k, v, g: ops.gated_linear_attention(
        q, k, v, log_decay=g, implementation=impl, chunk_size=chunk
    )


def input_specs(opts: GatedBenchOptions, kind: str, batch: int, n: int) -> list[jax.ShapeDtypeStruct]:
    """Shapes of (q, k, v[, beta][, log_decay], output cotangent) for one case."""
    shape = {
        "head": (opts.heads,),
        "step": (batch, n, opts.heads),
        "feature": (batch, n, opts.heads, opts.head_dim),
    }.get(parse_kind(kind)[0])
    beta = [jax.ShapeDtypeStruct((batch, n, opts.heads), jnp.float32)] if is_delta(kind) else []
    decay = [jax.ShapeDtypeStruct(shape, jnp.float32)] if shape else []
    return attention_bench.input_specs(opts, batch, n, *beta, *decay)


def random_inputs(opts: GatedBenchOptions, kind: str, batch: int, n: int):
    """Random inputs of `input_specs`, from opts.seed; the log decay is log_sigmoid of
    standard normal logits shifted by opts.decay_logit_bias (every value < 0), beta the
    sigmoid of standard normal logits."""
    out = list(attention_bench.normal_inputs(input_specs(opts, kind, batch, n), opts.seed))
    first = 3
    if is_delta(kind):
        out[3] = jax.nn.sigmoid(out[3])
        first = 4
    if len(out) == first + 2:
        out[first] = jax.nn.log_sigmoid(out[first] + opts.decay_logit_bias)
    return tuple(out)


def run_case(
    opts: GatedBenchOptions, kind: str, pass_: str, n: int, budget: int, *, skip_reason: str | None = None
) -> dict:
    """One (kind, pass, N) case (`attention_bench.time_case`)."""
    batch = opts.batch_for(n)
    decay, impl = parse_kind(kind)
    labels = {
        "decay": decay or "none (normalised, elu)",
        "impl": impl,
        "op": "delta" if is_delta(kind) else "gated",
    }
    chunk = chunk_size_used(kind, opts.chunk_size)
    row = attention_bench.case_row(opts, kind, pass_, n, batch, chunk, labels, per_sample_peak=False)
    fn = attention_bench.pass_fn(attention_fn(kind, opts.chunk_size), pass_)
    specs = input_specs(opts, kind, batch, n)
    inputs = functools.partial(random_inputs, opts, kind, batch, n)
    return attention_bench.time_case(opts, row, fn, specs, inputs, budget, skip_reason)


def run(opts: GatedBenchOptions, *, log=print) -> list[dict]:
    """Every (N, kind, pass) case, shortest N first, the baseline first at each N; returns one
    row per case, each with its time over the baseline's (same N and pass, this run), and the
    delta rule's chunked forward+backward over the gated per-step form (`add_interleaved`)."""
    rows = add_ratios(attention_bench.sweep(opts, opts.kinds(), run_case, log=log))
    return add_interleaved(opts, rows, log=log)


def _goal_call(opts: GatedBenchOptions, kind: str, n: int):
    fn = attention_bench.pass_fn(attention_fn(kind, opts.chunk_size), GOAL_PASS)
    args = random_inputs(opts, kind, opts.batch_for(n), n)
    compiled = jax.jit(fn).lower(*args).compile()
    return lambda: jax.block_until_ready(compiled(*args))


def add_interleaved(opts: GatedBenchOptions, rows: list[dict], *, log=print) -> list[dict]:
    """Each row with `over_gated_step` and `scan_over_chunked`: for the delta rule's chunked
    forward+backward, its time over GATED_PER_STEP's and its scan's over its own at the same N,
    medians over opts.goal_rounds rounds timing them in turn (`measure.interleaved_times`),
    where they ran in the sweep; NaN elsewhere."""
    rows = [{**r, "over_gated_step": math.nan, "scan_over_chunked": math.nan} for r in rows]
    ran = {(r["kind"], r["n"]) for r in rows if r["pass"] == GOAL_PASS and r["status"] == "ok"}
    for n in dict.fromkeys(r["n"] for r in rows):
        chunked = [k for k, m in ran if m == n and is_delta(k) and parse_kind(k)[1] == "chunked"]
        scans = [k for k, m in ran if m == n and is_delta(k) and parse_kind(k)[1] == "scan"]
        timed = chunked + scans + ([GATED_PER_STEP] if (GATED_PER_STEP, n) in ran else [])
        if not opts.goal_rounds or not chunked or len(timed) == len(chunked):
            continue
        times = measure.interleaved_times({k: _goal_call(opts, k, n) for k in timed}, rounds=opts.goal_rounds)
        for r in rows:
            if r["n"] == n and r["pass"] == GOAL_PASS and r["kind"] in chunked:
                scan = f"delta-{parse_kind(r['kind'])[0]}/scan"
                if GATED_PER_STEP in times:
                    r["over_gated_step"] = measure.median_ratio(times, r["kind"], GATED_PER_STEP)
                if scan in times:
                    r["scan_over_chunked"] = measure.median_ratio(times, scan, r["kind"])
                log(f"N={n} {r['kind']}: {r['over_gated_step']:.2f}x {GATED_PER_STEP}, its scan "
                    f"{r['scan_over_chunked']:.2f}x ({opts.goal_rounds} interleaved rounds)")  # fmt: skip
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row with `vs_causal_linear`: its time / the baseline's at the same N and pass (NaN
    where either did not run)."""
    ratios = {
        id(r): r["time_ms"] / b["time_ms"]
        for r, b in report.paired(rows, ("pass", "n"), "kind", BASELINE, "time_ms")
    }
    ran = {id(r): 1.0 for r in rows if r["kind"] == BASELINE and r["status"] == "ok"}
    return [{**r, "vs_causal_linear": ratios.get(id(r), ran.get(id(r), math.nan))} for r in rows]


def goal_checks(rows: list[dict]) -> list[dict]:
    """The stated goal per decay and N: chunked forward+backward <= GOAL_RATIO x the baseline."""
    out = []
    for r in rows:
        decay, impl = parse_kind(r["kind"])
        if not is_delta(r["kind"]) and decay in GOAL_DECAYS and impl == "chunked" and r["pass"] == GOAL_PASS:
            ratio = r["vs_causal_linear"]
            verdict = "not run" if math.isnan(ratio) else ("met" if ratio <= GOAL_RATIO else "missed")
            out.append({"n": r["n"], "decay": decay, "vs_causal_linear": ratio, "goal": verdict})
    return out


def ratio_table(rows: list[dict]) -> list[dict]:
    """One row per (N, pass): the baseline's ms and every other kind's time / baseline's."""
    out = []
    for n in dict.fromkeys(r["n"] for r in rows):
        for pass_ in dict.fromkeys(r["pass"] for r in rows):
            mine = {r["kind"]: r for r in rows if r["n"] == n and r["pass"] == pass_}
            if mine:
                base = mine.get(BASELINE, {"time_ms": math.nan})
                line = {"n": n, "pass": pass_, f"{BASELINE} ms": base["time_ms"]}
                out.append(line | {k: r["vs_causal_linear"] for k, r in mine.items() if k != BASELINE})
    return out


def delta_checks(rows: list[dict]) -> list[dict]:
    """The delta rule's goals per decay and N (forward+backward, same run): its chunked form
    over its scan, and over the gated chunked form with a per-step decay (interleaved where
    `add_interleaved` measured it, else the sweep's medians); over the gated form of the same
    decay for reference."""
    times = {(r["kind"], r["n"]): r["time_ms"] for r in rows if r["pass"] == GOAL_PASS}
    out = []
    for r in rows:
        decay, impl = parse_kind(r["kind"])
        if is_delta(r["kind"]) and impl == "chunked" and r["pass"] == GOAL_PASS:
            same = r["time_ms"] / times.get((f"gated-{decay}/chunked", r["n"]), math.nan)
            scan = r.get("scan_over_chunked", math.nan)
            if math.isnan(scan):
                scan = times.get((f"delta-{decay}/scan", r["n"]), math.nan) / r["time_ms"]
            per_step = r.get("over_gated_step", math.nan)
            if math.isnan(per_step):
                per_step = r["time_ms"] / times.get((GATED_PER_STEP, r["n"]), math.nan)
            verdicts = [
                "not run" if math.isnan(x) else ("met" if ok else "missed")
                for x, ok in (
                    (scan, scan >= DELTA_GOAL_OVER_SCAN),
                    (per_step, per_step <= DELTA_GOAL_OVER_GATED),
                )
            ]
            out.append(
                {"n": r["n"], "decay": decay, "delta chunked ms": r["time_ms"], "scan / chunked": scan,
                 "scan goal": verdicts[0], "chunked / gated, same decay": same,
                 "chunked / gated per step": per_step, "gated goal": verdicts[1]}
            )  # fmt: skip
    return out


def summarize(opts: GatedBenchOptions, rows: list[dict], machine: dict) -> report.Report:
    goals = goal_checks(rows)
    ratios = ratio_table(rows)
    deltas = delta_checks(rows)
    batch = f"B={opts.batch}" if opts.batch else f"B=max(1, {opts.tokens}/N)"
    goal = f"goal: a decay costs at most {GOAL_RATIO}x plain causal linear {GOAL_PASS} (chunked, same run)"
    return report.Report(
        rows,
        COLUMNS,
        tables=[
            report.Table(ratios, f"time / time({BASELINE}), same run ({BASELINE} in ms)"),
            report.Table(goals, goal),
            report.Table(
                deltas,
                f"delta rule, {GOAL_PASS}: chunked >= {DELTA_GOAL_OVER_SCAN}x faster than its scan, "
                f"<= {DELTA_GOAL_OVER_GATED}x the gated chunked form with a per-step decay (same run; "
                f"medians of {opts.goal_rounds} interleaved rounds where given)",
            ),
        ],
        extra={
            "ratios": ratios,
            "delta": deltas,
            "goal": {"ratio": GOAL_RATIO, "pass": GOAL_PASS, "baseline": BASELINE, "checks": goals},
        },
        panels=attention_bench.per_sample_panels(rows, opts.passes, memory=False),
        title=(
            f"decayed vs plain causal linear attention: {machine['device']}, {opts.dtype}, "
            f"H={opts.heads}, D={opts.head_dim}, M={opts.value_dim}, {batch}; jax {machine['jax']}"
        ),
    )


def run_and_report(opts: GatedBenchOptions, out_dir, *, log=print) -> dict:
    """Run every case, print the tables, write gated.csv/json/png under out_dir."""
    return report.run_and_report("gated", opts, out_dir, run, summarize, log=log)
