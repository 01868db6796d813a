"""Memory of the chunked causal form, read from XLA's compiled memory analysis (no run, no timing)."""

import jax
import jax.numpy as jnp
import pytest

from linear_transformers import ops


def _temp_bytes(impl, T, *, grad, B=1, H=8, D=32):
    spec = jax.ShapeDtypeStruct((B, T, H, D), jnp.float32)

    def f(q, k, v):
        return ops.causal_linear_attention(q, k, v, implementation=impl).sum()

    fn = jax.grad(f, argnums=(0, 1, 2)) if grad else f
    analysis = jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    return analysis.temp_size_in_bytes


@pytest.mark.parametrize("grad", [False, True])
def test_chunked_handles_65536_steps_in_linear_memory(grad):
    small, large = _temp_bytes("chunked", 16384, grad=grad), _temp_bytes("chunked", 65536, grad=grad)
    # The target: T=65536, B=1, H=8, D=M=32 within a few GB on CPU.
    assert large < 2 * 2**30, f"{large / 2**20:.0f} MiB of temporaries at T=65536"
    # 4x the length costs at most ~4x the memory: linear, not quadratic (16x).
    assert large / small < 4.5, (small, large)


def test_quadratic_reference_grows_quadratically():
    # The contrast that makes the test above meaningful.
    small, large = _temp_bytes("reference", 1024, grad=False), _temp_bytes("reference", 4096, grad=False)
    assert large / small > 12, (small, large)
