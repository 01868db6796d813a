"""The tests in this folder need 8 devices. tests/test_multidevice.py runs them in a subprocess
on 8 host CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8); in a run with fewer
devices (the main test run) each skips at once."""

import jax
import pytest

NUM_DEVICES = 8


@pytest.fixture(autouse=True)
def _needs_eight_devices():
    # A fixture rather than a module-level skipif: the device count is read when a test runs,
    # not while the main run is still collecting (which would start the backend early).
    if jax.device_count() < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices, found {jax.device_count()}: "
                    "tests/test_multidevice.py runs this folder on 8 host CPU devices")
