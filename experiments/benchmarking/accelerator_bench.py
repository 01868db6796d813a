"""Every accelerator measurement BENCHMARKS.md asks for, from one command, into one report.

A GPU is lent rarely and briefly, so one run measures everything its "GPU" section lists, each
part by the benchmark module that already measures it on the CPU:

  kernel      kernel_bench: the Pallas kernel (Triton) of the gated family against XLA's chunked
              form and a copy of the forward's bytes (the roof), bf16, B=8, H=8, D=M=64,
              N = 16k, no decay and decays per step and per feature, with cuDNN flash
              attention; the goals forward <= 3x the copy, forward+backward >= 10x cuDNN, a
              decay <= 1.3x no decay.
  attention   attention_bench: causal-linear/chunked vs softmax (cuDNN flash attention and XLA),
              bf16, B=8, H=8, D=M=64, N = 16k and 64k, forward and forward+backward; the
              targets chunked >= 8x / 30x cuDNN at 16k / 64k.
  generation  generation_bench: the MNIST architecture (configs/mnist.py), linear recurrent vs
              softmax KV cache, bf16, batch 1 / 256 / 1024, whole images; the targets >= 3,500
              images/s and recurrent >= 4x the KV cache.
  train_step  the trainer's own jitted step (`Trainer.train`) of the paper's MNIST model on
              random sub-pixels, bf16 and float32: steps/s and tokens/s (no data, no training run).
  compile     that step's first call (trace, compile, run) at 2, 8 and 16 layers: one compiled
              layer (linear_transformers/layer_stack.py) keeps it flat in the depth.
  chunk_size  attention_bench's chunked form at one length, float32 and bf16, C = 32 .. 256.
  prefill     prefill_bench: a prompt read in one parallel pass vs token by token.
  gated       gated_bench: the decayed kinds against plain causal linear, and the delta rule
              per step (chunked and as a scan), bf16.

Every part has a time budget and the whole run a limit (`max_minutes`): a part stops starting
cases once its budget is spent (a case in flight finishes: a running XLA call cannot be
interrupted, so cases are sized to take seconds), and what was not run is listed with the
reason. A case that raises is recorded as failed and the part goes on; a part whose cases cannot
even be built is recorded as skipped and the next part runs. The report (accelerator.md and
accelerator.csv) is rewritten after every case, so a run killed half way (its lease ended)
still leaves every figure measured before.

`sizes="tiny"` runs every part at toy sizes in seconds (tests, a check of an install, on the
CPU too); `sizes="check"` is the accelerator sizes cut to what `experiments.check_accelerator`
has time for (attention at 16k, the bf16 step, the compile times); the accelerator sizes refuse
to run on a CPU (see `check_platform`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pathlib
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Literal

import jax
import numpy as np

from experiments.benchmarking import (
    attention_bench,
    gated_bench,
    generation_bench,
    kernel_bench,
    measure,
    prefill_bench,
    report,
)

PARTS = ("kernel", "attention", "generation", "train_step", "compile", "chunk_size", "prefill", "gated")
SIZES = ("accelerator", "check", "tiny")
CHUNKED = "causal-linear/chunked"
CUDNN = "softmax-cudnn"
# BENCHMARKS.md's GPU targets.
ATTENTION_TARGETS = {16384: 8.0, 65536: 30.0}  # N: chunked at least this many times cuDNN's speed
IMAGES_PER_S_TARGET = 3500.0  # MNIST architecture, linear recurrent, at the best batch
RECURRENT_OVER_KV_TARGET = 4.0  # linear recurrent images/s over the bf16 KV cache's, same batch
FLAT_COMPILE_TARGET = 1.25  # the first step at the deepest depth over the shallowest, same run


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What every part measures at one size. The benchmark modules' own options carry their
    shapes; only what those options cannot say (the batch per N, the dtypes and chunk sizes to
    sweep, the training model) is here."""

    attention: attention_bench.AttentionBenchOptions  # lengths, passes, heads, dims, dtype, repeats
    attention_batch: int  # B at every N (the module's `tokens` is set to B * N)
    chunk_length: int  # N of the chunk-size sweep (same B, H, D)
    chunk_dtypes: tuple[str, ...]
    chunk_sizes: tuple[int, ...]
    generation: generation_bench.GenerationBenchOptions  # (one case per method and batch)
    train_dataset: str  # its image shape sets the sequence length
    train_model: tuple[tuple[str, object], ...]  # config.model overrides of the paper's MNIST model
    train_batches: tuple[int, ...]
    train_dtypes: tuple[str, ...]
    train_min_seconds: float
    compile_layers: tuple[int, ...]  # depths whose first training step is timed
    prefill: prefill_bench.PrefillBenchOptions
    gated: gated_bench.GatedBenchOptions
    kernel: gated_bench.GatedBenchOptions  # decays and passes of the kernel part (impls: both)
    budgets_s: tuple[tuple[str, float], ...]  # (part, seconds)

    def budget_s(self, part: str) -> float:
        return dict(self.budgets_s)[part]


