"""An attention op called eagerly (outside `jit`) runs one compiled program per shapes and options: a
repeated call, and its gradient, trace nothing again (JAX reports every trace as a monitoring
event). The Pallas launch options (`pallas.tuning`), read while tracing, are part of the key."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops
from linear_transformers.ops.gated_linear import pallas

TRACE = "/jax/core/compile/jaxpr_trace_duration"
x = jnp.linspace(-1, 1, 1 * 32 * 2 * 8).reshape(1, 32, 2, 8)
g = -jnp.ones((1, 32, 2))
CALLS = {
    "gated-segments": lambda q: ops.gated_linear_attention(
        q, x, x, log_decay=g, segment_ids=jnp.ones((1, 32), int)
    ),
    "causal": lambda q: ops.causal_linear_attention(q, x, x),
    "delta": lambda q: ops.delta_rule_attention(
        q, x, x, jnp.full((1, 32, 2), 0.5), log_decay=g[..., None] + x
    ),
    "pallas": lambda q: ops.gated_linear_attention(q, x, x, log_decay=g, implementation="pallas"),
    "softmax": lambda q: ops.softmax_attention(q, x, x, causal=True, key_lengths=jnp.array([20])),
    "softmax-chunked": lambda q: ops.softmax_attention(q, x, x, causal=True, implementation="chunked"),
}


@pytest.fixture
def traces():
    count = collections.Counter()

    def listen(event, seconds, **kwargs):
        count[event] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield count
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize("name", CALLS)
def test_a_repeated_eager_call_and_its_gradient_trace_nothing(name, traces):
    call = CALLS[name]
    grad = jax.grad(lambda q: jnp.sum(call(q)))
    first = call(x), grad(x)
    traces.clear()
    again = call(x), grad(x)
    assert traces[TRACE] == 0
    assert jnp.array_equal(again[0], first[0]) and jnp.array_equal(again[1], first[1])


def test_another_pallas_tuning_is_traced_again(traces):
    call = CALLS["pallas"]
    call(x)
    traces.clear()
    with pallas.tuning(parallel_forward=True):
        call(x)
        assert traces[TRACE] > 0
        traces.clear()
        call(x)
        assert traces[TRACE] == 0


def test_a_wrapped_feature_map_keys_a_program_by_its_function_name_and_pointwise():
    a, b, pointwise = (ops.CallableFeatureMap(jnp.exp, "exp", pointwise=p) for p in (False, False, True))
    assert a == b and hash(a) == hash(b)
    assert a != pointwise and a != ops.CallableFeatureMap(jnp.exp, "other")


class _Elu(ops.FeatureMap):
    """elu + 1 as a FeatureMap of its own class: not a wrapped function, so not a key."""

    def __call__(self, x):
        return ops.elu_plus_one(x)


@pytest.mark.parametrize("name", ["gated", "softmax"])
def test_the_compiled_call_equals_the_call_run_op_by_op(name):
    """Options that cannot key a program (a feature map of a class of its own; softmax's scale
    as an array) run op by op, and agree with the compiled call."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 8)), jnp.float32) for _ in range(3))
    if name == "gated":
        call = functools.partial(ops.gated_linear_attention, q, k, v, log_decay=g, normalize=True)
        compiled, op_by_op = call(feature_map="elu"), call(feature_map=_Elu())
    else:
        call = functools.partial(ops.softmax_attention, q, k, v, causal=True)
        compiled, op_by_op = call(scale=0.3), call(scale=jnp.asarray(0.3))
    np.testing.assert_allclose(compiled, op_by_op, rtol=1e-6, atol=1e-6)
