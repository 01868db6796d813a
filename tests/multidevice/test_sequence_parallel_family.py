"""Sequence parallelism for the family: decays and packed segments split over devices equal one
device, values and gradients (float64).

Time is split over the mesh axis "seq" of P devices. A device's block starts from the state of
the blocks before it, decayed by the decays between them, and dropped where a segment began;
softmax masks the other segments of the gathered keys; the non-causal linear form runs a
forward and a backward pass (the backward one over the devices in reverse order).

Needs 8 devices: tests/test_multidevice.py runs this file on 8 host CPU devices; elsewhere it
skips (tests/conftest.py).

Legend: B batch, T time, H heads, D key/query features, M value features.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import unoptimised_jit as jit
from jax.sharding import PartitionSpec as P

from linear_transformers import ops

B, T, H, D, M = 2, 24, 2, 4, 3
TIME = P(None, "seq")
TOL = dict(rtol=1e-9, atol=1e-10)
# Segments that begin inside blocks and exactly at block boundaries (P = 4: blocks of 6), with
# padding in the middle and at the end.
SEGMENTS = np.array([[1] * 6 + [2] * 5 + [0] * 2 + [3] * 9 + [0] * 2, [4] * 13 + [5] * 11])


def _mesh(p):
    return jax.make_mesh((p,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:p])


def _randn(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float64)


def _decay(kind, seed):
    """Log decays of a shape (kind), uniform in [-1.5, 0]; "strong feature": in [-40, -10], so
    that chunks take the exact form of per-feature scores, not the factored one."""
    rng = np.random.default_rng(seed)
    shapes = {"head": (H,), "step": (B, T, H), "feature": (B, T, H, D)}
    low, high = (10.0, 40.0) if kind.startswith("strong") else (0.0, 1.5)
    return jnp.asarray(-rng.uniform(low, high, size=shapes[kind.removeprefix("strong ")]))


def _gated(sequence_axis, impl):
    return functools.partial(
        ops.gated_linear_attention,
        implementation=impl,
        chunk_size=4,
        return_state=True,
        sequence_axis=sequence_axis,
    )


def _value_and_grad(run):
    def loss(q, k, v, g, s0, w, w_s):
        out, final = run(q, k, v, g, s0)
        return jnp.sum(out * w) + jnp.sum(final.s_BHFM * w_s), out

    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize(
    "p,impl,decay",
    [(4, "chunked", "step"), (4, "chunked", "feature"), (8, "scan", "head"), (2, "chunked", "head")],
)
def test_gated_in_shard_map_equals_one_device(x64, p, impl, decay):
    """Decays and segments across device boundaries; gradients w.r.t. q, k, v, the decays and the
    initial state."""
    q, k, v = (_randn(s, B, T, H, n) for s, n in ((1, D), (2, D), (3, M)))
    g = _decay(decay, 4)
    s0 = _randn(5, B, H, D, M)
    ids, lengths = jnp.asarray(SEGMENTS), jnp.asarray([T, 20], jnp.int32)
    w, w_s = _randn(6, B, T, H, M), _randn(7, B, H, D, M)
    g_spec = P() if decay == "head" else TIME

    def one(q, k, v, g, s0):
        return _gated(None, "chunked")(
            q,
            k,
            v,
            log_decay=g,
            initial_state=ops.LinearState(s0, None),
            segment_ids=ids,
            key_lengths=lengths,
        )

    def local(q, k, v, g, s0, ids, lengths):
        out, final = _gated("seq", impl)(
            q,
            k,
            v,
            log_decay=g,
            initial_state=ops.LinearState(s0, None),
            segment_ids=ids,
            key_lengths=lengths,
        )
        return out, final

    split = jax.shard_map(
        local,
        mesh=_mesh(p),
        in_specs=(TIME, TIME, TIME, g_spec, P(), TIME, P()),
        out_specs=(TIME, P()),
    )
    expected = _value_and_grad(one)(q, k, v, g, s0, w, w_s)
    got = _value_and_grad(lambda q, k, v, g, s0: split(q, k, v, g, s0, ids, lengths))(q, k, v, g, s0, w, w_s)
    valid = (SEGMENTS != 0) & (np.arange(T)[None] < np.asarray(lengths)[:, None])
    chex.assert_trees_all_close(np.asarray(got[0][1])[valid], np.asarray(expected[0][1])[valid], **TOL)
    chex.assert_trees_all_close(got[0][0], expected[0][0], **TOL)
    chex.assert_trees_all_close(got[1], expected[1], **TOL)


@pytest.mark.parametrize("impl", ["chunked", "scan"])
def test_gated_non_finite_decays_over_devices_reach_what_they_reach_on_one(x64, impl):
    """A NaN in a segment that ends at a block boundary stays on its device; a NaN in the last
    segment reaches the final state; a -inf is a reset (tests/ops/test_gated_nonfinite.py)."""
    q, k, v = (_randn(s, B, T, H, n) for s, n in ((21, D), (22, D), (23, M)))
    g = np.array(_decay("step", 24))
    g[0, 3, 0], g[1, 8, 1], g[1, 20, 0] = np.nan, -np.inf, np.nan
    ids = jnp.asarray(SEGMENTS)
    run = functools.partial(_gated(None, impl), log_decay=jnp.asarray(g), segment_ids=ids)
    expected = jit(run)(q, k, v)
    split = jax.shard_map(
        lambda q, k, v, g, ids: _gated("seq", impl)(q, k, v, log_decay=g, segment_ids=ids),
        mesh=_mesh(4),
        in_specs=(TIME, TIME, TIME, TIME, TIME),
        out_specs=(TIME, P()),
    )
    got = jit(split)(q, k, v, jnp.asarray(g), ids)
    for name, x, want in zip(("out", "s"), (got[0], got[1].s_BHFM), (expected[0], expected[1].s_BHFM)):
        np.testing.assert_array_equal(np.isfinite(x), np.isfinite(want), err_msg=name)
        chex.assert_trees_all_close(jnp.nan_to_num(x), jnp.nan_to_num(want), **TOL)
    assert not np.isfinite(np.asarray(expected[0])[0, 3:6, 0]).any() and np.isfinite(expected[0][0, 6:]).all()


def test_gated_outside_shard_map_with_a_mesh_set(x64):
    """Global arrays under `jax.set_mesh`: the op wraps itself, segments and decays included."""
    q, k, v = (_randn(s, B, T, H, n) for s, n in ((11, D), (12, D), (13, M)))
    g, ids = _decay("step", 14), jnp.asarray(SEGMENTS)
    run = functools.partial(
        ops.gated_linear_attention, log_decay=g, segment_ids=ids, chunk_size=4, return_state=True
    )
    expected = jit(run)(q, k, v)
    with jax.set_mesh(_mesh(4)):
        got = jit(functools.partial(run, sequence_axis="seq"))(q, k, v)
    chex.assert_trees_all_close(got, expected, **TOL)


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_segments_over_devices_equal_one_device(x64, causal):
    q, k, v = (_randn(s, B, T, H, D) for s in (21, 22, 23))
    ids = jnp.asarray(SEGMENTS)
    run = functools.partial(ops.softmax_attention, causal=causal, segment_ids=ids)
    expected = jit(run)(q, k, v)
    with jax.set_mesh(_mesh(4)):
        got = jit(functools.partial(run, sequence_axis="seq"))(q, k, v)
    valid = SEGMENTS != 0
    chex.assert_trees_all_close(np.asarray(got)[valid], np.asarray(expected)[valid], **TOL)


@pytest.mark.parametrize("p", [2, 8])
def test_non_causal_linear_segments_over_devices_equal_one_device(x64, p):
    """The backward pass visits the devices in reverse order (a ppermute inside shard_map);
    gradients too."""
    q, k, v = (_randn(s, B, T, H, D) for s in (31, 32, 33))
    ids, lengths = jnp.asarray(SEGMENTS), jnp.asarray([T, 17], jnp.int32)
    w = _randn(34, B, T, H, D) * jnp.asarray(SEGMENTS != 0)[:, :, None, None]

    def loss(q, k, v, sequence_axis):
        out = ops.linear_attention(q, k, v, segment_ids=ids, key_lengths=lengths, sequence_axis=sequence_axis)
        return jnp.sum(out * w)

    expected = jit(jax.value_and_grad(functools.partial(loss, sequence_axis=None), argnums=(0, 1, 2)))(
        q, k, v
    )
    with jax.set_mesh(_mesh(p)):
        got = jit(jax.value_and_grad(functools.partial(loss, sequence_axis="seq"), argnums=(0, 1, 2)))(
            q, k, v
        )
    chex.assert_trees_all_close(got, expected, **TOL)


@pytest.mark.parametrize(
    "p,impl,decay",
    [(4, "chunked", "step"), (4, "chunked", "feature"), (2, "chunked", "strong feature"), (8, "scan", None)],
)
def test_the_delta_rule_in_shard_map_equals_one_device(x64, p, impl, decay):
    """Each device's block as an affine map of the state entering it, composed over devices:
    segments across block boundaries, padding; gradients w.r.t. q, k, v, beta, the decays and
    the initial state."""
    q, k, v = (_randn(s, B, T, H, n) for s, n in ((31, D), (32, D), (33, M)))
    beta = jnp.asarray(np.random.default_rng(34).uniform(0, 2, (B, T, H)))
    g = None if decay is None else _decay(decay, 35)
    s0 = _randn(36, B, H, D, M)
    ids, lengths = jnp.asarray(SEGMENTS), jnp.asarray([T, 20], jnp.int32)
    w, w_s = _randn(37, B, T, H, M), _randn(38, B, H, D, M)

    def run(sequence_axis, q, k, v, beta, g, s0, ids, lengths):
        out, final = ops.delta_rule_attention(
            q, k, v, beta, log_decay=g, implementation=impl, chunk_size=4, return_state=True,
            initial_state=ops.LinearState(s0, None), segment_ids=ids, key_lengths=lengths,
            sequence_axis=sequence_axis,
        )  # fmt: skip
        return out, final.s_BHFM

    split = jax.shard_map(
        functools.partial(run, "seq"),
        mesh=_mesh(p),
        in_specs=(TIME, TIME, TIME, TIME, None if g is None else TIME, P(), TIME, P()),
        out_specs=(TIME, P()),
    )

    def loss(fn):
        def value(q, k, v, beta, g, s0):
            out, final = fn(q, k, v, beta, g, s0, ids, lengths)
            return jnp.sum(out * w) + jnp.sum(final * w_s), (out, final)

        argnums = (0, 1, 2, 3, 5) if g is None else (0, 1, 2, 3, 4, 5)
        return jit(jax.value_and_grad(value, argnums=argnums, has_aux=True))(q, k, v, beta, g, s0)

    expected = loss(functools.partial(run, None))
    got = loss(split)
    chex.assert_trees_all_close(got, expected, **TOL)


@pytest.mark.parametrize("impl", ["chunked", "scan"])
def test_delta_rule_non_finite_inputs_over_devices_reach_what_they_reach_on_one(x64, impl):
    """A NaN decay in a segment that ends at a block boundary stays on its device, one in the
    last segment reaches the final state; a NaN value reaches its column on the next device
    through the state entering it (tests/ops/test_delta_nonfinite.py)."""
    q, k, v = (np.array(_randn(s, B, T, H, n)) for s, n in ((41, D), (42, D), (43, M)))
    beta = np.random.default_rng(44).uniform(0, 2, (B, T, H))
    g = np.array(_decay("step", 45))
    g[0, 3, 0], g[1, 8, 1], g[1, 20, 0] = np.nan, -np.inf, np.nan
    v[0, 15, 1, 2] = np.nan  # Segment 3 runs over devices 2 and 3 (blocks of 6).
    ids = jnp.asarray(SEGMENTS)

    def run(sequence_axis, q, k, v, beta, g, ids):
        out, final = ops.delta_rule_attention(
            q, k, v, beta, log_decay=g, implementation=impl, chunk_size=4, return_state=True,
            segment_ids=ids, sequence_axis=sequence_axis,
        )  # fmt: skip
        return out, final.s_BHFM

    args = tuple(jnp.asarray(x) for x in (q, k, v, beta, g)) + (ids,)
    expected = jit(functools.partial(run, None))(*args)
    split = jax.shard_map(
        functools.partial(run, "seq"), mesh=_mesh(4), in_specs=(TIME,) * 6, out_specs=(TIME, P())
    )
    got = jit(split)(*args)
    for name, x, want in zip(("out", "s"), got, expected):
        np.testing.assert_array_equal(np.isfinite(x), np.isfinite(want), err_msg=name)
        chex.assert_trees_all_close(jnp.nan_to_num(x), jnp.nan_to_num(want), **TOL)
    out = np.asarray(expected[0])
    assert not np.isfinite(out[0, 3:6, 0]).any() and np.isfinite(out[0, 6:, 0]).all()
    assert not np.isfinite(out[0, 15:22, 1, 2]).any() and np.isfinite(out[0, 15:22, 1, :2]).all()


@pytest.mark.parametrize("p, window", [(4, 4), (8, 4), (4, 1)])
def test_short_convolution_in_shard_map_equals_one_device(x64, p, window):
    """Blocks of 6 or 3 steps: a window reads the previous device's last inputs, the initial state
    only on the first device, never past a segment begun on an earlier device (segment 3 begins
    at step 13 and runs over two devices at P = 4); the global final state, padding at the end;
    gradients of x, the weight and the initial state."""
    E = 5
    x = _randn(50, B, T, E)
    weight, s0 = _randn(51, window, E), _randn(52, B, window - 1, E)
    ids, lengths = jnp.asarray(SEGMENTS), jnp.asarray([T, T - 2])

    def run(sequence_axis, x, weight, s0, ids, lengths):
        return ops.short_convolution(
            x, weight, initial_state=s0, return_state=True, segment_ids=ids, key_lengths=lengths,
            sequence_axis=sequence_axis,
        )  # fmt: skip

    def value_and_grad(run):
        def loss(x, weight, s0, ids, lengths):
            y, state = run(x, weight, s0, ids, lengths)
            return jnp.sum(jnp.sin(y)) + jnp.sum(state**2), (y, state)

        return jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    args = (x, weight, s0, ids, lengths)
    expected = value_and_grad(functools.partial(run, None))(*args)
    split = jax.shard_map(
        functools.partial(run, "seq"),
        mesh=_mesh(p),
        in_specs=(TIME, P(), P(), TIME, P()),
        out_specs=(TIME, P()),
    )
    got = value_and_grad(split)(*args)
    chex.assert_trees_all_close(got, expected, **TOL)
    assert window == 1 or np.any(np.asarray(expected[0][1][1]) != 0)  # The state holds inputs.


def test_short_convolution_needs_w_minus_1_steps_per_device():
    x = jnp.ones((1, 8, 2))
    split = jax.shard_map(
        lambda x: ops.short_convolution(x, jnp.ones((4, 2)), sequence_axis="seq"),
        mesh=_mesh(8),
        in_specs=TIME,
        out_specs=TIME,
    )
    with pytest.raises(ValueError, match=r"at least W - 1 = 3 steps .* got 1 steps per device"):
        split(x)