def _sizes(name: str) -> Sizes:
    if name == "tiny":
        return _tiny_sizes()
    if name == "check":
        full = _sizes("accelerator")
        return dataclasses.replace(
            full,
            attention=dataclasses.replace(full.attention, lengths=(16384,)),
            train_batches=(16,),
            train_dtypes=("bfloat16",),
            budgets_s=tuple(
                (part, dict(kernel=45.0, attention=45.0, train_step=30.0, compile=100.0).get(part, 60.0))
                for part in PARTS
            ),
        )
    return Sizes(
        attention=attention_bench.AttentionBenchOptions(lengths=(16384, 65536), dtype="bfloat16"),
        attention_batch=8,
        chunk_length=16384,
        chunk_dtypes=("float32", "bfloat16"),
        chunk_sizes=(32, 64, 128, 256),
        generation=generation_bench.GenerationBenchOptions(
            archs=("mnist",),
            methods=("linear/recurrent", "softmax/kv-cache"),
            batches=(1, 256, 1024),
            timed_steps=0,  # whole images: the GPU section's figures are per image
            memory_lengths=(),
            dtype="bfloat16",
        ),
        train_dataset="mnist",
        train_model=(),
        train_batches=(16, 128),  # 16: configs/mnist.py's batch
        train_dtypes=("bfloat16", "float32"),  # float32 to say what bf16 buys
        train_min_seconds=1.0,
        compile_layers=(2, 8, 16),
        # Image completion compiles two 8-layer samplers per case (~a minute in all): the
        # MNIST model's speed is the generation part's.
        prefill=prefill_bench.PrefillBenchOptions(batches=(1,), image_arch="", min_seconds=0.5),
        # The delta rule with a decay per step (Gated DeltaNet), chunked and as a scan; its goals
        # from the sweep's medians (the part's budget leaves no time for interleaved rounds).
        gated=gated_bench.GatedBenchOptions(
            batch=8, dtype="bfloat16", impls=("chunked",), delta_decays=("step",), goal_rounds=0
        ),
        kernel=gated_bench.GatedBenchOptions(
            lengths=(16384,), batch=8, dtype="bfloat16", decays=kernel_bench.DECAYS, delta_decays=()
        ),
        # Parts past max_minutes (8.5) are skipped: with JAX's start and a last case running
        # over, the run fits a 10-minute device command.
        budgets_s=tuple(zip(PARTS, (70.0, 90.0, 130.0, 70.0, 70.0, 50.0, 60.0, 50.0))),
    )


def _tiny_sizes() -> Sizes:
    """One case or two per part, forward passes only: what costs seconds here is compiling."""
    quick = {"min_repeats": 1, "min_seconds": 0.0}
    small = {"heads": 2, "head_dim": 8, "value_dim": 8, "dtype": "bfloat16", "passes": ("forward",)}
    return Sizes(
        attention=attention_bench.AttentionBenchOptions(lengths=(64,), chunk_size=16, **small, **quick),
        attention_batch=2,
        chunk_length=64,
        chunk_dtypes=("float32", "bfloat16"),
        chunk_sizes=(16,),
        generation=generation_bench.GenerationBenchOptions(
            archs=("mnist",),
            methods=("linear/recurrent",),  # the KV cache: generation_bench's own tests
            batches=(1,),
            timed_steps=1,
            memory_lengths=(),
            dtype="bfloat16",
            num_layers=1,
            **quick,
        ),
        train_dataset="digits",  # 64 sub-pixels
        train_model=(("num_layers", 1), ("num_heads", 2), ("model_dim", 16), ("feed_forward_dim", 32)),
        train_batches=(2,),
        train_dtypes=("bfloat16",),
        train_min_seconds=0.0,
        compile_layers=(1, 2),
        prefill=prefill_bench.PrefillBenchOptions(
            prompt_lengths=(16,),
            batches=(2,),
            kinds=("linear",),
            num_layers=1,
            model_dim=16,
            num_heads=2,
            vocab_size=11,
            image_arch="",  # image completion reuses generation's model, timed above
            **quick,
        ),
        gated=gated_bench.GatedBenchOptions(
            lengths=(64,), batch=2, decays=("step",), impls=("chunked",), delta_decays=(), **small, **quick
        ),
        kernel=gated_bench.GatedBenchOptions(
            lengths=(64,), batch=2, decays=("none", "feature"), delta_decays=(), **small, **quick
        ),
        budgets_s=tuple((part, 120.0) for part in PARTS),
    )


@dataclasses.dataclass(frozen=True)
class AcceleratorBenchOptions:
    """What `run_and_report` measures.

    sizes: accelerator: the GPU section's sizes; check: the part of them
        experiments.check_accelerator runs; tiny: seconds, any device.
    parts: Parts to run (the others are listed as not selected).
    max_minutes: Parts not started within this many minutes are skipped (a case in flight
        finishes).
    part_seconds: Each selected part's time budget in seconds (0: the part's own, sized for a
        run of every part: the kernel part's 70 s times the goals' cases, not its launch
        sweep; `--parts=kernel --part_seconds=330` gives it the sweep too).
    """

    sizes: Literal["accelerator", "check", "tiny"] = "accelerator"
    parts: tuple[str, ...] = PARTS
    max_minutes: float = 8.5
    part_seconds: float = 0.0

    def __post_init__(self):
        if self.sizes not in SIZES:
            raise ValueError(f"unknown sizes {self.sizes!r}; expected one of {SIZES}.")
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or not self.parts:
            raise ValueError(f"unknown or no parts {list(self.parts)}; expected some of {PARTS}.")
        if not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}.")
        if not self.part_seconds >= 0:
            raise ValueError(
                f"part_seconds must be >= 0 (0: each part's own budget), got {self.part_seconds}."
            )


