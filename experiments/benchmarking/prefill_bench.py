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
import functools
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.benchmarking import measure, report
from linear_transformers.lm import CausalLM
from linear_transformers.mixture import mol_sample
from linear_transformers.transformer import TransformerConfig

# Every kind with a recurrent form; the default run compares the paper's two.
LM_KINDS = ("linear", "softmax", "causal-linear", "retention", "simple-gla", "gla")
IMAGE_ARCHS = ("mnist", "cifar10")


@dataclasses.dataclass(frozen=True)
class PrefillBenchOptions(measure.CaseOptions):
    """What `run` measures. Lengths per kind: softmax reads its whole KV cache at every step, so
    its token-by-token path grows as P^2 and stops at `softmax_lengths`.

    prompt_lengths: Prompt lengths P.
    batches: Batch sizes of the language-model part.
    kinds: Attention kinds: linear, softmax, causal-linear, retention, simple-gla, gla.
    softmax_lengths: Prompt lengths softmax runs at (its token-by-token path costs P^2: a KV
        cache read per step).
    num_layers: Layers of the language model.
    model_dim: Width of the language model.
    num_heads: Heads of the language model.
    vocab_size: Vocabulary of the language model.
    image_arch: Paper architecture for image completion (mnist, cifar10; '' to skip).
    image_kinds: Kinds for images.
    image_batches: Batch sizes for images.
    image_length: Sub-pixels per image (default: the architecture's).
    image_layers: Layers of the image model (default: the architecture's; fewer only for quick
        tests).
    image_prefix: Given sub-pixels (default: half).
    """

    prompt_lengths: tuple[int, ...] = (512, 2048, 8192)
    batches: tuple[int, ...] = (1, 4)
    kinds: tuple[str, ...] = ("linear", "softmax")
    softmax_lengths: tuple[int, ...] = (512, 2048)
    num_layers: int = 4
    model_dim: int = 256
    num_heads: int = 8
    vocab_size: int = 256
    image_arch: str = "mnist"
    image_kinds: tuple[str, ...] = ("linear", "softmax")
    image_batches: tuple[int, ...] = (1, 16)
    image_length: int | None = None
    image_layers: int | None = None
    image_prefix: int | None = None
    min_seconds: float = 1.0

    def __post_init__(self):
        measure.check_known("attention kind", (*self.kinds, *self.image_kinds), LM_KINDS)
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


def lm_model(opts, kind: str, **config) -> CausalLM:
    """The benchmark's language model (`opts`' shape, untrained, no dropout, eval mode)."""
    model_config = TransformerConfig(
        num_layers=opts.num_layers,
        num_heads=opts.num_heads,
        model_dim=opts.model_dim,
        attention=kind,
        dropout=0.0,
        **config,
    )
    model = CausalLM(model_config, opts.vocab_size, rngs=nnx.Rngs(opts.seed))
    model.eval()
    return model


def first_token_fns(model) -> dict:
    """{method: (params, prompt_BT) -> (state, logits_BV of the first new token)}: the prompt but
    its last token read by one `prefill`, or by `step` in a `lax.scan`; the last one by `step`.

    The KV cache (softmax) holds P + 1 steps: the prompt and the first new token.
    """
    graphdef, _ = nnx.split(model)

    def first_token(read, params, prompt_BT):
        model = nnx.merge(graphdef, params)
        batch, length = prompt_BT.shape
        state = model.init_state(batch, max_length=length + 1)
        if length > 1:
            state = read(model, state, prompt_BT[:, :-1])
        return model.step(state, prompt_BT[:, -1])

    return {
        "prefill": functools.partial(
            first_token, lambda model, state, read_BT: model.prefill(state, read_BT)[0]
        ),
        "step-scan": functools.partial(
            first_token, lambda model, state, read_BT: jax.lax.scan(model.step, state, read_BT.T)[0]
        ),
    }


