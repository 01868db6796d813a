"""Time to the first new token: reading a prompt with one parallel `prefill` vs token by token.

Legend: B batch, T time (a prompt's tokens, an image's sub-pixels or a prefix of them), V
vocabulary.

Two workloads, each timed both ways inside one run (so the ratio compares numbers from the same
process on the same machine):

- Language model (`CausalLM`, untrained): a prompt of P tokens, then the logits of the first new
  token, leaving a state ready to continue. Both paths read exactly the P prompt tokens:
    prefill:    `prefill` over the first P - 1 tokens in one parallel pass, then one `step` over
                the last (the last prompt token enters through `step`, as in `generate`);
    step-scan:  `step` over all P tokens in one compiled `lax.scan` (the path before `prefill`).
- Image completion (the paper's MNIST architecture, untrained: the work per image does not depend
  on the weights): given the first K sub-pixels of an L-sub-pixel image, draw the other L - K:
    prefill:    `sample_images(prefix=...)` (the library reads the prefix with `prefill`);
    step-scan:  the prefix read by a `lax.scan` of `step`, then the same sampling loop as
                `sample_images` (the same key per sub-pixel, so the same images come out).

Everything is jitted with the parameters as arguments; compile time (trace + lower + compile) is
measured once per case and reported separately; times are medians of repeats after a warm-up
(`measure.time_compiled`). Each case also checks that both paths agree (largest logit difference;
fraction of identical sub-pixels).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.benchmarking import measure
from linear_transformers.lm import CausalLM
from linear_transformers.mixture import mol_sample
from linear_transformers.transformer import TransformerConfig

METHODS = ("prefill", "step-scan")
LM_KINDS = ("linear", "softmax")
IMAGE_ARCHS = ("mnist", "cifar10")


@dataclasses.dataclass(frozen=True)
class PrefillBenchOptions:
    """What `run` measures. Lengths per kind: softmax reads its whole KV cache at every step, so
    its token-by-token path grows as P^2 and stops at `softmax_lengths`."""

    prompt_lengths: tuple[int, ...] = (512, 2048, 8192)
    batches: tuple[int, ...] = (1, 4)
    kinds: tuple[str, ...] = LM_KINDS
    softmax_lengths: tuple[int, ...] = (512, 2048)  # the lengths softmax runs at (subset)
    num_layers: int = 4
    model_dim: int = 256
    num_heads: int = 8
    vocab_size: int = 256
    image_arch: str = "mnist"  # "" = no image-completion part
    image_kinds: tuple[str, ...] = ("linear", "softmax")
    image_batches: tuple[int, ...] = (1, 16)
    image_length: int | None = None  # None: the architecture's own length (MNIST: 784)
    image_layers: int | None = None  # None: the architecture's own depth (MNIST: 8); tests only
    image_prefix: int | None = None  # None: half the image
    min_repeats: int = 3
    min_seconds: float = 1.0
    memory_fraction: float = 0.6  # of free memory; a case needing more is skipped
    seed: int = 0

    def __post_init__(self):
        for kind in (*self.kinds, *self.image_kinds):
            if kind not in LM_KINDS:
                raise ValueError(f"unknown attention kind {kind!r}; expected some of {LM_KINDS}.")
        if self.image_arch and self.image_arch not in IMAGE_ARCHS:
            raise ValueError(
                f"unknown image architecture {self.image_arch!r}; expected one of "
                f"{IMAGE_ARCHS} or '' for none."
            )
        for name in ("prompt_lengths", "batches", "softmax_lengths", "image_batches"):
            values = getattr(self, name)
            if any(v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values}.")
        if not self.prompt_lengths or not self.batches:
            raise ValueError("prompt_lengths and batches must not be empty.")
        if self.image_length is not None and self.image_length < 2:
            raise ValueError(f"image_length must be >= 2, got {self.image_length}.")
        if self.image_layers is not None and self.image_layers < 1:
            raise ValueError(f"image_layers must be >= 1, got {self.image_layers}.")
        if self.image_prefix is not None and self.image_prefix < 1:
            raise ValueError(f"image_prefix must be >= 1, got {self.image_prefix}.")

    def lengths_for(self, kind: str) -> tuple[int, ...]:
        """The prompt lengths `kind` runs at."""
        if kind == "softmax":
            return tuple(p for p in self.prompt_lengths if p in self.softmax_lengths)
        return tuple(self.prompt_lengths)


def lm_model(opts: PrefillBenchOptions, kind: str) -> CausalLM:
    """The benchmark's language model in eval mode (untrained, no dropout)."""
    config = TransformerConfig(
        num_layers=opts.num_layers,
        num_heads=opts.num_heads,
        model_dim=opts.model_dim,
        attention=kind,
        dropout=0.0,
    )
    model = CausalLM(config, opts.vocab_size, rngs=nnx.Rngs(opts.seed))
    model.eval()
    return model