# Parts whose accelerator sizes also fit a CPU (a training step of the paper's model: minutes).
CPU_SIZED_PARTS = ("train_step", "compile")


def check_platform(sizes: str, platform_name: str, parts=PARTS) -> None:
    """Refuse the accelerator sizes on a CPU, except for `CPU_SIZED_PARTS`. Why refuse rather
    than warn: on the 2-core CPU the attention part alone (B=8 at N=65536) and the batch-1024
    generation would run for hours, not minutes, and a report that says "cpu" in a file meant
    for GPU figures is worth less than a clear message; the CPU figures come from the individual
    benchmark commands."""
    too_big = [p for p in parts if p not in CPU_SIZED_PARTS]
    if platform_name == "cpu" and sizes != "tiny" and too_big:
        raise ValueError(
            f"--sizes={sizes} is sized for an accelerator (attention at N=65536 with B=8, "
            f"generation at batch 1024) and would run for hours on this CPU (parts {too_big}); "
            f"pass --sizes=tiny for a smoke run of every part in seconds, --parts="
            f"{','.join(CPU_SIZED_PARTS)} for the training step alone, or run it where "
            f"jax.devices() is a GPU (the CPU figures come from the individual python -m "
            f"experiments.benchmark_* commands)."
        )


def describe_machine() -> dict:
    """The device (kind, platform), versions and host, as the report names them."""
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "host": platform.node(),
        **measure.machine_description(device),
    }


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    run: Callable[[], list[dict]]  # -> rows


@dataclasses.dataclass
class PartResult:
    name: str
    budget_s: float
    status: str = "not started"
    seconds: float = 0.0
    rows: list[dict] = dataclasses.field(default_factory=list)


# --- the parts: each a list of cases, then its tables and targets from the rows ---------------


def attention_cases(sizes: Sizes) -> list[Case]:
    """The targets' pair (chunked, cuDNN) at every N first, then on a GPU the Pallas kernel (the
    paper's attention: elu, normalised), then XLA's softmax: if the budget runs out, what it
    costs is the least needed figure."""
    gpu = jax.devices()[0].platform == "gpu"
    opts = sizes.attention
    cases = [
        _sweep_case(attention_bench, _attention_opts(sizes, n), kind, pass_, n)
        for kinds in (
            [CHUNKED, CUDNN] if gpu else [CHUNKED],
            [attention_bench.PALLAS] if gpu else [],
            ["softmax"],
        )
        for n in opts.lengths
        for kind in kinds
        for pass_ in opts.passes
    ]
    if not gpu:  # said once in the table, so the targets' "not measured" has its reason
        cases.append(Case(CUDNN, lambda: [{"kind": CUDNN, "status": "skipped: cuDNN needs an NVIDIA GPU"}]))
    return cases


def _attention_opts(sizes: Sizes, n: int, **changes) -> attention_bench.AttentionBenchOptions:
    """The attention options of one N, at the part's batch (attention_bench's B = tokens // N)."""
    return dataclasses.replace(sizes.attention, lengths=(n,), tokens=sizes.attention_batch * n, **changes)


def _sweep_case(bench, opts, kind: str, pass_: str, n: int, label: str = "") -> Case:
    """One (kind, pass, N) case, as `bench` (attention_bench or gated_bench) runs it in its sweep."""

    def run() -> list[dict]:
        return [bench.run_case(opts, kind, pass_, n, opts.budget_bytes())]

    return Case(label or f"{kind} {pass_} N={n}", run)


def attention_targets(rows: list[dict]) -> list[dict]:
    times = {(r["kind"], r["pass"], r["n"]): r["time_ms"] for r in rows if r.get("status") == "ok"}
    return [
        _ratio_target(
            f"chunked >= {goal:g}x cuDNN flash attention, N={n}, {pass_}",
            times.get((CUDNN, pass_, n)),
            times.get((CHUNKED, pass_, n)),
            lambda ratio, goal=goal: ratio >= goal,
        )
        for n, goal in ATTENTION_TARGETS.items()
        for pass_ in attention_bench.PASSES
    ]


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _target(target: str, measured: str, met: bool | None) -> dict:
    return {
        "target": target,
        "measured": measured,
        "verdict": "not measured" if met is None else ("met" if met else "missed"),
    }


def _ratio_target(target: str, numerator, denominator, met: Callable[[float], bool]) -> dict:
    """The target on numerator / denominator (same run); not measured where either is missing."""
    if not (numerator and denominator):
        return _target(target, "not measured", None)
    ratio = numerator / denominator
    return _target(target, f"{ratio:.2f}x", met(ratio))


