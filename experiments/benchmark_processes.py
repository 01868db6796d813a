"""One training run as two processes against one process on this machine: step time.

  python -m experiments.benchmark_processes                     # digits, 300 steps per setup (~3 min)
  python -m experiments.benchmark_processes --setups=1x4,2x2 --num_steps=100

A setup PxD is P trainer processes (`--config.distributed=True`, a loopback coordinator) of D
CPU host devices each; every setup trains the same config with data parallelism over all its
devices. Step time: the median over log windows (the first, holding the compile, left out) of
the trainer's own steps_per_sec. On one CPU the processes share its cores and exchange
gradients over loopback (Gloo): the figure shows that cost, not a cluster's.
"""

from absl import app

from experiments.benchmarking import flags, processes_bench

main = flags.main(
    processes_bench.ProcessesBenchOptions,
    processes_bench.run_and_report,
    out_dir="benchmark_results/processes",
    device=False,
    announce=False,
)

if __name__ == "__main__":
    app.run(main)
