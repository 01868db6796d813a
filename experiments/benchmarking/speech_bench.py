"""Speech recognition with CTC for softmax, linear, LSH-4 and the bi-LSTM, one after the other on
this machine, beside the paper's WSJ figures: a results table and PER curves.

Every run is `train_and_evaluate` on the speech task's schema (`experiments.tasks.speech`, as
configs/speech.py) with the `size` variants (default "cpu") and the run's own; runs already
finished in their workdir are read back, not retrained (the same steps for all).

  seconds_per_epoch  the time of one training step, averaged over the first `timed_steps`
                     batches of the run (every shape compiled first), times the steps of an
                     epoch (training utterances // batch_size); the runs are timed in
                     interleaved rounds, after all have trained, and the median round is kept,
                     so that every model sees the same machine
  longest_frames     the longest single utterance (frames after stacking, batch 1) whose
                     compiled forward+backward of the model XLA plans to fit in `memory_gib`
                     (arguments, outputs and temporaries from the compiled program's memory
                     analysis, by doubling the length: nothing runs at those lengths), with a
                     per-frame loss: the model's own memory
  longest_frames_ctc the same with the CTC loss (optax's lattice is frames x phonemes: it bounds
                     every model alike)

With `train=False` nothing is trained: the table holds the timings and memory of each model
under the config (e.g. `--overrides=stack_frames=1`: longer sequences, where attention costs
more).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import tasks
from experiments.benchmarking import measure, report
from experiments.data.speech import batching
from experiments.tasks import speech
from experiments.training import mesh as mesh_lib
from experiments.training import variants
from experiments.training.metrics import read_metrics
from experiments.training.trainer import Trainer

# name -> the speech task's variants applied after the size ones.
RUNS = {"softmax": "softmax", "linear": "linear", "lsh-4": "lsh4", "bi-lstm": "lstm"}
# The paper's WSJ results (section 4.3): phoneme error rate (%) and seconds per epoch.
PAPER = {
    "softmax": (5.12, 2711),
    "lsh-4": (9.33, 2250),
    "linear": (8.08, 824),
    "bi-lstm": (10.94, 1047),
}
TABLE_COLUMNS = [
    "run",
    "parameters",
    "steps",
    "seconds_per_epoch",
    "validation_per",
    "test_per",
    "test_loss",
    "longest_frames",
    "longest_frames_ctc",
    "paper_per",
    "paper_seconds_per_epoch",
]


@dataclasses.dataclass
class SpeechComparisonOptions:
    runs: tuple[str, ...] = tuple(RUNS)
    size: str = "cpu"  # the speech task's variants setting the scale
    overrides: str = ""  # further "key=value,..." applied last
    out_dir: str = "benchmark_results/speech"
    memory_gib: float = 16.0  # the budget of `longest_frames`; 0 = skip that measurement
    max_frames: int = 2**16  # the longest length tried for `longest_frames`
    timed_steps: int = 32  # batches per timing round (seconds_per_epoch)
    rounds: int = 5  # timing rounds; the median is kept
    train: bool = True  # False: time and size the models only (no training, no PER)

    def __post_init__(self):
        unknown = sorted(set(self.runs) - set(RUNS))
        if unknown:
            raise ValueError(f"unknown speech runs {unknown}; known: {list(RUNS)}.")


def run_config(name: str, options: SpeechComparisonOptions):
    parts = [options.size, RUNS[name], options.overrides]
    return variants.apply(speech.schema(), ",".join(p for p in parts if p), speech.VARIANTS)


def _frame_loss(model, batch):
    """A loss linear in the frames (each frame's log-probability of class 1): the model's own
    memory, without CTC's lattice."""
    logits_BTC = model(batch.features_BTF, frame_lengths_B=batch.frame_lengths_B)
    return -jnp.sum(jax.nn.log_softmax(logits_BTC)[..., 1])


def _ctc_loss(model, batch):
    return speech.loss_sums(model, batch)[0]


def planned_bytes(task: speech.Speech, frames: int, *, ctc: bool = True) -> int:
    """Bytes XLA plans for one compiled forward+backward of one utterance of `frames` frames
    (and frames / 2 phonemes, the corpus's rate at 4 stacked frames): with the CTC loss, or with
    a per-frame loss (`ctc=False`: the model alone)."""
    model = task.build_model()
    model.eval()  # no dropout masks: the model's own memory
    F = task.input_dim()
    batch = batching.SpeechBatch(
        jax.ShapeDtypeStruct((1, frames, F), jnp.float32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1, max(1, frames // 2)), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    graphdef, state = nnx.split(model)

    def gradients(state, batch):  # nnx.grad: the LSTM's RNG count changes inside its scan
        return nnx.grad(_ctc_loss if ctc else _frame_loss)(nnx.merge(graphdef, state), batch)

    compiled = jax.jit(gradients).lower(state, batch).compile()
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def longest_frames(task: speech.Speech, memory_gib: float, max_frames: int, *, ctc: bool = True) -> float:
    """The longest power-of-two length (>= bucket_frames) whose step (`planned_bytes`) fits in
    `memory_gib`; NaN if even the shortest does not."""
    best, frames = float("nan"), task.config.bucket_frames
    while frames <= max_frames and planned_bytes(task, frames, ctc=ctc) <= memory_gib * 2**30:
        best, frames = frames, frames * 2
    return best


def epoch_seconds(tasks_by_run: dict, options: SpeechComparisonOptions) -> dict[str, float]:
    """{run: seconds per training epoch}: the median of `rounds` interleaved rounds, each
    timing `timed_steps` training steps of every run (see the module docstring)."""
    trainers, batches = {}, {}
    for name, task in tasks_by_run.items():
        trainers[name] = Trainer(task.config, task, mesh_lib.make_mesh(task.config))
        batches[name] = [task.batch(step) for step in range(options.timed_steps)]
        for batch in batches[name]:  # compile every shape
            jax.block_until_ready(trainers[name].train(batch))
    seconds = {name: [] for name in trainers}
    for round_ in range(options.rounds):
        names = list(trainers)
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.perf_counter()
            for batch in batches[name]:
                metrics = trainers[name].train(batch)
            jax.block_until_ready(metrics)
            seconds[name].append((time.perf_counter() - start) / options.timed_steps)
    return {name: float(np.median(s)) * tasks_by_run[name].steps_per_epoch for name, s in seconds.items()}


def summarize(name: str, records: list[dict]) -> dict:
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "test_per" in r]
    if not train or not evals:
        raise ValueError(f"speech run {name!r} has no finished metrics.")
    last = train[-1]
    paper_per, paper_seconds = PAPER[name]
    return {
        "run": name,
        "steps": last["step"],
        "wall_time_s": last["wall_time"],
        "final_train_loss": last["loss"],
        "validation_per": evals[-1]["validation_per"],
        "test_per": evals[-1]["test_per"],
        "test_loss": evals[-1]["test_loss"],
        "paper_per": paper_per / 100,
        "paper_seconds_per_epoch": paper_seconds,
    }


def run_and_report(options: SpeechComparisonOptions, log=print) -> list[dict]:
    out = pathlib.Path(options.out_dir)
    rows, curves, tasks_by_run = [], {}, {}
    for name in options.runs:
        config = run_config(name, options)
        workdir = out / name
        log(f"== {name}: {workdir}")
        task = speech.Speech(config)
        if options.train:
            tasks.train_and_evaluate(config, workdir)
            records = read_metrics(workdir)
            row = summarize(name, records)
            curves[name] = [(r["step"], r["test_per"]) for r in records if "test_per" in r]
        else:
            task.check()
            row = {"run": name}
        task.load_data()
        tasks_by_run[name] = task
        params = nnx.state(task.build_model(), nnx.Param)
        row["parameters"] = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
        if options.memory_gib > 0:
            for ctc, key in ((False, "longest_frames"), (True, "longest_frames_ctc")):
                row[key] = longest_frames(task, options.memory_gib, options.max_frames, ctc=ctc)
        rows.append(row)
    log("== timing an epoch of each, interleaved")
    seconds = epoch_seconds(tasks_by_run, options)
    for row in rows:
        row["seconds_per_epoch"] = seconds[row["run"]]
    report.write_csv(out / "speech_results.csv", rows)
    report.write_json(
        out / "speech_results.json",
        machine=measure.machine_description(),
        options=dataclasses.asdict(options),
        rows=rows,
    )
    if curves:
        report.plot_series(
            out / "speech_per.png",
            [{"xlabel": "step", "ylabel": "test phoneme error rate", "series": curves}],
            title=f"speech recognition (CTC), size variant {options.size!r}",
            log_x=False,
        )
    log(report.markdown_table(rows, TABLE_COLUMNS))
    return rows