def generation_cases(sizes: Sizes) -> list[Case]:
    def case(method: str, batch: int):
        one = dataclasses.replace(sizes.generation, methods=(method,), batches=(batch,))
        return Case(
            f"{method} B={batch}", lambda: [{**r, "dtype": one.dtype} for r in generation_bench.run(one)[0]]
        )

    return [case(m, b) for b in sizes.generation.batches for m in sizes.generation.methods]


def generation_targets(rows: list[dict]) -> list[dict]:
    ips = {(r["method"], r["batch"]): r["images_per_s"] for r in rows if r.get("status") == "ok"}
    recurrent = {b: v for (m, b), v in ips.items() if m == "linear/recurrent"}
    target = f"MNIST architecture >= {IMAGES_PER_S_TARGET:,.0f} images/s (linear recurrent, best batch)"
    if recurrent:
        best = max(recurrent, key=recurrent.get)
        out = [
            _target(target, f"{_number(recurrent[best])} at B={best}", recurrent[best] >= IMAGES_PER_S_TARGET)
        ]
    else:
        out = [_target(target, "not measured", None)]
    for batch in dict.fromkeys(b for _, b in ips) or [None]:
        target = f"linear recurrent >= {RECURRENT_OVER_KV_TARGET:g}x softmax KV cache, B={batch}"
        lin, kv = ips.get(("linear/recurrent", batch)), ips.get(("softmax/kv-cache", batch))
        out.append(_ratio_target(target, lin, kv, lambda ratio: ratio >= RECURRENT_OVER_KV_TARGET))
    return out


def train_step_cases(sizes: Sizes) -> list[Case]:
    return [
        Case(f"{dtype} B={batch}", lambda dtype=dtype, batch=batch: [_train_step_row(sizes, dtype, batch)])
        for dtype in sizes.train_dtypes
        for batch in sizes.train_batches
    ]


def _training(sizes: Sizes, dtype: str, batch: int, layers: int | None = None):
    """(config, a function making its Trainer, random sub-pixels [batch, length]) of the paper's
    MNIST model (configs/mnist.py's) with `sizes`' data set and model overrides."""
    from experiments import tasks
    from experiments.training import mesh as mesh_lib
    from experiments.training import trainer as trainer_lib

    config = generation_bench.paper_config("mnist", dtype=dtype)
    config.dataset = sizes.train_dataset
    config.model.update(dict(sizes.train_model))
    config.model.num_layers = layers or config.model.num_layers
    config.batch_size = batch
    task = trainer_lib.check_config(config, tasks.task_class(config))
    shape = (batch, task.sequence_length())
    batch_BT = np.random.default_rng(config.seed).integers(0, task.info.num_classes, shape, dtype=np.uint8)
    return config, lambda: trainer_lib.Trainer(config, task, mesh_lib.make_mesh(config)), batch_BT


def _first_call(trainer, batch_BT) -> tuple[float, dict]:
    """(seconds, metrics) of one training step."""
    start = time.perf_counter()
    metrics = jax.block_until_ready(trainer.train(batch_BT))
    return time.perf_counter() - start, metrics


def _step_status(metrics) -> str:
    return "ok" if bool(metrics["finite"]) else "failed: non-finite loss or gradients"


def _train_step_row(sizes: Sizes, dtype: str, batch: int) -> dict:
    """The trainer's compiled step (loss, gradients, RAdam update, finite check; dropout on) of
    the paper's MNIST model on random sub-pixels: the step a training run repeats."""
    config, make_trainer, batch_BT = _training(sizes, dtype, batch)
    trainer = make_trainer()
    first_call_s, metrics = _first_call(trainer, batch_BT)  # compiles
    timing = measure.time_call(
        lambda: jax.block_until_ready(trainer.train(batch_BT)), min_seconds=sizes.train_min_seconds
    )
    length = batch_BT.shape[1]
    return {
        "dtype": dtype,
        "batch": batch,
        "length": length,
        "layers": config.model.num_layers,
        "params_m": sum(x.size for x in jax.tree.leaves(trainer.state["params"])) / 1e6,
        "step_ms": timing.median_s * 1e3,
        "steps_per_s": 1 / timing.median_s,
        "tokens_per_s": batch * length / timing.median_s,
        "first_call_s": first_call_s,
        "loss": float(metrics["loss"]),
        "repeats": timing.repeats,
        "status": _step_status(metrics),
    }


def compile_cases(sizes: Sizes) -> list[Case]:
    """A warm-up first: a process's first compile also pays one-time setup (on an H200, 13 s
    for a 2-layer step compiled first against 6 s after another), which is no depth's."""
    dtype, batch = sizes.train_dtypes[0], sizes.train_batches[0]

    def warm_up():
        row = _first_step_row(sizes, dtype, batch, min(sizes.compile_layers))
        return [{**row, "status": "warm-up: the process's first compile, not in the tables"}]

    return [Case("warm-up", warm_up)] + [
        Case(f"{layers} layers", lambda layers=layers: [_first_step_row(sizes, dtype, batch, layers)])
        for layers in sizes.compile_layers
    ]


