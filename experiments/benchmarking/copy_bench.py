"""The copy task for several attention kinds, one after the other on this machine: a results
table and convergence curves (loss vs step and vs training wall time).

Every run is `train_and_evaluate` on the copy task's schema (`experiments.tasks.copy`, the
paper's setting, as configs/copy.py) with `size` variants (default "cpu") and the run's own,
all from the task's `VARIANTS` or `key=value`; runs already finished in their workdir are read
back, not retrained.

Throughput counts real tokens, not padding: `tokens_per_sec` is the example tokens (a
decoder-only example's 2n + 1 inputs, an encoder-decoder's n source and n target tokens) of the
steps after the first logging window (which holds compilation) over their training wall time
(host batch building included: packing is part of the cost); `token_fill` is the share of the
batches' positions that hold them. The varlen runs train on the same examples per step, packed
several to a row or one per row (`variable_length` in experiments/tasks/copy.py).
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

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
    "decoder/retention": "attention=retention",
    "decoder/simple-gla": "attention=simple-gla",
    "decoder/gla": "attention=gla",
    "decoder/varlen-packed": "variable_length",
    "decoder/varlen-padded": "variable_length,packed=false",
    "enc-dec/softmax": "attention=softmax",
    "enc-dec/linear": "attention=linear",
    "enc-dec/linformer+linear": "attention=linear,linformer",
    "enc-dec/lsh-4": "lsh4",
}
# What runs without --runs: the paper's comparison (section 4.1, Figure 2); the linear-attention
# family's kinds and the packed/padded pair are named with --runs (BENCHMARKS.md, section 8).
PAPER_RUNS = (
    "decoder/softmax",
    "decoder/linear",
    "decoder/performer",
    "decoder/lsh-1",
    "decoder/lsh-4",
    "enc-dec/softmax",
    "enc-dec/linear",
    "enc-dec/linformer+linear",
    "enc-dec/lsh-4",
)

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
    "tokens_per_sec",
    "token_fill",
]


@dataclasses.dataclass
class CopyComparisonOptions:
    runs: tuple[str, ...] = PAPER_RUNS
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


def real_tokens(config, num_steps: int) -> tuple[np.ndarray, int]:
    """(example tokens of each training step [num_steps], positions of a batch): what the
    batches of `config` hold, from the task's data (a pure function of seed and step)."""
    task = copy_task.Copy(config)
    batches = task.copy_batches(config.seed)
    tokens = np.zeros(num_steps, np.int64)
    for step in range(num_steps):
        n = batches.examples(step).lengths_B
        tokens[step] = np.sum(2 * n + 1) if config.architecture == "decoder" else 2 * np.sum(n)
    if config.architecture != "decoder":
        return tokens, 2 * config.batch_size * task.source_width()
    rows = config.batch_size if config.packed else config.examples_per_step or config.batch_size
    return tokens, rows * (config.max_length - 1)


def throughput(records: list[dict], tokens_per_step: np.ndarray, positions: int) -> dict:
    """Real tokens per second after the first logging window, and the share of positions they fill."""
    train = [r for r in records if "loss" in r]
    first, last = train[0], train[-1]
    seconds = last["wall_time"] - first["wall_time"]
    tokens = tokens_per_step[first["step"] : last["step"]].sum()
    return {
        "tokens_per_sec": tokens / seconds if seconds > 0 else float("nan"),
        "token_fill": tokens_per_step[: last["step"]].mean() / positions,
    }


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
        rows[-1].update(throughput(records, *real_tokens(config, rows[-1]["steps"])))
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
