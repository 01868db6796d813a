"""What a decay costs: gated linear attention with each shape of log decay vs plain causal linear.

  python -m experiments.benchmark_gated                       # CPU defaults, N = 4096 and 16384
  python -m experiments.benchmark_gated --dtype=bfloat16 --lengths=4096,16384,65536 --out_dir=bench/gpu
  python -m experiments.benchmark_gated --decays=step,feature --impls=chunked --chunk_size=32

Cases: causal-linear/chunked (`ops.causal_linear_attention`, the baseline) and
gated-{none,head,step,feature}/{chunked,reference} (`ops.gated_linear_attention` with no decay,
a decay per head [H], per head and step [B, N, H], or per key feature and step [B, N, H, D];
"reference" is the dense form, run where it fits in memory). Forward and forward+backward
(gradients of q, k, v and the log decay), median of repeats, compile excluded; every time is also
given over the baseline's in the same run, against the goal that a decay costs at most 1.3x plain
causal linear forward+backward. And the delta rule (`ops.delta_rule_attention`) in its
chunked form and its scan for decays none, step and feature (--delta_decays, --delta_impls),
against the goals chunked >= 5x faster than the scan and <= 2.5x the gated chunked form.
"""

from absl import app

from experiments.benchmarking import flags, gated_bench

main = flags.main(
    gated_bench.GatedBenchOptions, gated_bench.run_and_report, out_dir="benchmark_results/gated"
)

if __name__ == "__main__":
    app.run(main)
