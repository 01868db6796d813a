"""XLA_FLAGS for a command on CPU host devices (experiments.with_host_devices)."""

import experiments


def test_the_device_count_is_replaced_and_the_other_flags_kept():
    flags = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8 --xla_b=1"
    assert experiments.with_host_devices(4, flags) == (
        "--xla_backend_optimization_level=0 --xla_b=1 --xla_force_host_platform_device_count=4"
    )
    assert experiments.with_host_devices(2, "") == "--xla_force_host_platform_device_count=2"


def test_without_flags_given_this_process_s_are_read(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_a=1 --xla_force_host_platform_device_count=3")
    assert experiments.with_host_devices(2) == "--xla_a=1 --xla_force_host_platform_device_count=2"
    monkeypatch.delenv("XLA_FLAGS")
    assert experiments.with_host_devices(2) == "--xla_force_host_platform_device_count=2"
