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

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.benchmarking import measure, peers
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
class GenerationBenchOptions:
    archs: tuple[str, ...] = ARCHS
    methods: tuple[str, ...] = DEFAULT_METHODS
    batches: tuple[int, ...] = (1, 16)
    timed_steps: int = 128  # at most this many sub-pixels timed per image (0 = all; KV cache: all)
    recompute_steps: int = 1  # ... for the recompute methods
    memory_lengths: tuple[int, ...] = (256, 1024, 4096, 16384, 65536)
    memory_batch: int = 1
    min_repeats: int = 3
    min_seconds: float = 1.0
    memory_fraction: float = 0.6  # of free memory; a case needing more is skipped
    seed: int = 0
    peers: tuple[str, ...] = ()  # "fast-transformers": the authors' library, MNIST shapes
    dtype: str = "float32"  # the model's compute dtype (parameters stay float32)
    num_layers: int | None = None  # None: the paper's depth (fewer: quick tests)

    def __post_init__(self):
        peers.check_peers(self.peers)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}.")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1 or None, got {self.num_layers}.")
        for a in self.archs:
            if a not in ARCHS:
                raise ValueError(f"unknown architecture {a!r}; expected some of {ARCHS}.")
        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"unknown method {m!r}; expected some of {tuple(METHODS)}.")
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


def paper_model(
    arch: str,
    attention: str,
    *,
    max_length: int | None = None,
    seed: int = 0,
    num_layers: int | None = None,
    dtype: str = "float32",
):
    """The paper's image generator for `arch` ("mnist" or "cifar10") with `attention`, in eval
    mode (untrained); `max_length` changes the generated length, `num_layers` the depth (quick
    tests), `dtype` the compute dtype."""
    config = paper_config(arch, attention, seed=seed, num_layers=num_layers, dtype=dtype)
    info = pipeline.dataset_info(arch)
    if max_length is not None:  # a longer or shorter "image": memory vs generated length
        info = dataclasses.replace(info, image_shape=(max_length, 1, 1))
    model = image_generation.build_model(config, info)
    model.eval()
    return model


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


def time_method(opts: GenerationBenchOptions, arch: str, method: str, batch: int) -> dict:
    attention, sample = METHODS[method]
    model = paper_model(arch, attention, seed=opts.seed, num_layers=opts.num_layers, dtype=opts.dtype)
    length = model.max_length
    limit = opts.recompute_steps if method.endswith("recompute") else opts.timed_steps
    steps = min(length, limit) if limit and method not in WHOLE_IMAGE_METHODS else length
    compiled, args = _compiled_sampler(model, sample, batch, steps)
    row = {
        "arch": arch,
        "method": method,
        "batch": batch,
        "length": length,
        "timed_steps": steps,
        "peak_mib": (measure.peak_bytes(compiled) or math.nan) / 2**20,
    }
    budget = measure.memory_budget_bytes(fraction=opts.memory_fraction)
    if row["peak_mib"] * 2**20 > budget:
        row.update(
            images_per_s=math.nan,
            seconds_per_image=math.nan,
            ms_per_step=math.nan,
            repeats=0,
            status=f"skipped: needs {row['peak_mib'] / 1024:.1f} GiB, budget {budget / 2**30:.1f} GiB",
        )
        return row
    timing = measure.time_compiled(
        compiled, *args, min_repeats=opts.min_repeats, min_seconds=opts.min_seconds
    )
    seconds_per_step = timing.median_s / steps
    seconds_per_batch = seconds_per_step * length
    row.update(
        images_per_s=batch / seconds_per_batch,
        seconds_per_image=seconds_per_batch / batch,
        ms_per_step=seconds_per_step * 1e3,
        repeats=timing.repeats,
        status="ok",
    )
    # XLA counts a loop body once, and the KV-cache step loops over the filled blocks: its
    # cost analysis would be one block's, not a step's.
    if not method.endswith("recompute") and method not in WHOLE_IMAGE_METHODS:
        flops = step_flops(model, batch)
        row["step_gflop"] = flops / 1e9 if flops else math.nan
        row["achieved_gflops"] = flops / seconds_per_step / 1e9 if flops else math.nan
    return row


def memory_vs_length(opts: GenerationBenchOptions, method: str) -> list[dict]:
    """XLA's peak memory of generating L sub-pixels with the MNIST architecture (compile only)."""
    attention, sample = METHODS[method]
    rows = []
    for length in opts.memory_lengths:
        model = paper_model(
            "mnist",
            attention,
            max_length=length,
            seed=opts.seed,
            num_layers=opts.num_layers,
            dtype=opts.dtype,
        )
        compiled, _ = _compiled_sampler(model, sample, opts.memory_batch, length)
        peak = measure.peak_bytes(compiled)
        rows.append(
            {
                "method": method,
                "length": length,
                "batch": opts.memory_batch,
                "peak_mib": (peak or math.nan) / 2**20,
            }
        )
    return rows


