"""Every GPU measurement BENCHMARKS.md asks for, in one run, into one report (at most ~9 minutes).

  python -m experiments.benchmark_accelerator                        # on the GPU: everything
  python -m experiments.benchmark_accelerator --parts=attention,generation --max_minutes=5
  python -m experiments.benchmark_accelerator --sizes=tiny --device=cpu   # smoke run, seconds

Parts, in this order (each by the benchmark module that measures it on the CPU; see
experiments/benchmarking/accelerator_bench.py): attention (chunked causal linear vs cuDNN flash
and XLA softmax, bf16, B=8, N=16k/64k), generation (MNIST architecture, recurrent vs KV cache,
bf16, batch 1/256/1024), train_step (bf16 and float32 steps of the paper's MNIST model),
compile (that step's first call at 2, 8 and 16 layers), chunk_size (C=32..256, float32 and
bf16), prefill, gated. Each part has a time budget; a part
that fails or runs out of time is recorded with the reason and the next one runs. Writes
<out_dir>/accelerator.md (device, versions, host, targets met/missed, every table) and
<out_dir>/accelerator.csv, rewritten after every case. The accelerator sizes refuse to run on a
CPU (they would take hours there): use --sizes=tiny.
"""

from absl import app, flags

from experiments import cli

_SIZES = flags.DEFINE_enum(
    "sizes",
    "accelerator",
    ["accelerator", "check", "tiny"],
    "accelerator: the GPU section's sizes; check: the part of them experiments.check_accelerator "
    "runs; tiny: seconds, any device.",
)
_PARTS = flags.DEFINE_list(
    "parts",
    ["attention", "generation", "train_step", "compile", "chunk_size", "prefill", "gated"],
    "Parts to run (the others are listed as not selected).",
)
_MAX_MINUTES = flags.DEFINE_float(
    "max_minutes", 8.5, "Parts not started within this many minutes are skipped (a case in flight finishes)."
)
_DEVICE = flags.DEFINE_enum("device", None, ["cpu", "gpu", "tpu"], "Backend (default: JAX's).")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/accelerator", "Where accelerator.md/.csv go.")


@cli.one_line_errors
def main(argv):
    del argv
    import jax

    if _DEVICE.value:
        jax.config.update("jax_platforms", _DEVICE.value)

    from experiments.training import mesh

    mesh.announce_backend()

    from experiments.benchmarking import accelerator_bench

    opts = accelerator_bench.AcceleratorBenchOptions(
        sizes=_SIZES.value, parts=tuple(_PARTS.value), max_minutes=_MAX_MINUTES.value
    )
    accelerator_bench.run_and_report(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
