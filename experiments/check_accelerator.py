"""Check this machine's accelerator in one run: the op and model tests, then the quick
benchmarks, into one report (about 7 minutes on one GPU).

  python -m experiments.check_accelerator                          # tests, then benchmarks
  python -m experiments.check_accelerator --tests=tests/test_x.py::test_y   # rerun chosen tests
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

from absl import app, flags  # noqa: E402

from experiments import cli  # noqa: E402

_GROUPS = flags.DEFINE_list("groups", ["ops", "models"], "Test groups (accelerator_check.GROUPS).")
_TESTS = flags.DEFINE_list("tests", [], "Tests (files or node ids) to run instead of the groups.")
_TESTS_FROM = flags.DEFINE_string(
    "tests_from", None, "A file of tests (files or node ids), one per line, to run instead of the groups."
)
_WORKERS = flags.DEFINE_integer("workers", 0, "pytest-xdist workers (0: one per core but two, at most 14).")
_TEST_MINUTES = flags.DEFINE_float("test_minutes", 4.5, "The tests stop after this many minutes (0: none).")
_PARTS = flags.DEFINE_list(
    "bench_parts", ["attention", "train_step", "compile"], "benchmark_accelerator parts to run after them."
)
_BENCH_MINUTES = flags.DEFINE_float("bench_minutes", 2.5, "The benchmarks' limit in minutes (0: none).")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/check", "Where check.md and the logs go.")


@cli.one_line_errors
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from experiments.benchmarking import accelerator_check
    from experiments.training import mesh

    tests = list(_TESTS.value)
    if _TESTS_FROM.value:
        with open(_TESTS_FROM.value) as f:  # node ids may hold commas and spaces: a line each
            tests += [line.strip() for line in f if line.strip()]
    opts = accelerator_check.CheckOptions(
        groups=tuple(_GROUPS.value),
        tests=tuple(tests),
        workers=_WORKERS.value,
        test_minutes=_TEST_MINUTES.value,
        bench_parts=tuple(_PARTS.value),
        bench_minutes=_BENCH_MINUTES.value,
    )
    mesh.announce_backend()
    accelerator_check.run(opts, _OUT.value)


if __name__ == "__main__":
    app.run(main)
