"""Every GPU measurement BENCHMARKS.md asks for, in one run, into one report (at most ~9 minutes).

  python -m experiments.benchmark_accelerator                        # on the GPU: everything
  python -m experiments.benchmark_accelerator --parts=attention,generation --max_minutes=5
  python -m experiments.benchmark_accelerator --parts=kernel --part_seconds=330  # + launch sweep
  python -m experiments.benchmark_accelerator --sizes=tiny --device=cpu   # smoke run, seconds

Parts, in this order (each by the benchmark module that measures it on the CPU; see
experiments/benchmarking/accelerator_bench.py): kernel (the Pallas kernel vs XLA's chunked form,
cuDNN and a copy of its bytes), attention (chunked causal linear vs cuDNN flash
and XLA softmax, bf16, B=8, N=16k/64k), generation (MNIST architecture, recurrent vs KV cache,
bf16, batch 1/256/1024), train_step (bf16 and float32 steps of the paper's MNIST model),
compile (that step's first call at 2, 8 and 16 layers), chunk_size (C=32..256, float32 and
bf16), prefill, gated. Each part has a time budget; a part
that fails or runs out of time is recorded with the reason and the next one runs. Writes
<out_dir>/accelerator.md (device, versions, host, targets met/missed, every table) and
<out_dir>/accelerator.csv, rewritten after every case. The accelerator sizes refuse to run on a
CPU (they would take hours there): use --sizes=tiny.
"""

from absl import app

from experiments.benchmarking import accelerator_bench, flags

main = flags.main(
    accelerator_bench.AcceleratorBenchOptions,
    accelerator_bench.run_and_report,
    out_dir="benchmark_results/accelerator",
)

if __name__ == "__main__":
    app.run(main)
