"""MQAR recall against the number of stored pairs, for several attention kinds: one run of the
trainer per (kind, n) on this machine, then the recall table and its plot.

Every run is `train_and_evaluate` on the MQAR task's schema (`experiments.tasks.mqar`, as
configs/mqar.py) with `attention=<kind>,num_kv_pairs=<n>` and then `overrides`; a run already
finished in its workdir (<out_dir>/<kind>_n<n>) is read back, not retrained. Recall accuracy is
the held-out share of queries answered with their key's value (chance: 1 / (vocab_size / 2)).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

from experiments import tasks
from experiments.benchmarking import report
from experiments.tasks import mqar
from experiments.training import variants
from experiments.training.metrics import read_metrics
from linear_transformers.attention import registered_attention_kinds

KINDS = ("softmax", "linear", "retention", "gla", "deltanet", "gated-deltanet")
COLUMNS = ["kind", "num_kv_pairs", "recall_accuracy", "eval_loss", "steps", "wall_time_s", "steps_per_sec"]


@dataclasses.dataclass(frozen=True)
class MqarComparisonOptions:
    """Options of the MQAR comparison.

    kinds: Attention kinds (config.model.attention), one run per kind and n.
    num_kv_pairs: Numbers of key-value pairs n each kind is trained and scored on.
    overrides: key=value,... of configs/mqar.py applied to every run last (seq_len=64, ...).
    """

    kinds: tuple[str, ...] = KINDS
    num_kv_pairs: tuple[int, ...] = (8, 16, 32)
    overrides: str = ""

    def __post_init__(self):
        unknown = sorted(set(self.kinds) - set(registered_attention_kinds()))
        if unknown:
            raise ValueError(f"unknown attention kinds {unknown}; known: {registered_attention_kinds()}.")
        if not self.kinds or not self.num_kv_pairs:
            raise ValueError(f"need at least one kind and one n, got {self.kinds} and {self.num_kv_pairs}.")
        for config in (run_config(k, n, self) for k in self.kinds for n in self.num_kv_pairs):
            mqar.Mqar(config).check()  # A bad n or override fails before the first run.


def run_config(kind: str, num_kv_pairs: int, options: MqarComparisonOptions):
    parts = [f"attention={kind},num_kv_pairs={num_kv_pairs}", options.overrides]
    return variants.apply(mqar.schema(), ",".join(p for p in parts if p), {})


def _run(options: MqarComparisonOptions, *, out_dir, log=print) -> list[dict]:
    rows = []
    for kind in options.kinds:
        for n in options.num_kv_pairs:
            workdir = pathlib.Path(out_dir) / f"{kind}_n{n}"
            log(f"== {kind}, n = {n}: {workdir}")
            tasks.train_and_evaluate(run_config(kind, n, options), workdir)
            records = read_metrics(workdir)
            train = [r for r in records if "loss" in r]
            scored = [r for r in records if "recall_accuracy" in r]
            if not train or not scored:
                raise ValueError(f"MQAR run {workdir} has no finished metrics.")
            last = train[-1]
            rows.append(
                {
                    "kind": kind,
                    "num_kv_pairs": n,
                    "recall_accuracy": scored[-1]["recall_accuracy"],
                    "eval_loss": scored[-1]["eval_loss"],
                    "steps": last["step"],
                    "wall_time_s": last["wall_time"],
                    "steps_per_sec": last["step"] / last["wall_time"],
                }
            )
    return rows


def _kind(row: dict) -> str:
    return row["kind"]


def _summarize(options: MqarComparisonOptions, rows: list[dict], machine: dict) -> report.Report:
    by_kind = [
        {"kind": kind, **{f"n={r['num_kv_pairs']}": r["recall_accuracy"] for r in rows if r["kind"] == kind}}
        for kind in options.kinds
    ]
    config = run_config(options.kinds[0], options.num_kv_pairs[0], options)
    return report.Report(
        rows=rows,
        columns=COLUMNS,
        tables=[report.Table(by_kind, heading="held-out recall accuracy by kind and n", csv="recall")],
        panels=report.panels(
            "key-value pairs n",
            {"held-out recall accuracy": report.series(rows, "num_kv_pairs", "recall_accuracy", _kind)},
        ),
        title=f"MQAR, T = {config.seq_len}, width {config.model.model_dim}, {config.num_steps} steps",
    )


def run_and_report(options: MqarComparisonOptions, out_dir, log=print) -> dict:
    return report.run_and_report(
        "mqar", options, out_dir, functools.partial(_run, out_dir=out_dir), _summarize, log=log
    )
