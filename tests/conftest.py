"""Shared fixtures: `x64` turns on float64 for one test."""

import contextlib

import jax
import jax.numpy as jnp
import pytest


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
