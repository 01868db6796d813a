"""Autoregressive image generation speed and memory: the paper's Tables 1, 2, 4 and 5.

Architectures are the paper's, as the image task gives them (`image_generation.paper_config`,
which configs/mnist.py and configs/cifar10.py start from: MNIST 8 layers, 784 sub-pixels;
CIFAR-10 16 layers, 3072), with untrained weights: the work per image does not depend on the
weights. Methods:

- linear/recurrent: linear attention as an RNN, (S, z) state per layer, one compiled `lax.scan`.
- softmax/kv-cache: softmax with a preallocated key/value cache ("stateful softmax", Table 4).
- softmax/recompute: the full parallel model over the whole image for every sub-pixel (the
  paper's softmax baseline).
- linear/recompute: the same baseline with linear attention (not run by default).

Every step of linear/recurrent (a fixed-size state) and of the recompute methods (the full-length
forward) costs the same by construction, so they may be timed over their first `timed_steps`
(`recompute_steps`) sub-pixels and the time scaled to the whole image. A KV-cache step reads only
the filled blocks of its cache, so step t costs O(t) and the first steps are the cheapest:
softmax/kv-cache is always timed over the whole image, whatever `timed_steps`, and its ms/step
is the mean over the image. The `timed_steps` column says how many sub-pixels were timed. The
step's FLOPs (`step_gflop`, `achieved_gflops`) are XLA's cost analysis of one step, given only
where every step costs the same.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.benchmarking import measure, peers, report
from experiments.data import pipeline
from experiments.tasks import image_generation
from linear_transformers import sample_images, sample_images_full_recompute

ARCHS = ("mnist", "cifar10")
METHODS = {
    "linear/recurrent": ("linear", sample_images),
    "softmax/kv-cache": ("softmax", sample_images),
    "softmax/recompute": ("softmax", sample_images_full_recompute),
    "linear/recompute": ("linear", sample_images_full_recompute),
}
DEFAULT_METHODS = ("linear/recurrent", "softmax/kv-cache", "softmax/recompute")
# Methods whose step cost grows with the step: timed over the whole image, never scaled.
WHOLE_IMAGE_METHODS = ("softmax/kv-cache",)


@dataclasses.dataclass(frozen=True)
class GenerationBenchOptions(measure.CaseOptions):
    """What `run` measures.

    archs: mnist (784 steps), cifar10 (3072).
    methods: linear/recurrent, softmax/kv-cache, softmax/recompute, linear/recompute.
    batches: Batch sizes.
    timed_steps: Sub-pixels timed per image (0: all); softmax/kv-cache is always timed whole.
    recompute_steps: Sub-pixels timed for recompute methods.
    memory_lengths: Generated lengths for the memory table (compile only).
    memory_batch: Batch size of the memory table.
    min_repeats: Time each case at least this often (a CIFAR-10 image with a KV cache: minutes).
    peers: Also time these libraries on the MNIST architecture, in this run: fast-transformers
        (the authors'; needs torch and pytorch-fast-transformers importable).
    dtype: The models' compute dtype (parameters stay float32).
    num_layers: Layers of the models (default: the paper's; fewer only for quick tests).
    matmul_reference: Also measure this machine's matmul throughput, for comparison.
    """

    archs: tuple[str, ...] = ARCHS
    methods: tuple[str, ...] = DEFAULT_METHODS
    batches: tuple[int, ...] = (1, 16)
    timed_steps: int = 128
    recompute_steps: int = 1
    memory_lengths: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
    memory_batch: int = 1
    min_seconds: float = 1.0
    peers: tuple[str, ...] = ()
    dtype: Literal["float32", "bfloat16"] = "float32"
    num_layers: int | None = None
    matmul_reference: bool = True

    def __post_init__(self):
        peers.check_peers(self.peers)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}.")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1 or None, got {self.num_layers}.")
        measure.check_known("architecture", self.archs, ARCHS)
        measure.check_known("method", self.methods, METHODS)
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be positive, got {self.batches}.")
        if self.timed_steps < 0 or self.recompute_steps < 1:
            raise ValueError("timed_steps must be >= 0 (0 = all) and recompute_steps >= 1.")


def paper_config(
    arch: str,
    attention: str | None = None,
    *,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: str = "float32",
):
    """The image task's config with the paper's architecture for `arch` ("mnist" or "cifar10"),
    optionally another attention kind, depth (quick tests) or compute dtype: the one place the
    benchmarks take the paper's model from."""
    config = image_generation.paper_config(arch)
    if attention is not None:
        config.model.attention = attention
    config.seed = seed
    if num_layers is not None:
        config.model.num_layers = num_layers
    config.model.dtype = dtype
    return config


def paper_model(arch: str, attention: str, *, max_length: int | None = None, **config):
    """The paper's image generator for `arch` ("mnist" or "cifar10") with `attention`, in eval
    mode (untrained); `max_length` changes the generated length; `config`: `paper_config`'s
    seed, num_layers (quick tests) and dtype."""
    info = pipeline.dataset_info(arch)
    if max_length is not None:  # a longer or shorter "image": memory vs generated length
        info = dataclasses.replace(info, image_shape=(max_length, 1, 1))
    model = image_generation.build_model(paper_config(arch, attention, **config), info)
    model.eval()
    return model


def _paper_model(opts: GenerationBenchOptions, arch: str, attention: str, **config):
    return paper_model(
        arch, attention, seed=opts.seed, num_layers=opts.num_layers, dtype=opts.dtype, **config
    )


def _compiled_sampler(model, sample, batch: int, num_steps: int):
    graphdef, params = nnx.split(model)

    def run(params, key):
        return sample(nnx.merge(graphdef, params), key, batch, num_steps=num_steps)

    key = jax.random.key(0)
    return jax.jit(run).lower(params, key).compile(), (params, key)


def step_flops(model, batch: int) -> float | None:
    """FLOPs of one recurrent step (XLA's cost analysis of the compiled step)."""
    graphdef, params = nnx.split(model)

    def one_step(params, state, token_B):
        return nnx.merge(graphdef, params).step(state, token_B)

    state = model.init_state(batch)
    compiled = jax.jit(one_step).lower(params, state, jnp.zeros((batch,), jnp.int32)).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    return float(cost["flops"]) if cost and "flops" in cost else None


def speed_row(arch: str, method: str, batch: int, length: int, steps: int) -> dict:
    """A generation case's row before it runs (`steps` of `length` sub-pixels timed)."""
    figures = ("peak_mib", "images_per_s", "seconds_per_image", "ms_per_step")
    head = {"arch": arch, "method": method, "batch": batch, "length": length, "timed_steps": steps}
    return {**head, **dict.fromkeys(figures, math.nan), "repeats": 0, "status": "ok"}


def add_speed(row: dict, timing: measure.Timing) -> float:
    """The row's speed from the time of its `timed_steps`, scaled to its length; -> s/step."""
    seconds_per_step = timing.median_s / row["timed_steps"]
    seconds_per_batch = seconds_per_step * row["length"]
    row.update(
        images_per_s=row["batch"] / seconds_per_batch,
        seconds_per_image=seconds_per_batch / row["batch"],
        ms_per_step=seconds_per_step * 1e3,
        repeats=timing.repeats,
    )
    return seconds_per_step


def time_method(opts: GenerationBenchOptions, arch: str, method: str, batch: int) -> dict:
    attention, sample = METHODS[method]
    model = _paper_model(opts, arch, attention)
    length = model.max_length
    limit = opts.recompute_steps if method.endswith("recompute") else opts.timed_steps
    steps = min(length, limit) if limit and method not in WHOLE_IMAGE_METHODS else length
    compiled, args = _compiled_sampler(model, sample, batch, steps)
    row = speed_row(arch, method, batch, length, steps)
    timing = measure.fit_and_time(row, compiled, lambda: args, opts.budget_bytes(), opts)
    if timing is None:
        return row
    seconds_per_step = add_speed(row, timing)
    # XLA counts a loop body once, and the KV-cache step loops over the filled blocks: its
    # cost analysis would be one block's, not a step's.
    if not method.endswith("recompute") and method not in WHOLE_IMAGE_METHODS:
        flops = step_flops(model, batch)
        row["step_gflop"] = flops / 1e9 if flops else math.nan
        row["achieved_gflops"] = flops / seconds_per_step / 1e9 if flops else math.nan
    return row


def peer_row(opts: GenerationBenchOptions, method: str, batch: int, length: int) -> dict:
    """The authors' recurrent model on the MNIST architecture (`peers.generation_call`)."""
    steps, call = peers.generation_call(method, batch, length, opts.timed_steps, seed=opts.seed)
    row = speed_row("mnist", f"fast-transformers:{peers.GENERATION_METHODS[method]}", batch, length, steps)
    add_speed(row, measure.time_call(call, min_repeats=opts.min_repeats, min_seconds=opts.min_seconds))
    return row


def memory_vs_length(opts: GenerationBenchOptions, method: str) -> list[dict]:
    """XLA's peak memory of generating L sub-pixels with the MNIST architecture (compile only)."""
    attention, sample = METHODS[method]
    rows = []
    for length in opts.memory_lengths:
        model = _paper_model(opts, "mnist", attention, max_length=length)
        peak = measure.peak_bytes(_compiled_sampler(model, sample, opts.memory_batch, length)[0])
        rows.append({"method": method, "length": length, "batch": opts.memory_batch})
        rows[-1]["peak_mib"] = (peak or math.nan) / 2**20
    return rows


def run(opts: GenerationBenchOptions, *, log=print) -> tuple[list[dict], list[dict]]:
    """(a speed row per architecture, batch and method, the memory rows of `memory_vs_length`)."""
    speed = []
    for arch in opts.archs:
        for batch in opts.batches:
            for method in opts.methods:
                rows = [time_method(opts, arch, method, batch)]
                if opts.peers and arch == "mnist" and method in peers.GENERATION_METHODS:
                    rows.append(peer_row(opts, method, batch, rows[0]["length"]))
                for row in rows:
                    speed.append(row)
                    log(
                        f"{arch:<8} B={batch:<5} {row['method']:<18} {row['images_per_s']:>10.3f} "
                        f"images/s {row['ms_per_step']:>9.3f} ms/step (timed "
                        f"{row['timed_steps']}/{row['length']} steps) {row['peak_mib']:>9.1f} "
                        f"MiB {row['status']}"
                    )
    memory = []
    for method in opts.methods:
        if method.endswith("recompute"):
            continue  # its memory is the parallel forward's: see benchmark_attention
        memory.extend(memory_vs_length(opts, method))
        log(
            f"memory {method}: "
            + ", ".join(f"L={r['length']} {r['peak_mib']:.1f} MiB" for r in memory if r["method"] == method)
        )
    return speed, memory


def ratios(speed: list[dict], baseline: str = "linear/recurrent") -> list[dict]:
    """images/s of the baseline over each other method, same architecture and batch."""
    ours = [r for r in speed if not r["method"].startswith("fast-transformers:")]
    return [
        {
            "arch": r["arch"],
            "batch": r["batch"],
            "method": r["method"],
            f"{baseline}_speedup": b["images_per_s"] / r["images_per_s"],
        }
        for r, b in report.paired(ours, ("arch", "batch"), "method", baseline, "images_per_s")
    ]


def summarize(
    opts: GenerationBenchOptions, ran: tuple[list[dict], list[dict]], machine: dict
) -> report.Report:
    speed, memory = ran
    extra = {
        "memory": memory,
        "ratios": ratios(speed),
        "peer_ratios": peers.same_run_ratios(
            speed, ("arch", "batch"), "ms_per_step", peers.GENERATION_METHODS, "method"
        ),
    }
    notes = []
    if opts.matmul_reference:
        # What this machine's matmuls reach: a large square one, and the MLP's shape per step.
        extra["matmul_gflops"] = {
            "2048x2048x2048": measure.matmul_flops_per_second(2048, 2048, 2048) / 1e9,
            **{f"{b}x256x1024": measure.matmul_flops_per_second(b, 256, 1024) / 1e9 for b in opts.batches},
        }
        gflops = ", ".join(f"{k}: {v:.1f}" for k, v in extra["matmul_gflops"].items())
        notes.append(f"\nmatmul GFLOP/s on this device: {gflops}")
    return report.Report(
        speed,
        "arch batch method images_per_s seconds_per_image ms_per_step timed_steps peak_mib achieved_gflops "
        "status".split(),
        tables=[
            report.Table(extra["ratios"]),
            report.Table(extra["peer_ratios"], peers.RATIOS_HEADING, csv="peers"),
            report.Table(memory, columns=("method", "length", "batch", "peak_mib"), csv="memory"),
        ],
        extra=extra,
        panels=[
            {
                "xlabel": "batch size",
                "ylabel": "images/s (more is better)",
                "series": report.series(
                    speed, "batch", "images_per_s", lambda r: f"{r['arch']} {r['method']}"
                ),
            },
            {
                "xlabel": f"generated length L (MNIST architecture, batch {opts.memory_batch})",
                "ylabel": "peak memory (MiB, XLA)",
                "series": report.series(memory, "length", "peak_mib", lambda r: r["method"]),
            },
        ],
        title=f"{machine['device']}, {opts.dtype}, untrained paper architectures; jax {machine['jax']}",
        notes=notes,
    )


def run_and_report(opts: GenerationBenchOptions, out_dir, *, log=print) -> dict:
    """Run, print tables, write generation.csv/json/png (and generation_memory/_peers.csv)."""
    return report.run_and_report("generation", opts, out_dir, run, summarize, log=log)
