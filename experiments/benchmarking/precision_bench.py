"""How far bfloat16 moves each kind's logits from float32, and how much of that is the model's
own sensitivity rather than bf16 arithmetic.

Legend: B batch, T time, V vocabulary.

For each kind, length T and seed, an untrained `CausalLM` is built twice from the same float32
parameters, once computing in float32 and once in bfloat16, and their logits [B, T, V] on the
same random tokens are compared (largest difference over the std of the float32 logits):

  bf16_error:       the bf16 parallel form against float32;
  recurrent_error:  the bf16 recurrent form (`step` over every token) against float32;
  sensitivity:      a float32 run whose parameters are rounded to bf16 and back, against
                    float32: what a relative change of 2^-9 in the weights alone does, with no
                    bf16 arithmetic (the floor any bf16 computation of the model starts from);
  over_sensitivity: max(bf16_error, recurrent_error) / sensitivity, what bf16 arithmetic adds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.benchmarking import measure, report
from linear_transformers.attention.base import kinds_with
from linear_transformers.lm import CausalLM
from linear_transformers.transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class PrecisionBenchOptions:
    """What `run` measures.

    kinds: Attention kinds with a recurrent form (softmax, linear, causal-linear, retention,
        simple-gla, gla).
    lengths: Sequence lengths T.
    seeds: Seeds of the weights and tokens.
    batch: Batch size B.
    num_layers: Layers of the language model.
    model_dim: Width of the language model.
    num_heads: Heads of the language model.
    vocab_size: Vocabulary of the language model.
    """

    kinds: tuple[str, ...] = ("softmax", "causal-linear", "retention", "simple-gla", "gla")
    lengths: tuple[int, ...] = (32, 256, 1024)
    seeds: tuple[int, ...] = (0, 1, 2)
    batch: int = 2
    num_layers: int = 2
    model_dim: int = 32
    num_heads: int = 4
    vocab_size: int = 13

    def __post_init__(self):
        measure.check_known("attention kind", self.kinds, kinds_with("has_recurrent_form"))
        for name in ("lengths", "seeds"):
            if not getattr(self, name):
                raise ValueError(f"{name}: give at least one value.")
        if min(self.lengths) < 1 or self.batch < 1:
            raise ValueError(f"lengths and batch must be >= 1, got {self.lengths} and {self.batch}.")


def _logits(model, tokens_BT):
    graph, state = nnx.split(model)
    return jax.jit(lambda state, tokens: nnx.merge(graph, state)(tokens))(state, tokens_BT)


def _recurrent_logits(model, tokens_BT):
    graph, state = nnx.split(model)

    def run(state, tokens_BT):
        model = nnx.merge(graph, state)
        init = model.init_state(tokens_BT.shape[0], max_length=tokens_BT.shape[1])
        _, logits_TBV = jax.lax.scan(model.step, init, tokens_BT.T)
        return jnp.swapaxes(logits_TBV, 0, 1)

    return jax.jit(run)(state, tokens_BT)


def _bf16_rounded(model):
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graph, jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(p.dtype), params), rest)


def measure_case(opts: PrecisionBenchOptions, kind: str, T: int, seed: int) -> dict:
    def model(dtype):
        config = TransformerConfig(
            num_layers=opts.num_layers,
            num_heads=opts.num_heads,
            model_dim=opts.model_dim,
            dropout=0.0,
            attention=kind,
            dtype=dtype,
        )
        return CausalLM(config, opts.vocab_size, rngs=nnx.Rngs(seed))

    f32, bf16 = model("float32"), model("bfloat16")
    tokens_BT = jax.random.randint(jax.random.key(seed + 1), (opts.batch, T), 0, opts.vocab_size)
    want = _logits(f32, tokens_BT).astype(jnp.float32)
    std = float(jnp.std(want))

    def error(got):
        return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) / std

    row = {
        "kind": kind,
        "length": T,
        "seed": seed,
        "bf16_error": error(_logits(bf16, tokens_BT)),
        "recurrent_error": error(_recurrent_logits(bf16, tokens_BT)),
        "sensitivity": error(_logits(_bf16_rounded(f32), tokens_BT)),
    }
    row["over_sensitivity"] = max(row["bf16_error"], row["recurrent_error"]) / row["sensitivity"]
    return row


def run(opts: PrecisionBenchOptions, *, log=print) -> list[dict]:
    rows = []
    for T in opts.lengths:
        for kind in opts.kinds:
            for seed in opts.seeds:
                rows.append(measure_case(opts, kind, T, seed))
                log(
                    f"{kind} T={T} seed={seed}: "
                    + ", ".join(f"{k}={v:.3g}" for k, v in list(rows[-1].items())[3:])
                )
    return rows


COLUMNS = ["kind", "length", "bf16_error", "recurrent_error", "sensitivity", "over_sensitivity"]


def worst_per_case(rows: list[dict]) -> list[dict]:
    """One row per (kind, length): each column's largest value over the seeds."""
    worst = {}
    for r in rows:
        w = worst.setdefault((r["kind"], r["length"]), {"kind": r["kind"], "length": r["length"]})
        for c in COLUMNS[2:]:
            w[c] = max(w.get(c, 0.0), r[c])
    return list(worst.values())


def summarize(opts: PrecisionBenchOptions, rows: list[dict], machine: dict) -> report.Report:
    worst = worst_per_case(rows)
    lines = report.series(worst, "length", "bf16_error", lambda r: r["kind"])
    return report.Report(
        rows=rows,
        columns=["kind", "length", "seed", *COLUMNS[2:]],
        tables=[report.Table(worst, "largest over the seeds", COLUMNS, csv="worst")],
        panels=report.panels("T", {"max logit error, bf16 vs float32 (over logit std)": lines}),
        title=f"bf16 vs float32, {opts.num_layers} layers, E={opts.model_dim}: {machine.get('device', '')}",
    )


def run_and_report(opts: PrecisionBenchOptions, out_dir, *, log=print) -> dict:
    """Measure every case, print the tables, write precision.csv/json/png and precision_worst.csv."""
    return report.run_and_report("precision", opts, out_dir, run, summarize, log=log)
