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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from experiments.benchmarking import measure, prefill_bench, report

AXIS = "sequence"
KINDS = ("linear", "softmax")


@dataclasses.dataclass(frozen=True)
class SequenceParallelBenchOptions(measure.CaseOptions):
    """What `run` measures: every kind at every P, linear at `length`, softmax at
    `softmax_length` (its [T/P, T] score blocks make long sequences expensive).

    parallelism: Devices P on the axis.
    length: Sequence length T (linear).
    softmax_length: Sequence length T for softmax.
    batch: Batch B.
    kinds: Attention kinds: linear, softmax.
    num_layers: Layers.
    model_dim: Model width.
    num_heads: Heads.
    vocab_size: Vocabulary.
    learning_rate: Adam's learning rate.
    memory_fraction: Fraction of free host memory, for all P devices together.
    """

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
    min_seconds: float = 1.0

    def __post_init__(self):
        measure.check_known("attention kind", self.kinds, KINDS)
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
    figures = "argument_mib output_mib temp_mib alias_mib peak_mib step_ms compile_s loss".split()
    head = {"kind": kind, "P": num_devices, "length": length, "batch": opts.batch}
    row = {**head, "tokens_per_device": length // num_devices, **dict.fromkeys(figures, math.nan)}
    row.update(repeats=0, status="ok")
    mesh = sequence_mesh(num_devices)
    # Sequence-parallel when P > 1; the same seed, the same weights for every P.
    model = prefill_bench.lm_model(opts, kind, **({"sequence_axis": AXIS} if num_devices > 1 else {}))
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
        compiled, row["compile_s"] = prefill_bench.compile_timed(make_train_step(graphdef, tx), *args)
        analysis = compiled.memory_analysis()
        if analysis is not None:
            for field in ("argument", "output", "temp", "alias"):
                row[f"{field}_mib"] = getattr(analysis, f"{field}_size_in_bytes") / 2**20
        # All P devices live in this one process.
        timing = measure.fit_and_time(row, compiled, lambda: args, budget, opts, devices=num_devices)
        if timing:
            row.update(step_ms=timing.median_s * 1e3, loss=float(compiled(*args)[2]))
    return row


def run(opts: SequenceParallelBenchOptions, *, log=print) -> list[dict]:
    """Every (kind, P) case; returns one row per case, with ratios to P = 1 of the same kind."""
    needed = max(opts.parallelism)
    if needed > jax.device_count():
        sequence_mesh(needed)  # raises the explanatory error
    budget = opts.budget_bytes()
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
    return report.log_log_slopes(rows, "P", field)


def summarize(opts: SequenceParallelBenchOptions, rows: list[dict], machine: dict) -> report.Report:
    slopes = {"peak": memory_slopes(rows, "peak_mib"), "temp": memory_slopes(rows, "temp_mib")}
    memory_series, time_series = {}, {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        label = f"{kind} T={mine[0]['length']}"
        memory_series[f"{label} peak"] = [(r["P"], r["peak_mib"]) for r in mine]
        memory_series[f"{label} temporaries"] = [(r["P"], r["temp_mib"]) for r in mine]
        first = next((r for r in mine if r["P"] == 1 and math.isfinite(r["peak_mib"])), None)
        if first:
            memory_series[f"{label} ideal 1/P"] = [(r["P"], first["peak_mib"] / r["P"]) for r in mine]
        time_series[label] = [(r["P"], r["step_ms"]) for r in mine]
    slope_text = "; ".join(
        f"{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()) for what, s in slopes.items()
    )
    columns = (
        "kind length P tokens_per_device argument_mib output_mib temp_mib peak_mib peak_vs_p1 ideal_memory "
        "step_ms step_vs_p1 compile_s loss_diff_vs_p1 status"
    )
    return report.Report(
        rows,
        columns.split(),
        extra={"memory_slopes": slopes},
        panels=report.panels(
            "devices P on the sequence axis",
            {"memory per device (MiB, XLA)": memory_series, "training step time (ms, median)": time_series},
        ),
        title=(
            f"{machine['num_devices']} {machine['device']} devices on {machine['host_cpus']} "
            f"host CPUs; CausalLM {opts.num_layers} layers, width {opts.model_dim}, "
            f"{opts.num_heads} heads, B={opts.batch}; jax {machine['jax']}"
        ),
        notes=[f"\nlog-log slope of memory per device vs P (-1 = 1/P): {slope_text}"],
    )


def run_and_report(opts: SequenceParallelBenchOptions, out_dir, *, log=print) -> dict:
    """Run every case, print the table, write sequence_parallel.csv/json/png under out_dir."""
    return report.run_and_report("sequence_parallel", opts, out_dir, run, summarize, log=log)
