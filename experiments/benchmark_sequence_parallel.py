"""Memory per device and step time of a sequence-parallel training step, for P = 1, 2, 4, 8.

  python -m experiments.benchmark_sequence_parallel                 # CPU defaults, a few minutes
  python -m experiments.benchmark_sequence_parallel --length=65536 --parallelism=1,2,4,8,16 \
      --out_dir=benchmark_results/sequence_parallel_big

One process. On CPU the devices are host devices: this script sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 (max(--parallelism) if larger) before jax is
imported, unless XLA_FLAGS already sets a device count. A CausalLM (--num_layers x --model_dim,
--num_heads heads, untrained) takes full training steps (loss, gradients, Adam update, jitted) on
[--batch, T] tokens split over a "sequence" mesh of the first P devices; memory per device is XLA's
figure for the compiled program, step times are medians (compile excluded, reported separately).
The 8 CPU "devices" share the host's cores, so the step time shows no speed-up there.
"""

import os
import sys

_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _host_devices_wanted(argv) -> int:
    """max(--parallelism) from the command line (read before absl parses it), at least 8."""
    wanted = 8
    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--parallelism="):
            value = arg.split("=", 1)[1]
        elif arg == "--parallelism" and i + 1 < len(argv):
            value = argv[i + 1]
        if value:
            try:
                wanted = max(wanted, *(int(p) for p in value.split(",") if p))
            except ValueError:
                pass  # absl reports the bad flag value
    return wanted


# Before anything imports jax: the host platform's device count is fixed when jax starts.
if _COUNT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" {_COUNT_FLAG}={_host_devices_wanted(sys.argv)}"
    ).strip()

from absl import app, flags  # noqa: E402  (after XLA_FLAGS on purpose)

_PARALLELISM = flags.DEFINE_list("parallelism", ["1", "2", "4", "8"], "Devices P on the axis.")
_LENGTH = flags.DEFINE_integer("length", 32768, "Sequence length T (linear).")
_SOFTMAX_LENGTH = flags.DEFINE_integer("softmax_length", 8192, "Sequence length T for softmax.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch B.")
_KINDS = flags.DEFINE_list("kinds", ["linear", "softmax"], "Attention kinds: linear, softmax.")
_LAYERS = flags.DEFINE_integer("num_layers", 2, "Layers.")
_WIDTH = flags.DEFINE_integer("model_dim", 64, "Model width.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Heads.")
_VOCAB = flags.DEFINE_integer("vocab_size", 256, "Vocabulary.")
_MIN_SECONDS = flags.DEFINE_float("min_seconds", 1.0, "Repeat each case for at least this long.")
_DEVICE = flags.DEFINE_enum("device", None, ["cpu", "gpu", "tpu"], "Backend (default: JAX's).")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/sequence_parallel", "Where CSV/JSON/PNG go.")


def main(argv):
    del argv
    import jax

    if _DEVICE.value:
        jax.config.update("jax_platforms", _DEVICE.value)

    from experiments.training import mesh

    mesh.announce_backend()

    from experiments.benchmarking import sequence_parallel_bench

    opts = sequence_parallel_bench.SequenceParallelBenchOptions(
        parallelism=tuple(int(p) for p in _PARALLELISM.value),
        length=_LENGTH.value,
        softmax_length=_SOFTMAX_LENGTH.value,
        batch=_BATCH.value,
        kinds=tuple(_KINDS.value),
        num_layers=_LAYERS.value,
        model_dim=_WIDTH.value,
        num_heads=_HEADS.value,
        vocab_size=_VOCAB.value,
        min_seconds=_MIN_SECONDS.value,
    )
    sequence_parallel_bench.run_and_report(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
