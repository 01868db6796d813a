"""One training run as two processes against one process on this machine: step time.

  python -m experiments.benchmark_processes                     # digits, 300 steps per setup (~3 min)
  python -m experiments.benchmark_processes --setups=1x4,2x2 --num_steps=100

A setup PxD is P trainer processes (`--config.distributed=True`, a loopback coordinator) of D
CPU host devices each; every setup trains the same config with data parallelism over all its
devices. Step time: the median over log windows (the first, holding the compile, left out) of
the trainer's own steps_per_sec. On one CPU the processes share its cores and exchange
gradients over loopback (Gloo): the figure shows that cost, not a cluster's.
"""

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "configs/digits.py", "The config file each setup trains.")
_STEPS = flags.DEFINE_integer("num_steps", 300, "Steps per setup.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 25, "Steps per log window (one timing each).")
_SETUPS = flags.DEFINE_list("setups", ["1x4", "2x2", "1x2"], "PROCESSESxDEVICES, first = the reference.")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/processes", "Where CSV/JSON go.")


def main(argv):
    del argv
    from experiments.benchmarking import processes_bench

    setups = []
    for text in _SETUPS.value:
        count, _, devices = text.partition("x")
        if not (count.isdigit() and devices.isdigit() and int(count) >= 1 and int(devices) >= 1):
            raise app.UsageError(f"--setups takes PROCESSESxDEVICES like 2x2, got {text!r}.")
        setups.append(processes_bench.Setup(int(count), int(devices)))
    opts = processes_bench.ProcessesBenchOptions(
        config=_CONFIG.value, num_steps=_STEPS.value, log_every=_LOG_EVERY.value, setups=tuple(setups)
    )
    processes_bench.run_and_report(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