def _first_step_row(sizes: Sizes, dtype: str, batch: int, layers: int) -> dict:
    """The trainer's first step at `layers` layers from an empty persistent compilation cache:
    tracing and lowering, XLA's compile, then the first run (first_call_s: all three, the
    compiled program read back from the cache it was just written to); the same step's first
    call in a fresh trainer once the cache holds it (cached_first_call_s: what a resumed run
    pays, jit's in-memory caches cleared); then the step's median time."""
    from jax.experimental.compilation_cache import compilation_cache

    _, make_trainer, batch_BT = _training(sizes, dtype, batch, layers)
    previous = jax.config.jax_compilation_cache_dir
    with tempfile.TemporaryDirectory() as cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        compilation_cache.reset_cache()
        try:
            trainer = make_trainer()
            with jax.set_mesh(trainer.mesh):
                args = (trainer.state, trainer.rng_state, trainer.shard_batch(batch_BT))
                start = time.perf_counter()
                lowered = trainer._train_step.trace(*args).lower()
                traced = time.perf_counter()
                compiled_step = lowered.compile()
                compiled = time.perf_counter()
            run_s, metrics = _first_call(trainer, batch_BT)  # jit compiles again, or reads the cache
            del compiled_step
            jax.clear_caches()
            warm_s, _ = _first_call(make_trainer(), batch_BT)
        finally:
            jax.config.update("jax_compilation_cache_dir", previous)
            compilation_cache.reset_cache()
    timing = measure.time_call(lambda: jax.block_until_ready(trainer.train(batch_BT)), min_seconds=0.0)
    return {
        "layers": layers,
        "dtype": dtype,
        "batch": batch,
        "trace_lower_s": traced - start,
        "compile_s": compiled - traced,
        "first_call_s": compiled - start + run_s,
        "cached_first_call_s": warm_s,
        "step_ms": timing.median_s * 1e3,
        "status": _step_status(metrics),
    }


def _ran_by_depth(rows: list[dict]) -> list[dict]:
    return sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["layers"])


def first_call_ratios(rows: list[dict]) -> list[dict]:
    ok = _ran_by_depth(rows)
    over = f"first_call_over_{ok[0]['layers']}_layers" if ok else ""
    return [{"layers": r["layers"], over: r["first_call_s"] / ok[0]["first_call_s"]} for r in ok]


def compile_targets(rows: list[dict]) -> list[dict]:
    ok = _ran_by_depth(rows)
    if len(ok) < 2:
        return [_target("first step flat in the depth", "not measured", None)]
    low, high = ok[0], ok[-1]
    target = f"first step at {high['layers']} layers <= {FLAT_COMPILE_TARGET:g}x that at {low['layers']}"
    return [
        _ratio_target(target, high["first_call_s"], low["first_call_s"], lambda r: r <= FLAT_COMPILE_TARGET)
    ]


def float32_over_bfloat16(rows: list[dict]) -> list[dict]:
    pairs = report.paired(rows, ("batch",), "dtype", "bfloat16", "step_ms")
    return [{"batch": r["batch"], "float32_over_bfloat16": r["step_ms"] / b["step_ms"]} for r, b in pairs]


def chunk_size_cases(sizes: Sizes) -> list[Case]:
    n = sizes.chunk_length
    return [
        _sweep_case(
            attention_bench,
            _attention_opts(sizes, n, dtype=dtype, chunk_size=c),
            CHUNKED,
            pass_,
            n,
            f"{dtype} C={c} {pass_}",
        )
        for dtype in sizes.chunk_dtypes
        for c in sizes.chunk_sizes
        for pass_ in sizes.attention.passes
    ]


def fastest_chunk_sizes(rows: list[dict]) -> list[dict]:
    ok = [r for r in rows if r.get("status") == "ok"]
    best = [
        min((r for r in ok if (r["dtype"], r["pass"]) == key), key=lambda r: r["time_ms"])
        for key in dict.fromkeys((r["dtype"], r["pass"]) for r in ok)
    ]
    return [
        {k: r[k] for k in ("dtype", "pass")}
        | {"fastest_chunk_size": r["chunk_size"], "time_ms": r["time_ms"]}
        for r in best
    ]


def prefill_cases(sizes: Sizes) -> list[Case]:
    opts = sizes.prefill

    def lm(kind, batch, length):
        one = dataclasses.replace(opts, kinds=(kind,), batches=(batch,), prompt_lengths=(length,))
        return Case(f"LM {kind} B={batch} P={length}", lambda: prefill_bench.run_lm(one))

    def images(kind, batch):
        one = dataclasses.replace(opts, image_kinds=(kind,), image_batches=(batch,))
        return Case(f"images {kind} B={batch}", lambda: prefill_bench.run_images(one))

    cases = [lm(k, b, p) for k in opts.kinds for b in opts.batches for p in opts.lengths_for(k)]
    if opts.image_arch:
        cases += [images(k, b) for k in opts.image_kinds for b in opts.image_batches]
    return cases


def gated_cases(sizes: Sizes) -> list[Case]:
    opts = sizes.gated
    return [
        _sweep_case(gated_bench, opts, k, p, n)
        for n in opts.lengths
        for k in opts.kinds()
        for p in opts.passes
    ]


