"""Check this machine's accelerator in one run: the op and model tests, then the quick
benchmarks, into one report (about 7 minutes on one GPU).

  python -m experiments.check_accelerator                          # tests, then benchmarks
  python -m experiments.check_accelerator --tests=tests/ops/test_x.py::test_y   # rerun chosen tests
  python -m experiments.check_accelerator --tests_from=unfinished.txt        # node ids, a line each
  python -m experiments.check_accelerator --test_minutes=0         # benchmarks only

The tests run in pytest workers that share the device (GPU memory preallocation off); each
test's outcome is written as it ends, so a run stopped by --test_minutes still reports what
finished. Writes <out_dir>/check.md (device, pass/fail counts, every failure's assertion, the
slowest tests, the benchmark tables), accelerator.md/.csv, tests.log and test_results.jsonl
(experiments/benchmarking/accelerator_check.py). On a CPU the benchmarks run at tiny sizes.
"""

import os

# Before JAX starts: this process and the test workers share the accelerator's memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from absl import app  # noqa: E402

from experiments.benchmarking import accelerator_check, flags  # noqa: E402

main = flags.main(
    accelerator_check.CheckOptions, accelerator_check.run, out_dir="benchmark_results/check", device=False
)

if __name__ == "__main__":
    app.run(main)
