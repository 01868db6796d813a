"""The chunked form's segment loop and its recomputing backward pass (ops/gated_linear/chunk_segments.py):
gradients equal autodiff of a plain loop and of the quadratic reference, and the backward keeps
no sequence-sized copy of its inputs.

Legend: B batch, T time, H heads, D key/query features, F feature-map features, M value
features, L steps per segment.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops
from linear_transformers.ops.gated_linear import chunk_segments, chunked

B, H, D, M = 2, 2, 4, 3


def _toy_segment(consts, carry, inputs, flags):
    """A state-carrying segment: a scaled running sum, dropped where a flag is set."""
    (w,) = consts
    (x,) = inputs
    (reset,) = flags

    def step(c, xr):
        x_t, r_t = xr
        c = jnp.where(r_t[:, None], 0.0, c) * w + jnp.tanh(x_t)
        return c, c * x_t

    carry, out = jax.lax.scan(step, carry, (jnp.swapaxes(x, 0, 1), jnp.swapaxes(reset, 0, 1)))
    return carry, jnp.swapaxes(out, 0, 1)


def _toy_loop(w, x, reset, carry, G, L):
    outs = []
    for i in range(G):
        carry, out = _toy_segment((w,), carry, (x[:, i * L : (i + 1) * L],), (reset[:, i * L : (i + 1) * L],))
        outs.append(out)
    return jnp.concatenate(outs, axis=1), carry


def test_run_segments_values_and_gradients_equal_autodiff_of_a_loop(x64):
    G, L = 4, 5
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B, G * L, 3)))
    reset = jnp.asarray(rng.random((B, G * L)) < 0.2)
    carry = jnp.asarray(rng.standard_normal((B, 3)))
    w = jnp.asarray(0.9)
    d_out = jnp.asarray(rng.standard_normal((B, G * L, 3)))
    d_carry = jnp.asarray(rng.standard_normal((B, 3)))

    def loss(run):
        def f(w, x, carry):
            out, final = run(w, x, carry)
            return jnp.sum(out * d_out) + jnp.sum(final * d_carry), (out, final)

        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(w, x, carry)

    def segmented(w, x, carry):
        spec = ((B, G * L, 3), x.dtype)
        return chunk_segments.run_segments(_toy_segment, (w,), (x,), (reset,), carry, G, L, spec)

    (_, got), got_grads = loss(jax.jit(segmented))
    (_, expected), expected_grads = loss(lambda w, x, carry: _toy_loop(w, x, reset, carry, G, L))
    chex.assert_trees_all_close(got, expected, rtol=1e-12, atol=1e-12)
    chex.assert_trees_all_close(got_grads, expected_grads, rtol=1e-10, atol=1e-12)


def _inputs(seed, T):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, D))) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, M)))
    s0 = jnp.asarray(rng.standard_normal((B, H, D, M)))
    z0 = jnp.asarray(rng.random((B, H, D)) + 0.5)
    w = jnp.asarray(rng.standard_normal((B, T, H, M)))
    return q, k, v, s0, z0, w


@pytest.mark.parametrize("segment", [8, None])
def test_causal_gradients_with_state_lengths_and_segments_equal_the_quadratic(x64, monkeypatch, segment):
    """Values and gradients of q, k, v and the initial state (s0, z0), with key_lengths, packed
    segment ids and NaN in the padding, T not a multiple of the chunk or the segment."""
    monkeypatch.setattr(chunked, "segment_length", lambda platform=None: segment)
    T = 29
    q, k, v, s0, z0, w = _inputs(1, T)
    v = v.at[0, 25:].set(jnp.nan)  # padding of example 0: key_lengths 25
    key_lengths = jnp.asarray([25, 29])
    segment_ids = jnp.asarray(np.repeat([[1, 1, 2, 3, 3, 3], [4, 4, 4, 5, 5, 6]], [5, 4, 6, 5, 5, 4], axis=1))

    def loss(impl):
        def f(q, k, v, s0, z0):
            out, state = ops.causal_linear_attention(
                q,
                k,
                v,
                implementation=impl,
                chunk_size=4,
                initial_state=ops.LinearState(s0, z0),
                return_state=True,
                key_lengths=key_lengths,
                segment_ids=segment_ids,
            )
            return jnp.sum(out * w) + jnp.sum(state.s_BHFM) + jnp.sum(state.z_BHF**2), out

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, s0, z0)

    (_, out), grads = loss("chunked")
    (_, expected_out), expected = loss("reference")
    chex.assert_trees_all_close(out, expected_out, rtol=1e-10, atol=1e-12)
    chex.assert_tree_all_finite(grads)
    chex.assert_trees_all_close(grads, expected, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("decay_features", [1, D])
def test_gated_gradients_equal_the_quadratic(x64, monkeypatch, decay_features):
    """Decays per head and per feature: gradients of q, k, v, the log decays and s0."""
    monkeypatch.setattr(chunked, "segment_length", lambda platform=None: 8)
    T = 21
    q, k, v, s0, _, w = _inputs(2, T)
    rng = np.random.default_rng(3)
    log_decay = jnp.asarray(-rng.random((B, T, H, decay_features)))
    if decay_features == 1:
        log_decay = log_decay[..., 0]

    def loss(impl):
        def f(q, k, v, g, s0):
            out, state = ops.gated_linear_attention(
                q,
                k,
                v,
                log_decay=g,
                implementation=impl,
                chunk_size=4,
                initial_state=ops.LinearState(s0, None),
                return_state=True,
            )
            return jnp.sum(out * w) + jnp.sum(state.s_BHFM**2)

        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q, k, v, log_decay, s0)

    chex.assert_trees_all_close(loss("chunked"), loss("reference"), rtol=1e-8, atol=1e-10)


def test_gradient_of_a_feature_maps_projection_flows_through_the_segments(x64, monkeypatch):
    """An array the feature map closes over (FAVOR+'s projection) is differentiated."""
    monkeypatch.setattr(chunked, "segment_length", lambda platform=None: 8)
    T, F = 19, 6
    q, k, v, _, _, w = _inputs(4, T)
    projection = jnp.asarray(np.random.default_rng(5).standard_normal((F, D)))

    def grad(impl):
        def f(projection, q):
            fm = ops.feature_maps.FavorFeatureMap(projection)
            return jnp.sum(
                ops.causal_linear_attention(q, k, v, feature_map=fm, implementation=impl, chunk_size=4) * w
            )

        return jax.grad(f, argnums=(0, 1))(projection, q)

    got = jax.jit(lambda: grad("chunked"))()
    expected = grad("reference")
    assert float(jnp.max(jnp.abs(expected[0]))) > 1e-3
    chex.assert_trees_all_close(got, expected, rtol=1e-8, atol=1e-10)


def _compiled_bytes(fn, *args):
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes


def test_the_backward_keeps_no_sequence_sized_copy(monkeypatch):
    """Forward+backward's working memory (XLA's temporaries, beyond arguments and results)
    grows by less than two [B, T, H, D] arrays from T to 4T: the backward recomputes segments
    rather than storing the prepared inputs, their relayouts or per-chunk states. The growth,
    not the total: a platform's fixed buffers (a GPU's matmul workspaces, 10 MB on an H200) do
    not grow with the sequence."""
    monkeypatch.setattr(chunked, "segment_length", lambda platform=None: 256)

    def temporaries(T):
        q = k = v = w = jnp.zeros((1, T, 4, 32), jnp.float32)

        def forward_backward(q, k, v, w):
            return jax.vjp(lambda q, k, v: ops.causal_linear_attention(q, k, v, chunk_size=64), q, k, v)[1](w)

        return _compiled_bytes(forward_backward, q, k, v, w), q.size * 4

    short, short_bytes = temporaries(1024)
    long, long_bytes = temporaries(4096)
    assert long - short < 2 * (long_bytes - short_bytes)


def test_pad_time_appends_zero_steps_and_leaves_a_whole_sequence_as_it_is():
    x = jnp.arange(6.0).reshape(1, 3, 2)
    np.testing.assert_array_equal(chunk_segments.pad_time(x, 2), [[[0, 1], [2, 3], [4, 5], [0, 0], [0, 0]]])
    assert chunk_segments.pad_time(x, 0) is x
    assert chunk_segments.pad_time(None, 3) is None