def kernel_cases(sizes: Sizes) -> list[Case]:
    """What the kernel's goals need first (no decay: the kernel, the copy roof, cuDNN), then the
    kernel with each decay and its copy, then XLA's chunked form of every decay, then the
    kernel's other launches (`kernel_bench.TUNINGS`), decay by decay, each pass."""
    opts = sizes.kernel
    gpu = jax.devices()[0].platform == "gpu"

    def case(kind: str, pass_: str, n: int, tuning: dict | None = None) -> Case:
        label = "" if tuning is None else f" [{kernel_bench.tuning_label(tuning)}]"
        return Case(
            f"{kind} {pass_} N={n}{label}",
            lambda: [kernel_bench.run_case(opts, kind, pass_, n, opts.budget_bytes(), tuning=tuning)],
        )

    cases = []
    for n in opts.lengths:
        for decay in opts.decays:
            cases += [case(f"gated-{decay}/pallas", p, n) for p in opts.passes]
            cases.append(case(kernel_bench.copy_kind(decay), "forward", n))
            if decay == opts.decays[0] and gpu:
                cases += [
                    _sweep_case(attention_bench, _attention_opts(sizes, n), CUDNN, p, n) for p in opts.passes
                ]
        cases += [case(f"gated-{d}/chunked", p, n) for d in opts.decays for p in opts.passes]
    for n in opts.lengths:
        cases += [  # no decay first, whose goals come first, every launch of it
            case(f"gated-{d}/pallas", p, n, tuning)
            for d in opts.decays
            for tuning in kernel_bench.TUNINGS
            for p in opts.passes
            if kernel_bench.times_pass(tuning, p)
        ]
    if not gpu:
        cases.append(Case(CUDNN, lambda: [{"kind": CUDNN, "status": "skipped: cuDNN needs an NVIDIA GPU"}]))
    return cases


def kernel_targets(rows: list[dict]) -> list[dict]:
    """The kernel's goals at its default launch, then, where other launches ran, at each case's
    fastest launch (`kernel_bench.fastest`: the launch a default could take)."""
    lengths = list(dict.fromkeys(r["n"] for r in rows if "n" in r))
    out = _kernel_goals(kernel_bench.default_launches(rows), lengths, "")
    if any(not kernel_bench.is_default_launch(r) for r in rows if r.get("status") == "ok" and "kind" in r):
        out += _kernel_goals(kernel_bench.fastest_launches(rows), lengths, ", fastest launches")
    return out


def _kernel_goals(ran: dict, lengths: list, launches: str) -> list[dict]:
    """The goals at each N of `lengths` from `ran` ({(n, kind, pass): row}), named with
    `launches`."""
    ok = {(kind, pass_, n): r["time_ms"] for (n, kind, pass_), r in ran.items()}
    both = "forward+backward"
    out = []
    for n in lengths:
        kernel = ok.get(("gated-none/pallas", "forward", n))
        out.append(
            _ratio_target(
                f"pallas forward <= {kernel_bench.ROOF_GOAL:g}x the copy of its bytes, no decay, "
                f"N={n}{launches}",
                kernel,
                ok.get((kernel_bench.copy_kind("none"), "forward", n)),
                lambda ratio: ratio <= kernel_bench.ROOF_GOAL,
            )
        )
        out.append(
            _ratio_target(
                f"pallas {both} >= {kernel_bench.CUDNN_GOAL:g}x cuDNN flash attention, no decay, "
                f"N={n}{launches}",
                ok.get((CUDNN, both, n)),
                ok.get(("gated-none/pallas", both, n)),
                lambda ratio: ratio >= kernel_bench.CUDNN_GOAL,
            )
        )
        for decay in ("step", "feature"):
            out.append(
                _ratio_target(
                    f"pallas {both}, {decay} decay <= {kernel_bench.DECAY_GOAL:g}x no decay, N={n}{launches}",
                    ok.get((f"gated-{decay}/pallas", both, n)),
                    ok.get(("gated-none/pallas", both, n)),
                    lambda ratio: ratio <= kernel_bench.DECAY_GOAL,
                )
            )
    return out


def _gated_ratios(rows: list[dict]) -> list[dict]:
    return gated_bench.add_ratios([r for r in rows if "n" in r])


def gated_targets(rows: list[dict]) -> list[dict]:
    checks = gated_bench.goal_checks(_gated_ratios(rows))
    goal = f"x causal linear {gated_bench.GOAL_PASS}"
    return [
        {
            "target": f"{c['decay']} decay <= {gated_bench.GOAL_RATIO}{goal}, N={c['n']}",
            "measured": "-" if math.isnan(c["vs_causal_linear"]) else f"{c['vs_causal_linear']:.2f}x",
            "verdict": c["goal"],
        }
        for c in checks
    ]


@dataclasses.dataclass(frozen=True)
class PartSpec:
    title: str
    cases: Callable[[Sizes], list[Case]]
    columns: list[str]  # shown in the markdown table (the CSV has every column)
    tables: dict[str, Callable[[list[dict]], list[dict]]] = dataclasses.field(default_factory=dict)
    targets: Callable[[list[dict]], list[dict]] = lambda rows: []


