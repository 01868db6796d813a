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

from absl import app, flags

_ARCHS = flags.DEFINE_list("archs", ["mnist", "cifar10"], "mnist (784 steps), cifar10 (3072).")
_METHODS = flags.DEFINE_list(
    "methods",
    ["linear/recurrent", "softmax/kv-cache", "softmax/recompute"],
    "linear/recurrent, softmax/kv-cache, softmax/recompute, linear/recompute.",
)
_BATCHES = flags.DEFINE_list("batches", ["1", "16"], "Batch sizes.")
_TIMED = flags.DEFINE_integer(
    "timed_steps", 128, "Sub-pixels timed per image (0: all); softmax/kv-cache is always timed whole."
)
_RECOMPUTE = flags.DEFINE_integer("recompute_steps", 1, "Sub-pixels timed for recompute methods.")
_MEM_LENGTHS = flags.DEFINE_list(
    "memory_lengths",
    ["256", "1024", "4096", "16384", "65536"],
    "Generated lengths for the memory table (compile only).",
)
_MIN_SECONDS = flags.DEFINE_float("min_seconds", 1.0, "Repeat each case for at least this long.")
_MIN_REPEATS = flags.DEFINE_integer(
    "min_repeats", 3, "Time each case at least this often (a CIFAR-10 image with a KV cache: minutes)."
)
_DEVICE = flags.DEFINE_enum("device", None, ["cpu", "gpu", "tpu"], "Backend (default: JAX's).")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/generation", "Where CSV/JSON/PNG go.")
_PEERS = flags.DEFINE_list(
    "peers",
    [],
    "Also time these libraries on the MNIST architecture, in "
    "this run: fast-transformers (the authors'; needs torch and "
    "pytorch-fast-transformers importable).",
)


def main(argv):
    del argv
    import jax

    if _DEVICE.value:
        jax.config.update("jax_platforms", _DEVICE.value)

    from experiments.training import mesh

    mesh.announce_backend()

    from experiments.benchmarking import generation_bench

    opts = generation_bench.GenerationBenchOptions(
        archs=tuple(_ARCHS.value),
        methods=tuple(_METHODS.value),
        batches=tuple(int(b) for b in _BATCHES.value),
        timed_steps=_TIMED.value,
        recompute_steps=_RECOMPUTE.value,
        memory_lengths=tuple(int(n) for n in _MEM_LENGTHS.value),
        min_seconds=_MIN_SECONDS.value,
        min_repeats=_MIN_REPEATS.value,
        peers=tuple(_PEERS.value),
    )
    generation_bench.run_and_report(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