def run(opts: GenerationBenchOptions, *, log=print) -> tuple[list[dict], list[dict]]:
    speed = []
    for arch in opts.archs:
        for batch in opts.batches:
            for method in opts.methods:
                rows = [time_method(opts, arch, method, batch)]
                if opts.peers and arch == "mnist" and method in peers.GENERATION_METHODS:
                    rows.append(
                        peers.generation_row(
                            method,
                            batch,
                            rows[0]["length"],
                            opts.timed_steps,
                            min_repeats=opts.min_repeats,
                            min_seconds=opts.min_seconds,
                            seed=opts.seed,
                        )
                    )
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
    by_key = {
        (r["arch"], r["batch"], r["method"]): r["images_per_s"]
        for r in speed
        if not r["method"].startswith("fast-transformers:")
    }
    out = []
    for (arch, batch, method), ips in by_key.items():
        base = by_key.get((arch, batch, baseline))
        if base and method != baseline and math.isfinite(ips):
            out.append({"arch": arch, "batch": batch, "method": method, f"{baseline}_speedup": base / ips})
    return out


def run_and_report(
    opts: GenerationBenchOptions, out_dir, *, matmul_reference: bool = True, log=print
) -> dict:
    """Run, print tables, write generation*.csv/json and generation.png under out_dir."""
    import pathlib

    from experiments.benchmarking import report

    out_dir = pathlib.Path(out_dir)
    machine = measure.machine_description()
    log(f"machine: {machine}")
    speed, memory = run(opts, log=log)
    extra = {
        "ratios": ratios(speed),
        "peer_ratios": peers.same_run_ratios(
            speed, ("arch", "batch"), "ms_per_step", peers.GENERATION_METHODS, "method"
        ),
    }
    if matmul_reference:
        # What this machine's matmuls reach: a large square one, and the MLP's shape per step.
        extra["matmul_gflops"] = {
            "2048x2048x2048": measure.matmul_flops_per_second(2048, 2048, 2048) / 1e9,
            **{f"{b}x256x1024": measure.matmul_flops_per_second(b, 256, 1024) / 1e9 for b in opts.batches},
        }
    files = {
        "csv": report.write_csv(out_dir / "generation.csv", speed),
        "memory_csv": report.write_csv(out_dir / "generation_memory.csv", memory),
        "json": report.write_json(
            out_dir / "generation.json",
            machine=machine,
            options=dataclasses.asdict(opts),
            rows=speed,
            memory=memory,
            **extra,
        ),
    }
    methods = list(dict.fromkeys(r["method"] for r in speed))
    panels = [
        {
            "xlabel": "batch size",
            "ylabel": "images/s (more is better)",
            "series": {
                f"{arch} {m}": [
                    (r["batch"], r["images_per_s"]) for r in speed if r["arch"] == arch and r["method"] == m
                ]
                for arch in opts.archs
                for m in methods
            },
        },
        {
            "xlabel": f"generated length L (MNIST architecture, batch {opts.memory_batch})",
            "ylabel": "peak memory (MiB, XLA)",
            "series": {
                m: [(r["length"], r["peak_mib"]) for r in memory if r["method"] == m]
                for m in dict.fromkeys(r["method"] for r in memory)
            },
        },
    ]
    files["png"] = report.plot_series(
        out_dir / "generation.png",
        panels,
        title=f"{machine['device']}, float32, untrained paper architectures; jax {machine['jax']}",
    )
    log(
        "\n"
        + report.markdown_table(
            speed,
            [
                c
                for c in (
                    "arch",
                    "batch",
                    "method",
                    "images_per_s",
                    "seconds_per_image",
                    "ms_per_step",
                    "timed_steps",
                    "peak_mib",
                    "achieved_gflops",
                    "status",
                )
                if any(c in r for r in speed)
            ],
        )
    )
    if extra["ratios"]:
        log("\n" + report.markdown_table(extra["ratios"], list(extra["ratios"][0])))
    if extra["peer_ratios"]:
        log(
            "\nthe authors' library in this run (theirs_over_ours > 1: ours is faster):\n"
            + report.markdown_table(extra["peer_ratios"], list(extra["peer_ratios"][0]))
        )
        files["peers_csv"] = report.write_csv(out_dir / "generation_peers.csv", extra["peer_ratios"])
    if memory:
        log("\n" + report.markdown_table(memory, ["method", "length", "batch", "peak_mib"]))
    if matmul_reference:
        log(
            "\nmatmul GFLOP/s on this device: "
            + ", ".join(f"{k}: {v:.1f}" for k, v in extra["matmul_gflops"].items())
        )
    log("wrote " + ", ".join(str(p) for p in files.values()))
    return {"speed": speed, "memory": memory, "files": files, **extra}