def compile_timed(fn, *args):
    """(compiled, seconds to trace, lower and compile) of `jax.jit(fn)` for `args`."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def time_methods(opts: PrefillBenchOptions, head: dict, figures, fns: dict, args: tuple, budget: int):
    """(a row per method: `head`, its `figures`, compile_s, peak_mib, time_ms unless over the
    budget; {method: its output} of those that ran) for `fns` (method -> function of `args`)."""
    rows, outputs = [], {}
    for method, fn in fns.items():
        row = {**head, "method": method, **dict.fromkeys(figures, math.nan), "repeats": 0, "status": "ok"}
        compiled, row["compile_s"] = compile_timed(fn, *args)
        timing = measure.fit_and_time(row, compiled, lambda: args, budget, opts)
        if timing:
            row["time_ms"] = timing.median_s * 1e3
            if "images_per_s" in row:
                row["images_per_s"] = head["batch"] / timing.median_s
            outputs[method] = compiled(*args)
        rows.append(row)
    return rows, outputs


def run_lm(opts: PrefillBenchOptions, *, log=print) -> list[dict]:
    """One row per (kind, batch, prompt length, method): time to the first new token."""
    budget = opts.budget_bytes()
    rows = []
    for kind in opts.kinds:
        model = lm_model(opts, kind)
        params = nnx.split(model)[1]
        fns = first_token_fns(model)
        for batch in opts.batches:
            for length in opts.lengths_for(kind):
                key = jax.random.fold_in(jax.random.key(opts.seed), length * 1000 + batch)
                prompt_BT = jax.random.randint(key, (batch, length), 0, opts.vocab_size)
                head = {"kind": kind, "batch": batch, "prompt": length}
                found, out = time_methods(
                    opts, head, ("time_ms", "compile_s", "peak_mib"), fns, (params, prompt_BT), budget
                )
                if len(out) == 2:  # both paths compute the same function
                    diff = float(jnp.max(jnp.abs(out["prefill"][1] - out["step-scan"][1])))
                    for row in found:
                        row["max_logit_diff"] = diff
                rows += found
                for row in found:
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


def completion_fns(model, batch: int) -> dict:
    """{method: (params, key, prefix_BT) -> images [B, T]}: `sample_images(prefix=...)`, or
    `complete_token_by_token`."""
    from linear_transformers import sample_images

    graphdef, _ = nnx.split(model)
    return {
        "prefill": lambda params, key, prefix_BT: sample_images(
            nnx.merge(graphdef, params), key, batch, prefix=prefix_BT
        ),
        "step-scan": lambda params, key, prefix_BT: complete_token_by_token(
            nnx.merge(graphdef, params), key, batch, prefix_BT
        ),
    }


def run_images(opts: PrefillBenchOptions, *, log=print) -> list[dict]:
    """One row per (kind, batch, method): images/s completing images from their first K."""
    if not opts.image_arch:
        return []
    budget = opts.budget_bytes()
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
            head = {"arch": opts.image_arch, "kind": kind, "batch": batch, "length": length, "prefix": k}
            fns = completion_fns(model, batch)
            figures = ("time_ms", "images_per_s", "compile_s", "peak_mib")
            found, images = time_methods(opts, head, figures, fns, (params, key, prefix_BT), budget)
            for row in found:
                if len(images) == 2:  # same keys per sub-pixel: the same images, up to draws that
                    # land within rounding of a bin edge
                    same = float(jnp.mean(images["prefill"] == images["step-scan"]))
                    row.update(
                        same_subpixels=same, prefix_kept=bool(jnp.all(images["prefill"][:, :k] == prefix_BT))
                    )
                row["layers"] = model.transformer.num_layers
                log(
                    f"images {row['arch']} {kind:<8} B={batch:<3} K={k}/{length} "
                    f"{row['method']:<10} {row['images_per_s']:>9.3f} images/s "
                    f"{row['time_ms']:>10.1f} ms  compile {row['compile_s']:6.2f} s  "
                    f"{row['peak_mib']:>8.1f} MiB  {row['status']}"
                )
            rows += found
    return rows


def speedups(rows: list[dict], group: tuple[str, ...]) -> list[dict]:
    """time(step-scan) / time(prefill) for every `group` key where both ran (same run)."""
    return [
        {
            **{g: r[g] for g in group},
            "prefill_ms": r["time_ms"],
            "step_scan_ms": b["time_ms"],
            "step_scan_over_prefill": b["time_ms"] / r["time_ms"],
        }
        for r, b in report.paired(rows, group, "method", "step-scan", "time_ms")
    ]


LM_GROUP = ("kind", "batch", "prompt")
IMAGE_GROUP = ("arch", "kind", "batch")


def run(opts: PrefillBenchOptions, *, log=print) -> tuple[list[dict], list[dict]]:
    return run_lm(opts, log=log), run_images(opts, log=log)


def summarize(opts: PrefillBenchOptions, ran: tuple[list[dict], list[dict]], machine: dict) -> report.Report:
    lm_rows, image_rows = ran
    lm_ratios, image_ratios = speedups(lm_rows, LM_GROUP), speedups(image_rows, IMAGE_GROUP)
    series = report.series(
        lm_rows, "prompt", "time_ms", lambda r: f"{r['kind']} B={r['batch']} {r['method']}"
    )
    ratio_series = report.series(
        lm_ratios, "prompt", "step_scan_over_prefill", lambda r: f"{r['kind']} B={r['batch']}"
    )
    image_columns = (
        "arch kind batch prefix length method images_per_s time_ms compile_s peak_mib same_subpixels "
    )
    return report.Report(
        lm_rows,
        "kind batch prompt method time_ms compile_s peak_mib max_logit_diff status".split(),
        tables=[
            report.Table(lm_ratios, "step-scan / prefill (same run)"),
            report.Table(image_rows, columns=(image_columns + "prefix_kept status").split(), csv="images"),
            report.Table(image_ratios, "image completion, step-scan / prefill (same run)"),
        ],
        extra={"ratios": lm_ratios, "images": image_rows, "image_ratios": image_ratios},
        panels=report.panels(
            "prompt length P (tokens)",
            {"time to first new token (ms)": series, "step-scan time / prefill time": ratio_series},
        ),
        title=(
            f"{machine['device']} x{machine['host_cpus']} CPUs, float32, CausalLM "
            f"{opts.num_layers} layers, width {opts.model_dim}, {opts.num_heads} heads "
            f"(untrained); jax {machine['jax']}"
        ),
    )


def run_and_report(opts: PrefillBenchOptions, out_dir, *, log=print) -> dict:
    """Run both parts, print the tables, write prefill.csv/json/png (and prefill_images.csv)."""
    return report.run_and_report("prefill", opts, out_dir, run, summarize, log=log)
