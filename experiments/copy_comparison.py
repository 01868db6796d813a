"""Copy-task comparison of attention kinds (paper section 4.1, Figure 2): table and curves.

  python -m experiments.copy_comparison                       # the paper's 9 runs, `cpu` size
  python -m experiments.copy_comparison --runs=decoder/softmax,decoder/linear --size=cpu \
      --overrides=num_steps=500 --out_dir=benchmark_results/copy_quick
  python -m experiments.copy_comparison \
      --runs=decoder/linear,decoder/softmax,decoder/retention,decoder/simple-gla,decoder/gla
  python -m experiments.copy_comparison --runs=decoder/varlen-packed,decoder/varlen-padded

The varlen pair trains on the same examples packed and one per row; tokens_per_sec counts real
(non-padding) tokens. Writes copy_results.csv/.json, copy_curves.csv and copy_convergence.png
to --out_dir and prints a markdown table. Finished runs in --out_dir are resumed (a no-op), not
retrained.
"""

from absl import app, flags, logging

from experiments.benchmarking.copy_bench import PAPER_RUNS, RUNS, CopyComparisonOptions, run_and_report
from experiments.cli import one_line_errors

_RUNS = flags.DEFINE_list("runs", list(PAPER_RUNS), f"Runs, from: {', '.join(RUNS)}; default: the paper's.")
_SIZE = flags.DEFINE_string("size", "cpu", "Copy-task variants setting the scale (as in configs/copy.py:).")
_OVERRIDES = flags.DEFINE_string("overrides", "", "key=value,... applied to every run last.")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/copy", "Where runs and reports go.")


@one_line_errors
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    run_and_report(
        CopyComparisonOptions(
            runs=tuple(_RUNS.value), size=_SIZE.value, overrides=_OVERRIDES.value, out_dir=_OUT.value
        )
    )


if __name__ == "__main__":
    app.run(main)
