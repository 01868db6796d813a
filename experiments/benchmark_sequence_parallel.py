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

import re
import sys

from experiments import HOST_DEVICE_COUNT, default_xla_flag


def _host_devices_wanted(argv) -> int:
    """max(--parallelism) from the command line (read before absl parses it), at least 8."""
    wanted = [8]
    for value in re.findall(r"(?:^| )--parallelism(?:=| +)(\S+)", " ".join(argv)):
        try:
            wanted += [int(p) for p in value.split(",") if p]
        except ValueError:
            pass  # absl reports the bad flag value
    return max(wanted)


# Before anything imports jax: the host platform's device count is fixed when jax starts.
default_xla_flag(f"{HOST_DEVICE_COUNT}={_host_devices_wanted(sys.argv)}")

from absl import app  # noqa: E402  (after XLA_FLAGS on purpose)

from experiments.benchmarking import flags, sequence_parallel_bench  # noqa: E402

main = flags.main(
    sequence_parallel_bench.SequenceParallelBenchOptions,
    sequence_parallel_bench.run_and_report,
    out_dir="benchmark_results/sequence_parallel",
)

if __name__ == "__main__":
    app.run(main)