_VS_CHUNKED = "time / time(causal-linear/chunked), same run"
_ATTENTION_COLUMNS = "kind pass n batch dtype chunk_size time_ms peak_mib status".split()
PART_SPECS = {
    "kernel": PartSpec(
        "The Pallas kernel of the gated family vs XLA's chunked form, cuDNN and the memory roof",
        kernel_cases,
        "kind pass n batch dtype chunk_size tuning time_ms bytes gb_per_s rel_err peak_mib status".split(),
        {
            "pallas, XLA chunked and a copy of the forward's bytes, same run": kernel_bench.comparison,
            "pallas launches (value blocks, warps, stages) vs the default, same run": kernel_bench.tunings,
            "pallas: each case's fastest launch, same run": kernel_bench.fastest,
        },
        kernel_targets,
    ),
    "attention": PartSpec(
        "Attention: causal linear (chunked) vs softmax (cuDNN flash, XLA)",
        attention_cases,
        _ATTENTION_COLUMNS,
        {_VS_CHUNKED: attention_bench.speedups},
        attention_targets,
    ),
    "generation": PartSpec(
        "Image generation, MNIST architecture: linear recurrent vs softmax KV cache",
        generation_cases,
        "method batch dtype images_per_s ms_per_step timed_steps length peak_mib status".split(),
        {"linear/recurrent images/s over each method's, same batch": generation_bench.ratios},
        generation_targets,
    ),
    "train_step": PartSpec(
        "Training step of the paper's MNIST model (trainer's jitted step, random sub-pixels)",
        train_step_cases,
        "dtype batch length step_ms steps_per_s tokens_per_s first_call_s loss status".split(),
        {"step time float32 / bfloat16, same run": float32_over_bfloat16},
    ),
    "compile": PartSpec(
        "The training step's first call by depth (the paper's MNIST model, bf16)",
        compile_cases,
        "layers dtype batch trace_lower_s compile_s first_call_s cached_first_call_s step_ms status".split(),
        {"first call / the shallowest's, same run": first_call_ratios},
        compile_targets,
    ),
    "chunk_size": PartSpec(
        "Chunk size of the chunked form, per dtype",
        chunk_size_cases,
        _ATTENTION_COLUMNS,
        {"fastest chunk size per dtype and pass": fastest_chunk_sizes},
    ),
    "prefill": PartSpec(
        "Prefill: the prompt in one parallel pass vs token by token",
        prefill_cases,
        "kind batch prompt prefix method time_ms images_per_s compile_s peak_mib status".split(),
        {
            "language model: step-scan / prefill, same run": lambda rows: prefill_bench.speedups(
                [r for r in rows if "prompt" in r], prefill_bench.LM_GROUP
            ),
            "image completion: step-scan / prefill, same run": lambda rows: prefill_bench.speedups(
                [r for r in rows if "prefix" in r], prefill_bench.IMAGE_GROUP
            ),
        },
    ),
    "gated": PartSpec(
        "The gated kinds: what a decay costs",
        gated_cases,
        "kind pass n batch dtype time_ms peak_mib status".split(),
        {_VS_CHUNKED: lambda rows: gated_bench.ratio_table(_gated_ratios(rows))},
        gated_targets,
    ),
}


# --- the run and its report ---------------------------------------------------------------------


def run_and_report(opts: AcceleratorBenchOptions, out_dir, *, log=print) -> dict:
    """Run the selected parts in order, rewriting out_dir/accelerator.{md,csv} after every case;
    returns {"parts": {name: PartResult}, "targets": [...], "files": {...}}."""
    check_platform(opts.sizes, jax.devices()[0].platform, opts.parts)
    sizes = _sizes(opts.sizes)
    out_dir = pathlib.Path(out_dir)
    machine = describe_machine()
    log(f"machine: {machine}")
    results = {name: PartResult(name, opts.part_seconds or sizes.budget_s(name)) for name in PARTS}
    start = time.perf_counter()
    deadline = start + opts.max_minutes * 60

    def write(finished=False):
        return write_report(out_dir, machine, opts, results, time.perf_counter() - start, finished=finished)

    for name in PARTS:
        result = results[name]
        if name not in opts.parts:
            result.status = f"skipped: not selected (--parts={','.join(opts.parts)})"
            continue
        if time.perf_counter() >= deadline:
            result.status = f"skipped: the run's limit of {opts.max_minutes:g} minutes was spent before it"
            write()
            continue
        log(f"--- {name} (budget {result.budget_s:g} s)")
        part_deadline = time.perf_counter() + result.budget_s
        spent = f"the part's budget of {result.budget_s:g} s was spent"
        if deadline < part_deadline:
            part_deadline, spent = deadline, f"the run's limit of {opts.max_minutes:g} minutes was spent"
        _run_part(name, sizes, result, part_deadline, spent, write, log)
        log(f"--- {name}: {result.status} ({result.seconds:.1f} s)")
        jax.clear_caches()  # the next part starts with the device's memory free
        gc.collect()
    files = write(finished=True)
    log(f"wrote {files['md']}, {files['csv']}")
    return {"parts": results, "targets": all_targets(results), "files": files}


