"""The copy task for several attention kinds, one after the other on this machine: a results
table and convergence curves (loss vs step and vs training wall time).

Every run is `train_and_evaluate` on the copy task's schema (`experiments.tasks.copy`, the
paper's setting, as configs/copy.py) with `size` variants (default "cpu") and the run's own,
all from the task's `VARIANTS` or `key=value`; runs already finished in their workdir are read
back, not retrained.
"""

from __future__ import annotations

import dataclasses
import pathlib

from experiments import tasks
from experiments.benchmarking import measure, report
from experiments.tasks import copy as copy_task
from experiments.training import variants
from experiments.training.metrics import read_metrics

# name -> the copy task's variants (copy_task.VARIANTS or key=value) applied after the size ones.
RUNS = {
    "decoder/softmax": "attention=softmax",
    "decoder/linear": "attention=linear",
    "decoder/performer": "performer",
    "decoder/lsh-1": "lsh1",
    "decoder/lsh-4": "lsh4",
    "enc-dec/softmax": "attention=softmax",
    "enc-dec/linear": "attention=linear",
    "enc-dec/linformer+linear": "attention=linear,linformer",
    "enc-dec/lsh-4": "lsh4",
}

TABLE_COLUMNS = [
    "run",
    "steps",
    "wall_time_s",
    "steps_per_sec",
    "final_train_loss",
    "eval_loss",
    "token_accuracy",
    "sequence_accuracy",
    "greedy_sequence_accuracy",
    "steps_to_loss_0.1",
]


@dataclasses.dataclass
class CopyComparisonOptions:
    runs: tuple[str, ...] = tuple(RUNS)
    size: str = "cpu"  # the copy task's variants setting the scale (copy_task.VARIANTS)
    overrides: str = ""  # further "key=value,..." applied last
    out_dir: str = "benchmark_results/copy"

    def __post_init__(self):
        unknown = sorted(set(self.runs) - set(RUNS))
        if unknown:
            raise ValueError(f"unknown copy runs {unknown}; known: {list(RUNS)}.")


def run_config(name: str, options: CopyComparisonOptions):
    """The config of run `name`: model variant, then size, then the run's, then overrides."""
    parts = (["encoder_decoder"] if name.startswith("enc-dec/") else []) + [
        options.size,
        RUNS[name],
        options.overrides,
    ]
    return variants.apply(copy_task.schema(), ",".join(p for p in parts if p), copy_task.VARIANTS)


def summarize(name: str, records: list[dict]) -> dict:
    """One table row from a run's metrics records."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    if not train or not evals:
        raise ValueError(f"copy run {name!r} has no finished metrics.")
    last, last_eval = train[-1], evals[-1]
    below = [r["step"] for r in train if r["loss"] < 0.1]
    return {
        "run": name,
        "steps": last["step"],
        "wall_time_s": last["wall_time"],
        "steps_per_sec": last["step"] / last["wall_time"],
        "final_train_loss": last["loss"],
        "eval_loss": last_eval["eval_loss"],
        "token_accuracy": last_eval["token_accuracy"],
        "sequence_accuracy": last_eval["sequence_accuracy"],
        "greedy_sequence_accuracy": last_eval.get("greedy_sequence_accuracy", float("nan")),
        "steps_to_loss_0.1": below[0] if below else float("nan"),
    }


def run_and_report(options: CopyComparisonOptions, log=print) -> list[dict]:
    out = pathlib.Path(options.out_dir)
    rows, curves = [], {}
    for name in options.runs:
        config = run_config(name, options)
        workdir = out / name.replace("/", "_")
        log(f"== {name}: {workdir}")
        tasks.train_and_evaluate(config, workdir)
        records = read_metrics(workdir)
        rows.append(summarize(name, records))
        curves[name] = [(r["step"], r["wall_time"], r["loss"]) for r in records if "loss" in r]
    report.write_csv(out / "copy_results.csv", rows)
    report.write_csv(
        out / "copy_curves.csv",
        [
            {"run": n, "step": s, "wall_time_s": w, "loss": loss}
            for n, pts in curves.items()
            for s, w, loss in pts
        ],
    )
    report.write_json(
        out / "copy_results.json",
        machine=measure.machine_description(),
        options=dataclasses.asdict(options),
        rows=rows,
    )
    report.plot_series(
        out / "copy_convergence.png",
        [
            {
                "xlabel": "step",
                "ylabel": "train loss (copied symbols, nats)",
                "series": {n: [(s, loss) for s, _, loss in pts] for n, pts in curves.items()},
            },
            {
                "xlabel": "training wall time (s)",
                "ylabel": "train loss (copied symbols, nats)",
                "series": {n: [(w, loss) for _, w, loss in pts] for n, pts in curves.items()},
            },
        ],
        title=f"copy task, size variant {options.size!r}",
        log_x=False,
        marker=None,
    )
    log(report.markdown_table(rows, TABLE_COLUMNS))
    return rows
