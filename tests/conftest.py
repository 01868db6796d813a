"""Shared fixtures: `x64` turns on float64 for one test; `float32_products` pins float32 matrix
products for a test that asserts float32 exactness (`pytestmark =
pytest.mark.usefixtures("float32_products")` for a whole module); tests under
tests/multidevice/ skip unless 8 devices are present.

`pytest --matmul-precision=tensorfloat32` runs every test with TF32 products, as float32 inputs
get by default on an NVIDIA GPU (emulated on the CPU: `tests/tf32.py`): on a machine without a
GPU it shows which tests a GPU would fail. Tests that pin their precision keep it. Commands a
test starts in another process run without the emulation, at the CPU's exact default: a test
comparing such a run with one of its own pins float32 products in both (the `float32_products`
fixture, and `JAX_DEFAULT_MATMUL_PRECISION=highest` in the command's environment).

On the CPU the run compiles with LLVM's optimisation off and XLA:CPU's loop emitters; it compiles
into one temporary compilation cache (below).
"""

import collections
import contextlib
import gc
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import tempfile

import jax
import jax.numpy as jnp
import pytest
import tf32

import experiments  # (sets XLA_FLAGS before the first computation starts JAX's CPU backend)

# Test programs are small and many: a run compiles ~19,000 of them, most of its CPU time on a
# 2-core CPU. They compile with LLVM's optimisation off and with XLA:CPU's loop emitters in place
# of its fusion emitters: the same programs in about a third of the compile time, into slower
# machine code (these programs run for milliseconds). Each program's code is generated as one
# LLVM module rather than split into up to 32 compiled in parallel: each part sets up its own
# LLVM target, which costs a small program more than its code (a quarter of the compile time
# here), and the test workers already keep the cores busy; the machine code is the same. A flag
# XLA_FLAGS names is kept. Commands the tests start inherit the flags, the multi-process trainer
# runs included. A run that may use a GPU or TPU (python -m experiments.check_accelerator runs
# these tests there) compiles with XLA's defaults: the tests check its compiles as they are.
TEST_COMPILER_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_parallel_codegen_split_count=1") + (
    # XLA in jaxlib 0.11 (jax's own version) has no other emitters, and aborts the process on a
    # flag it does not know.
    ("--xla_cpu_use_fusion_emitters=false",) if jax.__version_info__ < (0, 11) else ()
)