def _run_part(name: str, sizes: Sizes, result: PartResult, deadline: float, spent: str, write, log) -> None:
    """Run one part's cases into `result` until `deadline` (then the rest are listed as not run,
    because `spent`), writing the report after each."""
    spec = PART_SPECS[name]
    start = time.perf_counter()
    try:
        cases = spec.cases(sizes)
    except Exception as e:  # noqa: BLE001 - one part failing must not lose the others
        result.status = f"skipped: failed: {_error(e)}"
        result.seconds = time.perf_counter() - start
        write()
        return
    failed = unrun = 0
    for case in cases:
        if time.perf_counter() >= deadline:
            unrun += 1
            rows = [{"status": f"skipped: {spent}"}]
        else:
            try:
                rows = case.run()
            except Exception as e:  # noqa: BLE001 - record why, go on with the next case
                failed += 1
                rows = [{"status": f"failed: {_error(e)}"}]
        result.rows.extend({"case": case.label, **r} for r in rows)
        for r in rows:
            log(f"{name} {case.label}: {r.get('status')}")
        result.seconds = time.perf_counter() - start
        result.status = f"running: {len(result.rows)} rows"
        write()
    if cases and failed == len(cases):
        result.status = f"skipped: failed: {result.rows[0]['status'].removeprefix('failed: ')}"
    elif failed or unrun:
        result.status = f"partial: {failed} of {len(cases)} cases failed, {unrun} not run"
        result.status += f" ({spent})" if unrun else ""
    else:
        result.status = f"ok: {len(cases)} case{'s' if len(cases) != 1 else ''}"
    result.seconds = time.perf_counter() - start


def _error(e: Exception) -> str:
    """The error's type and first line, fit for a markdown table cell."""
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}".replace("|", "/")


def all_targets(results: dict[str, PartResult]) -> list[dict]:
    return [{"part": name, **t} for name, result in results.items() for t in _derived(name, result.rows)[1]]


def _derived(name: str, rows: list[dict]) -> tuple[list[tuple[str, list[dict]]], list[dict]]:
    """(tables, targets) of a part's rows; a bug there costs those lines, not the report."""
    spec = PART_SPECS[name]
    try:
        return [(heading, table(rows)) for heading, table in spec.tables.items()], spec.targets(rows)
    except Exception as e:  # noqa: BLE001 - the rows are still written
        return [("derived tables failed", [{"error": _error(e)}])], []


def device_line(machine: dict) -> str:
    """The device, versions and host of `describe_machine`, as the reports open."""
    m = machine
    return (
        f"**Device:** {m['device_kind']} (platform {m['platform']}, {m['num_devices']} device(s)); "
        f"jax {m['jax']}, jaxlib {m['jaxlib']}, flax {m['flax']}, numpy {m['numpy']}; host {m['host']} "
        f"({m['machine']}, {m['host_cpus']} CPUs)."
    )


def write_report(
    out_dir, machine: dict, opts, results: dict[str, PartResult], elapsed_s: float, *, finished: bool
) -> dict:
    """accelerator.md (summary, targets, one section per part) and accelerator.csv (every row,
    one summary row per part, one row per target; every row names the device)."""
    targets = all_targets(results)
    parts = [
        {"part": n, "status": r.status, "seconds": r.seconds, "budget_s": r.budget_s, "rows": len(r.rows)}
        for n, r in results.items()
    ]
    command = (
        f"python -m experiments.benchmark_accelerator --sizes={opts.sizes} --parts={','.join(opts.parts)} "
        f"--max_minutes={opts.max_minutes:g}"
    )
    lines = [
        "# Accelerator benchmark report",
        "",
        device_line(machine),
        "",
        f"`{command}`: {'finished' if finished else 'in progress'} after {elapsed_s:.0f} s. Times are "
        "medians of repeats of a compiled call (compile excluded); memory is XLA's figure for the "
        "compiled call.",
        "",
        "## Parts",
        "",
        report.Table(parts).markdown(),
        "",
        "## Targets",
        "",
        "BENCHMARKS.md's GPU targets, from this run's rows.",
        "",
        report.Table(targets).markdown() if targets else "(none measured)",
    ]
    for name, result in results.items():
        spec = PART_SPECS[name]
        lines += ["", f"## {name}: {spec.title}", "", f"Status: {result.status}.", ""]
        if result.rows:
            lines.append(report.Table(result.rows, columns=["case", *spec.columns]).markdown())
            for heading, table in _derived(name, result.rows)[0]:
                lines += ["", f"{heading}:", "", report.Table(table).markdown()] if table else []
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "accelerator.md"
    md.write_text("\n".join(lines) + "\n")
    # A summary row per part, every part's rows, a row per target; each names the device.
    device = {"device": machine["device_kind"], "platform": machine["platform"]}
    summary = ("status", "seconds", "budget_s")
    rows = [
        {"part": p["part"], "case": "part summary", **device, **{k: p[k] for k in summary}} for p in parts
    ]
    rows += [{"part": name, **device, **row} for name, r in results.items() for row in r.rows]
    rows += [
        {
            "part": t["part"],
            "case": "target: " + t["target"],
            **device,
            "status": t["verdict"],
            "measured": t["measured"],
        }
        for t in targets
    ]
    return {"md": md, "csv": report.write_csv(out_dir / "accelerator.csv", rows)}
