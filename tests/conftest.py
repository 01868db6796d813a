"""Shared fixtures: `x64` turns on float64 for one test; tests under tests/multidevice/ skip
unless 8 devices are present. XLA compiles at its lowest backend optimisation level here."""

import contextlib
import os
import pathlib

# Every program the tests compile is tiny (a few layers of width 16 to 64, a few steps): XLA's
# LLVM optimisations at least double the compile time that dominates the suite on CPU and save
# nothing at run time. The level changes no result beyond rounding (no fast math either way);
# the tests and their tolerances pass at both. Set before JAX starts its backend (it reads
# XLA_FLAGS then), so this process, its xdist workers and the subprocesses the tests start
# (which inherit the environment) all compile the same way. A level given by the caller stays.
_OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
if _OPT_LEVEL_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT_LEVEL_FLAG}=0".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402


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
