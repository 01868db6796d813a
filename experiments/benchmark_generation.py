"""Images/s and memory of autoregressive generation: the paper's Tables 1, 2, 4 and 5.

  python -m experiments.benchmark_generation                      # CPU defaults, a few minutes
  python -m experiments.benchmark_generation --batches=1,256,1024 --timed_steps=0 \
      --recompute_steps=16 --out_dir=benchmark_results/generation_gpu
  python -m experiments.benchmark_generation --archs=mnist --batches=16 --peers=fast-transformers

Paper architectures (configs/mnist.py, configs/cifar10.py) with untrained weights, which cost
the same as trained ones: linear/recurrent (the RNN), softmax/kv-cache (preallocated cache),
softmax/recompute (full forward per sub-pixel, the paper's baseline). The recurrent and
recompute runs are timed over their first --timed_steps (--recompute_steps) sub-pixels (each of
their steps costs the same; see generation_bench) and scaled to the whole image; the KV cache's
step grows with the filled cache, so softmax/kv-cache is always timed over the whole image.
Also prints peak memory vs generated length and the machine's matmul throughput for comparison.
`--peers=fast-transformers` times the authors' recurrent model on the MNIST architecture in the
same run and prints theirs / ours per step.
"""

from absl import app

from experiments.benchmarking import flags, generation_bench

main = flags.main(
    generation_bench.GenerationBenchOptions,
    generation_bench.run_and_report,
    out_dir="benchmark_results/generation",
)

if __name__ == "__main__":
    app.run(main)