def _cpu_only() -> bool:
    """JAX_PLATFORMS=cpu, or no accelerator plugin installed (how JAX itself finds them)."""
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"] == "cpu"
    plugins = importlib.metadata.entry_points(group="jax_plugins")
    return not plugins and not any(importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu"))


if _cpu_only():
    for _flag in TEST_COMPILER_FLAGS:
        experiments.default_xla_flag(_flag)

MATMUL_PRECISIONS = ("default", tf32.TF32)

# One persistent compilation cache for the whole run, its workers and the commands they start:
# a program compiled by one test module (each drops its in-memory programs when it ends) or one
# command is loaded by the next that compiles it, and nothing is written to the trainer's cache
# in the home directory. Programs compiled in under 0.1 s are not written: most programs are, and
# their recompiles cost less than the files. The Triton kernels the tests compile
# (test_kernel_resources.py) go to a cache of the run too, not to Triton's in the home directory:
# each run compiles them as a clean checkout does. A directory the caller chose is kept, with the
# caller's settings.
COMPILATION_CACHE = "JAX_COMPILATION_CACHE_DIR"
CACHE_MIN_COMPILE_SECONDS = 0.1
TRITON_CACHE = "TRITON_CACHE_DIR"


def _run_directory(config, purpose: str) -> str:
    directory = tempfile.mkdtemp(prefix=f"linear-transformers-test-{purpose}-")
    config.run_directories.append(directory)
    return directory


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return  # xdist's workers read the variables set below when they import JAX or Triton.
    config.run_directories = []
    if TRITON_CACHE not in os.environ:
        os.environ[TRITON_CACHE] = _run_directory(config, "triton-cache")
    if COMPILATION_CACHE in os.environ:
        return
    directory = _run_directory(config, "jax-cache")
    os.environ[COMPILATION_CACHE] = directory
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(CACHE_MIN_COMPILE_SECONDS)
    # This process imported JAX before: its config is set directly.
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", CACHE_MIN_COMPILE_SECONDS)


def pytest_unconfigure(config):
    for directory in getattr(config, "run_directories", ()):
        shutil.rmtree(directory, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--matmul-precision",
        default="default",
        choices=MATMUL_PRECISIONS,
        help="float32 matrix products of every test: the platform's default, or TF32 (emulated "
        "on the CPU) as an NVIDIA GPU runs them by default",
    )


# The order xdist hands whole files to its two workers (`--dist loadfile --no-loadscope-reorder`
# in pyproject.toml): the files of a minute or more on a 2-core CPU first, longest first
# (`pytest --durations=0`), then the others by their number of tests, as xdist's own order would.
# A long file of few tests (test_multidevice.py: one test, minutes of a subprocess) handed out
# last kept one worker busy for its length while the other idled.
LONGEST_FIRST = (
    "test_multidevice.py",
    "test_precision.py",
    "test_masked_rows.py",
    "test_benchmarks.py",
    "test_benchmark_accelerator.py",
    "test_speech_task.py",
    "test_resume_metrics.py",
    "test_fault_injection.py",
    "test_config_cli.py",
    "test_save_faults.py",
    "test_readme.py",
    "test_compilation_cache.py",
)


def pytest_collection_finish(session):
    """What collection imported (JAX, Flax, the library, the test modules) stays for the run:
    out of the garbage collector's view, its full collections walk only what the tests make.
    With the threshold `experiments` sets, tests/models took ~7% less CPU (362 s against 391 s,
    the mean of two runs each, the 2-core CPU VM)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    per_file = collections.Counter(item.path for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sorted() is stable: a file's tests keep their order.
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -per_file[item.path], str(item.path)))


@pytest.fixture(autouse=True, scope="session")
def _session_matmul_precision(request):
    # Session-wide, so that module-scoped fixtures (a shared training run) compute at it too.
    if request.config.getoption("--matmul-precision") == tf32.TF32:
        with tf32.tf32_products():
            yield
    else:
        yield


@pytest.fixture
def float32_products():
    """Float32 matrix products in float32 (not TF32 as on GPUs, nor bfloat16 passes as on TPUs):
    for tests that assert float32 exactness. The library follows `jax.default_matmul_precision`
    (ops/precision.py)."""
    with jax.default_matmul_precision("highest"):
        yield


def enable_x64():
    """Context manager turning on float64 for the duration of a test, across jax versions."""
    if hasattr(jax, "enable_x64"):  # jax >= 0.8 (jax.experimental.enable_x64 is gone in 0.10)
        return jax.enable_x64(True)
    try:
        from jax.experimental import enable_x64  # older jax

        return enable_x64()
    except ImportError:

        @contextlib.contextmanager
        def _update():
            old = jax.config.jax_enable_x64
            jax.config.update("jax_enable_x64", True)
            try:
                yield
            finally:
                jax.config.update("jax_enable_x64", old)

        return _update()


@pytest.fixture
def x64():
    with enable_x64():
        assert jnp.zeros((), jnp.float64).dtype == jnp.float64
        yield


MULTIDEVICE_DIR = pathlib.Path(__file__).parent / "multidevice"
MULTIDEVICE_COUNT = 8


@pytest.fixture(autouse=True)
def _multidevice_tests_need_eight_devices(request):
    """tests/multidevice/ needs 8 devices: tests/test_multidevice.py runs that folder in a
    subprocess on 8 host CPU devices; in a run with fewer (the main one) each test skips.

    A fixture rather than a module-level skipif: the device count is read when a test runs, not
    while the main run is still collecting (which would start the backend early). It lives here,
    not in a conftest.py of that folder, because two modules named `conftest` would shadow each
    other on sys.path.
    """
    if MULTIDEVICE_DIR not in pathlib.Path(str(request.node.path)).parents:
        return
    if jax.device_count() < MULTIDEVICE_COUNT:
        pytest.skip(
            f"needs {MULTIDEVICE_COUNT} devices, found {jax.device_count()}: "
            "tests/test_multidevice.py runs this folder on 8 host CPU devices"
        )


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drop the programs each test module compiled once it is done. Why: every compiled XLA CPU
    program keeps its code in memory mappings, and one worker runs hundreds of modules; past the
    kernel's limit on mappings (vm.max_map_count, 65530 by default) the next compile crashes
    the worker (a segfault or an abort inside XLA), and pytest-xdist then hangs."""
    yield
    jax.clear_caches()
    gc.collect()
