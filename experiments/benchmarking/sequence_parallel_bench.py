"""Memory per device and step time of a sequence-parallel training step, vs the devices P.

Legend: B batch, T sequence length, P devices on the "sequence" mesh axis, V vocabulary.

A `CausalLM` (untrained) takes one full training step -- cross-entropy loss, gradients, an optax
Adam update, one jitted function -- on a [B, T] batch whose time axis is split over a 1-D mesh of
the first P devices (inputs sharded `PartitionSpec(None, "sequence")`, parameters and optimizer
state replicated). For P > 1 the model is built with `TransformerConfig(sequence_axis="sequence")`
so every attention layer runs sequence-parallel (linear: one all-gather of per-device (S, z)
states, LASP-2; softmax: all-gathered keys and values); everything else is per token and follows
the inputs' sharding. P = 1 is the same step on one device without the axis.

Memory per device is XLA's figure for the compiled SPMD program, which is the per-device program:
`measure.peak_bytes` = argument + output + temporary - aliased bytes of `memory_analysis()` (the
CSV also has each field). Only the activations (temporaries) and the [B, T] inputs are split; the
replicated parameters, Adam moments and their updated copies (arguments and outputs, nothing is
donated so the same arguments can be timed again) are not, so the total falls a little slower
than 1/P. On a CPU host the P "devices" are threads sharing the same cores: the step time shows
the cost of the split, not a speed-up.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from experiments.benchmarking import measure
from linear_transformers.lm import CausalLM
from linear_transformers.transformer import TransformerConfig

AXIS = "sequence"
KINDS = ("linear", "softmax")


@dataclasses.dataclass(frozen=True)
class SequenceParallelBenchOptions:
    """What `run` measures: every kind at every P, linear at `length`, softmax at
    `softmax_length` (its [T/P, T] score blocks make long sequences expensive)."""

    parallelism: tuple[int, ...] = (1, 2, 4, 8)
    length: int = 32768
    softmax_length: int = 8192
    batch: int = 1
    kinds: tuple[str, ...] = KINDS
    num_layers: int = 2
    model_dim: int = 64
    num_heads: int = 4
    vocab_size: int = 256
    learning_rate: float = 1e-3
    min_repeats: int = 3
    min_seconds: float = 1.0
    memory_fraction: float = 0.6  # of free host memory, for all P devices together
    seed: int = 0

    def __post_init__(self):
        for kind in self.kinds:
            if kind not in KINDS:
                raise ValueError(f"unknown attention kind {kind!r}; expected some of {KINDS}.")
        if not self.parallelism or min(self.parallelism) < 1:
            raise ValueError(f"parallelism must be positive device counts, got {self.parallelism}.")
        for kind in self.kinds:
            length = self.length_for(kind)
            bad = [p for p in self.parallelism if length % p]
            if length < 1 or bad:
                raise ValueError(
                    f"{kind}: sequence length {length} must be positive and divide "
                    f"by every P in {self.parallelism} (not by {bad})."
                )
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}.")

    def length_for(self, kind: str) -> int:
        """The sequence length `kind` runs at."""
        return self.softmax_length if kind == "softmax" else self.length


def sequence_mesh(num_devices: int) -> jax.sharding.Mesh:
    """A 1-D mesh with axis "sequence" over the first `num_devices` devices (automatic sharding
    outside the attention layers, which split time themselves)."""
    available = jax.device_count()
    if num_devices > available:
        raise ValueError(
            f"P={num_devices} needs {num_devices} devices but JAX sees {available}; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} before jax is "
            "imported (experiments.benchmark_sequence_parallel does so)."
        )
    return jax.make_mesh(
        (num_devices,), (AXIS,), devices=jax.devices()[:num_devices], axis_types=(jax.sharding.AxisType.Auto,)
    )


def lm_model(opts: SequenceParallelBenchOptions, kind: str, num_devices: int) -> CausalLM:
    """The benchmark's model; sequence-parallel when P > 1. Same seed, same weights for every P."""
    extra = {"sequence_axis": AXIS} if num_devices > 1 else {}
    config = TransformerConfig(
        num_layers=opts.num_layers,
        num_heads=opts.num_heads,
        model_dim=opts.model_dim,
        attention=kind,
        dropout=0.0,
        **extra,
    )
    return CausalLM(config, opts.vocab_size, rngs=nnx.Rngs(opts.seed))