def first_token_fn(model, method: str):
    """(params, prompt_BT) -> (state, logits_BV of the first new token), for `method`.

    The KV cache (softmax) holds P + 1 steps: the prompt and the first new token.
    """
    graphdef, _ = nnx.split(model)

    def prefill(params, prompt_BT):
        model = nnx.merge(graphdef, params)
        batch, length = prompt_BT.shape
        state = model.init_state(batch, max_length=length + 1)
        if length > 1:
            state, _ = model.prefill(state, prompt_BT[:, :-1])
        return model.step(state, prompt_BT[:, -1])

    def step_scan(params, prompt_BT):
        model = nnx.merge(graphdef, params)
        batch, length = prompt_BT.shape
        state = model.init_state(batch, max_length=length + 1)
        state, _ = jax.lax.scan(model.step, state, prompt_BT[:, :-1].T)
        return model.step(state, prompt_BT[:, -1])

    if method == "prefill":
        return prefill
    if method == "step-scan":
        return step_scan
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}.")


def compile_timed(fn, *args):
    """(compiled, seconds to trace, lower and compile) of `jax.jit(fn)` for `args`."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def _over_budget(row: dict, compiled, budget: int) -> bool:
    peak = measure.peak_bytes(compiled)
    row["peak_mib"] = (peak or math.nan) / 2**20
    if peak is not None and peak > budget:
        row["status"] = f"skipped: needs {peak / 2**30:.1f} GiB, budget {budget / 2**30:.1f} GiB"
        return True
    return False


def run_lm(opts: PrefillBenchOptions, *, log=print) -> list[dict]:
    """One row per (kind, batch, prompt length, method): time to the first new token."""
    budget = measure.memory_budget_bytes(fraction=opts.memory_fraction)
    rows = []
    for kind in opts.kinds:
        model = lm_model(opts, kind)
        params = nnx.split(model)[1]
        for batch in opts.batches:
            for length in opts.lengths_for(kind):
                key = jax.random.fold_in(jax.random.key(opts.seed), length * 1000 + batch)
                prompt_BT = jax.random.randint(key, (batch, length), 0, opts.vocab_size)
                logits = {}
                for method in METHODS:
                    row = {
                        "kind": kind,
                        "batch": batch,
                        "prompt": length,
                        "method": method,
                        "time_ms": math.nan,
                        "compile_s": math.nan,
                        "peak_mib": math.nan,
                        "repeats": 0,
                        "status": "ok",
                    }
                    compiled, row["compile_s"] = compile_timed(
                        first_token_fn(model, method), params, prompt_BT
                    )
                    if not _over_budget(row, compiled, budget):
                        timing = measure.time_compiled(
                            compiled,
                            params,
                            prompt_BT,
                            min_repeats=opts.min_repeats,
                            min_seconds=opts.min_seconds,
                        )
                        row.update(time_ms=timing.median_s * 1e3, repeats=timing.repeats)
                        logits[method] = compiled(params, prompt_BT)[1]
                    rows.append(row)
                if len(logits) == 2:  # both paths compute the same function
                    diff = float(jnp.max(jnp.abs(logits["prefill"] - logits["step-scan"])))
                    for row in rows[-2:]:
                        row["max_logit_diff"] = diff
                for row in rows[-2:]:
                    log(format_lm_row(row))
    return rows


def format_lm_row(row: dict) -> str:
    """One log line of an LM row."""
    return (
        f"LM {row['kind']:<8} B={row['batch']:<3} P={row['prompt']:<6} {row['method']:<10} "
        f"{row['time_ms']:>10.2f} ms  compile {row['compile_s']:6.2f} s  "
        f"{row['peak_mib']:>8.1f} MiB  {row['status']}"
    )


def image_model(opts: PrefillBenchOptions, kind: str):
    """The paper's image generator for `opts.image_arch` (untrained, eval mode):
    `generation_bench.paper_model`; `image_layers` overrides the depth (quick tests)."""
    from experiments.benchmarking import generation_bench

    return generation_bench.paper_model(
        opts.image_arch, kind, max_length=opts.image_length, seed=opts.seed, num_layers=opts.image_layers
    )


def complete_token_by_token(model, key, batch: int, prefix_BT):
    """`sample_images(model, key, batch, prefix=prefix_BT)` by the path before `prefill`: the
    prefix read by a `lax.scan` of `step`, then the same sampling loop (step t draws with
    `jax.random.split(key, max_length)[t]`, as `sample_images` does). -> [B, T] int32."""
    length, k = model.max_length, prefix_BT.shape[1]
    keys = jax.random.split(key, length)
    prefix_BT = prefix_BT.astype(jnp.int32)
    # Step t reads START at t = 0, else x_{t-1}: the prefix's K steps read START, x_0 .. x_{K-2}.
    start_B1 = jnp.full((batch, 1), model.start_token, jnp.int32)
    read_BT = jnp.concatenate([start_B1, prefix_BT[:, :-1]], axis=1)
    state, _ = jax.lax.scan(model.step, model.init_state(batch), read_BT.T)

    def body(carry, key_t):
        state, token_B = carry
        state, params_BP = model.step(state, token_B)
        drawn_B = mol_sample(key_t, params_BP, model.num_classes)
        return (state, drawn_B), drawn_B

    _, drawn_TB = jax.lax.scan(body, (state, prefix_BT[:, -1]), keys[k:])
    return jnp.concatenate([prefix_BT, drawn_TB.T], axis=1)


def completion_fn(model, method: str, batch: int):
    """(params, key, prefix_BT) -> images [B, T] for `method`."""
    from linear_transformers import sample_images

    graphdef, _ = nnx.split(model)

    def prefill(params, key, prefix_BT):
        return sample_images(nnx.merge(graphdef, params), key, batch, prefix=prefix_BT)

    def step_scan(params, key, prefix_BT):
        return complete_token_by_token(nnx.merge(graphdef, params), key, batch, prefix_BT)

    if method == "prefill":
        return prefill
    if method == "step-scan":
        return step_scan
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}.")


def run_images(opts: PrefillBenchOptions, *, log=print) -> list[dict]:
    """One row per (kind, batch, method): images/s completing images from their first K."""
    if not opts.image_arch:
        return []
    budget = measure.memory_budget_bytes(fraction=opts.memory_fraction)
    rows = []
    for kind in opts.image_kinds:
        model = image_model(opts, kind)
        params = nnx.split(model)[1]
        length = model.max_length
        k = opts.image_prefix or length // 2
        if not 1 <= k < length:
            raise ValueError(f"image_prefix must be in [1, {length}), got {k}.")
        for batch in opts.image_batches:
            key = jax.random.key(opts.seed + batch)
            prefix_BT = jax.random.randint(
                jax.random.fold_in(key, 1), (batch, k), 0, model.num_classes, jnp.int32
            )
            images = {}
            for method in METHODS:
                row = {
                    "arch": opts.image_arch,
                    "kind": kind,
                    "batch": batch,
                    "length": length,
                    "prefix": k,
                    "method": method,
                    "time_ms": math.nan,
                    "images_per_s": math.nan,
                    "compile_s": math.nan,
                    "peak_mib": math.nan,
                    "repeats": 0,
                    "status": "ok",
                }
                compiled, row["compile_s"] = compile_timed(
                    completion_fn(model, method, batch), params, key, prefix_BT
                )
                if not _over_budget(row, compiled, budget):
                    timing = measure.time_compiled(
                        compiled,
                        params,
                        key,
                        prefix_BT,
                        min_repeats=opts.min_repeats,
                        min_seconds=opts.min_seconds,
                    )
                    row.update(
                        time_ms=timing.median_s * 1e3,
                        images_per_s=batch / timing.median_s,
                        repeats=timing.repeats,
                    )
                    images[method] = compiled(params, key, prefix_BT)
                rows.append(row)
            if len(images) == 2:  # same keys per sub-pixel: the same images, up to draws that
                # land within rounding of a bin edge
                same = float(jnp.mean(images["prefill"] == images["step-scan"]))
                prefix_kept = bool(jnp.all(images["prefill"][:, :k] == prefix_BT))
                for row in rows[-2:]:
                    row.update(same_subpixels=same, prefix_kept=prefix_kept)
            for row in rows[-2:]:
                row["layers"] = model.transformer.num_layers
                log(
                    f"images {row['arch']} {kind:<8} B={batch:<3} K={k}/{length} "
                    f"{row['method']:<10} {row['images_per_s']:>9.3f} images/s "
                    f"{row['time_ms']:>10.1f} ms  compile {row['compile_s']:6.2f} s  "
                    f"{row['peak_mib']:>8.1f} MiB  {row['status']}"
                )
    return rows


def speedups(rows: list[dict], group: tuple[str, ...]) -> list[dict]:
    """time(step-scan) / time(prefill) for every `group` key where both ran (same run)."""
    times = {}
    for r in rows:
        if r.get("status") == "ok" and math.isfinite(r.get("time_ms", math.nan)):
            times[(tuple(r[g] for g in group), r["method"])] = r["time_ms"]
    out = []
    for (key, method), t in times.items():
        base = times.get((key, "step-scan"))
        if method == "prefill" and base:
            out.append(
                {
                    **dict(zip(group, key)),
                    "prefill_ms": t,
                    "step_scan_ms": base,
                    "step_scan_over_prefill": base / t,
                }
            )
    return out


LM_GROUP = ("kind", "batch", "prompt")
IMAGE_GROUP = ("arch", "kind", "batch")


def run_and_report(opts: PrefillBenchOptions, out_dir, *, log=print) -> dict:
    """Run both parts, print the tables, write prefill*.csv/json and prefill.png under out_dir."""
    import pathlib

    from experiments.benchmarking import report

    out_dir = pathlib.Path(out_dir)
    machine = measure.machine_description()
    log(f"machine: {machine}")
    lm_rows = run_lm(opts, log=log)
    image_rows = run_images(opts, log=log)
    lm_ratios = speedups(lm_rows, LM_GROUP)
    image_ratios = speedups(image_rows, IMAGE_GROUP)
    files = {
        "csv": report.write_csv(out_dir / "prefill.csv", lm_rows),
        "json": report.write_json(
            out_dir / "prefill.json",
            machine=machine,
            options=dataclasses.asdict(opts),
            rows=lm_rows,
            ratios=lm_ratios,
            images=image_rows,
            image_ratios=image_ratios,
        ),
    }
    if image_rows:
        files["images_csv"] = report.write_csv(out_dir / "prefill_images.csv", image_rows)
    series = {}
    for r in lm_rows:
        series.setdefault(f"{r['kind']} B={r['batch']} {r['method']}", []).append((r["prompt"], r["time_ms"]))
    ratio_series = {}
    for r in lm_ratios:
        ratio_series.setdefault(f"{r['kind']} B={r['batch']}", []).append(
            (r["prompt"], r["step_scan_over_prefill"])
        )
    panels = [
        {"xlabel": "prompt length P (tokens)", "ylabel": "time to first new token (ms)", "series": series},
        {
            "xlabel": "prompt length P (tokens)",
            "ylabel": "step-scan time / prefill time",
            "series": ratio_series,
        },
    ]
    files["png"] = report.plot_series(
        out_dir / "prefill.png",
        panels,
        title=(
            f"{machine['device']} x{machine['host_cpus']} CPUs, float32, CausalLM "
            f"{opts.num_layers} layers, width {opts.model_dim}, {opts.num_heads} heads "
            f"(untrained); jax {machine['jax']}"
        ),
    )
    log(
        "\n"
        + report.markdown_table(
            lm_rows,
            [
                c
                for c in (
                    "kind",
                    "batch",
                    "prompt",
                    "method",
                    "time_ms",
                    "compile_s",
                    "peak_mib",
                    "max_logit_diff",
                    "status",
                )
                if any(c in r for r in lm_rows)
            ],
        )
    )
    if lm_ratios:
        log("\nstep-scan / prefill (same run):\n" + report.markdown_table(lm_ratios, list(lm_ratios[0])))
    if image_rows:
        log(
            "\n"
            + report.markdown_table(
                image_rows,
                [
                    c
                    for c in (
                        "arch",
                        "kind",
                        "batch",
                        "prefix",
                        "length",
                        "method",
                        "images_per_s",
                        "time_ms",
                        "compile_s",
                        "peak_mib",
                        "same_subpixels",
                        "prefix_kept",
                        "status",
                    )
                    if any(c in r for r in image_rows)
                ],
            )
        )
    if image_ratios:
        log(
            "\nimage completion, step-scan / prefill (same run):\n"
            + report.markdown_table(image_ratios, list(image_ratios[0]))
        )
    log("wrote " + ", ".join(str(p) for p in files.values()))
    return {
        "lm": lm_rows,
        "lm_ratios": lm_ratios,
        "images": image_rows,
        "image_ratios": image_ratios,
        "files": files,
    }