def make_train_step(graphdef, tx):
    """(params, opt_state, rest, tokens_BT, targets_BT) -> (params, opt_state, loss)."""

    def train_step(params, opt_state, rest, tokens_BT, targets_BT):
        def loss_fn(params):
            logits_BTV = nnx.merge(graphdef, params, rest)(tokens_BT)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits_BTV.astype(jnp.float32), targets_BT
            ).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def run_case(opts: SequenceParallelBenchOptions, kind: str, num_devices: int, budget: int) -> dict:
    """Compile the step for (kind, P), read its per-device memory, time it unless over budget."""
    length = opts.length_for(kind)
    row = {
        "kind": kind,
        "P": num_devices,
        "length": length,
        "batch": opts.batch,
        "tokens_per_device": length // num_devices,
        "argument_mib": math.nan,
        "output_mib": math.nan,
        "temp_mib": math.nan,
        "alias_mib": math.nan,
        "peak_mib": math.nan,
        "step_ms": math.nan,
        "compile_s": math.nan,
        "loss": math.nan,
        "repeats": 0,
        "status": "ok",
    }
    mesh = sequence_mesh(num_devices)
    model = lm_model(opts, kind, num_devices)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(opts.learning_rate)
    tokens = np.asarray(
        jax.random.randint(jax.random.key(opts.seed), (opts.batch, length + 1), 0, opts.vocab_size, jnp.int32)
    )
    with jax.set_mesh(mesh):
        replicated = NamedSharding(mesh, PartitionSpec())
        split_time = NamedSharding(mesh, PartitionSpec(None, AXIS))
        params, rest = jax.device_put((params, rest), replicated)
        opt_state = jax.device_put(tx.init(params), replicated)
        inputs_BT = jax.device_put(tokens[:, :-1], split_time)
        targets_BT = jax.device_put(tokens[:, 1:], split_time)
        args = (params, opt_state, rest, inputs_BT, targets_BT)
        start = time.perf_counter()
        compiled = jax.jit(make_train_step(graphdef, tx)).lower(*args).compile()
        row["compile_s"] = time.perf_counter() - start
        analysis = compiled.memory_analysis()
        if analysis is not None:
            for field in ("argument", "output", "temp", "alias"):
                row[f"{field}_mib"] = getattr(analysis, f"{field}_size_in_bytes") / 2**20
        peak = measure.peak_bytes(compiled)
        if peak is not None:
            row["peak_mib"] = peak / 2**20
            if peak * num_devices > budget:  # all P devices live in this one process
                row["status"] = (
                    f"skipped: needs {peak * num_devices / 2**30:.1f} GiB on "
                    f"{num_devices} devices, budget {budget / 2**30:.1f} GiB"
                )
                return row
        timing = measure.time_compiled(
            compiled, *args, min_repeats=opts.min_repeats, min_seconds=opts.min_seconds
        )
        row.update(step_ms=timing.median_s * 1e3, repeats=timing.repeats, loss=float(compiled(*args)[2]))
    return row


def run(opts: SequenceParallelBenchOptions, *, log=print) -> list[dict]:
    """Every (kind, P) case; returns one row per case, with ratios to P = 1 of the same kind."""
    needed = max(opts.parallelism)
    if needed > jax.device_count():
        sequence_mesh(needed)  # raises the explanatory error
    budget = measure.memory_budget_bytes(fraction=opts.memory_fraction)
    rows = []
    for kind in opts.kinds:
        for num_devices in sorted(opts.parallelism):
            row = run_case(opts, kind, num_devices, budget)
            rows.append(row)
            log(
                f"{kind:<8} T={row['length']:<6} P={num_devices} "
                f"{row['peak_mib']:>9.1f} MiB/device (temp {row['temp_mib']:.1f}) "
                f"{row['step_ms']:>9.1f} ms/step  compile {row['compile_s']:.1f} s  "
                f"loss {row['loss']:.5f}  {row['status']}"
            )
    return add_ratios(rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row plus peak_vs_p1, temp_vs_p1, step_vs_p1 (this P's figure / P = 1's, same kind),
    ideal_memory 1/P, and loss_diff_vs_p1 (the same function on the same data)."""
    base = {r["kind"]: r for r in rows if r["P"] == 1}
    out = []
    for r in rows:
        b = base.get(r["kind"])
        r = {**r, "ideal_memory": 1.0 / r["P"]}
        for name, field in (
            ("peak_vs_p1", "peak_mib"),
            ("temp_vs_p1", "temp_mib"),
            ("step_vs_p1", "step_ms"),
        ):
            r[name] = r[field] / b[field] if b and b[field] else math.nan
        r["loss_diff_vs_p1"] = abs(r["loss"] - b["loss"]) if b else math.nan
        out.append(r)
    return out


def memory_slopes(rows: list[dict], field: str = "peak_mib") -> dict[str, float]:
    """Log-log slope of `field` (per device) vs P for each kind; -1 is a perfect 1/P split."""
    slopes = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        pts = [
            (r["P"], r[field]) for r in rows if r["kind"] == kind and math.isfinite(r[field]) and r[field] > 0
        ]
        if len({p for p, _ in pts}) >= 2:
            p, mem = np.log(np.array(pts, dtype=float)).T
            slopes[kind] = float(np.polyfit(p, mem, 1)[0])
    return slopes


def run_and_report(opts: SequenceParallelBenchOptions, out_dir, *, log=print) -> dict:
    """Run every case, print the table, write sequence_parallel.csv/json/png under out_dir."""
    import pathlib

    from experiments.benchmarking import report

    out_dir = pathlib.Path(out_dir)
    machine = measure.machine_description()
    log(f"machine: {machine}")
    rows = run(opts, log=log)
    slopes = {"peak": memory_slopes(rows, "peak_mib"), "temp": memory_slopes(rows, "temp_mib")}
    files = {
        "csv": report.write_csv(out_dir / "sequence_parallel.csv", rows),
        "json": report.write_json(
            out_dir / "sequence_parallel.json",
            machine=machine,
            options=dataclasses.asdict(opts),
            rows=rows,
            memory_slopes=slopes,
        ),
    }
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    memory_series, time_series = {}, {}
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        label = f"{kind} T={mine[0]['length']}"
        memory_series[f"{label} peak"] = [(r["P"], r["peak_mib"]) for r in mine]
        memory_series[f"{label} temporaries"] = [(r["P"], r["temp_mib"]) for r in mine]
        first = next((r for r in mine if r["P"] == 1 and math.isfinite(r["peak_mib"])), None)
        if first:
            memory_series[f"{label} ideal 1/P"] = [(r["P"], first["peak_mib"] / r["P"]) for r in mine]
        time_series[label] = [(r["P"], r["step_ms"]) for r in mine]
    panels = [
        {
            "xlabel": "devices P on the sequence axis",
            "ylabel": "memory per device (MiB, XLA)",
            "series": memory_series,
        },
        {
            "xlabel": "devices P on the sequence axis",
            "ylabel": "training step time (ms, median)",
            "series": time_series,
        },
    ]
    files["png"] = report.plot_series(
        out_dir / "sequence_parallel.png",
        panels,
        title=(
            f"{machine['num_devices']} {machine['device']} devices on {machine['host_cpus']} "
            f"host CPUs; CausalLM {opts.num_layers} layers, width {opts.model_dim}, "
            f"{opts.num_heads} heads, B={opts.batch}; jax {machine['jax']}"
        ),
    )
    log(
        "\n"
        + report.markdown_table(
            rows,
            [
                "kind",
                "length",
                "P",
                "tokens_per_device",
                "argument_mib",
                "output_mib",
                "temp_mib",
                "peak_mib",
                "peak_vs_p1",
                "ideal_memory",
                "step_ms",
                "step_vs_p1",
                "compile_s",
                "loss_diff_vs_p1",
                "status",
            ],
        )
    )
    log(
        "\nlog-log slope of memory per device vs P (-1 = 1/P): "
        + "; ".join(
            f"{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()) for what, s in slopes.items()
        )
    )
    log("wrote " + ", ".join(str(p) for p in files.values()))
    return {"rows": rows, "memory_slopes": slopes, "files": files}
