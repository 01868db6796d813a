"""Sequence parallelism: every op with `sequence_axis` equals the same op on one device.

Time is split over the mesh axis "seq" of P devices. Inside `jax.shard_map` each device passes
its own [B, T/P, H, D] block (and the global initial state and key lengths); outside, under
`jax.set_mesh(mesh)`, the op takes global arrays and wraps itself. Values and gradients (w.r.t.
q, k, v and the initial state) are compared with one device in float64.

Needs 8 devices: tests/test_multidevice.py runs this file on 8 host CPU devices; elsewhere it
skips (tests/conftest.py).

Legend: B batch, T query time, S key time, H heads, D key/query features, F feature-map
features, M value features, P devices on the sequence axis.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import favor_map
from cases import unoptimised_jit as jit
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from linear_transformers import ops

B, H, D, M = 2, 2, 4, 6  # M != D
T = 24  # P = 2, 4, 8 give local blocks of 12, 6 and 3 steps...
CHUNK = 4  # ...a multiple of the chunk, not one, and shorter than one
S = 16  # keys of the non-causal ops (S != T)
F_FAVOR = 10
TIME = P(None, "seq")  # [B, T, ...] with time over "seq"
TOL = dict(rtol=1e-9, atol=1e-11)
GRAD_TOL = dict(rtol=1e-8, atol=1e-10)
F32_TOL = dict(rtol=1e-5, atol=1e-6)


def _fm(fm_name):
    return "elu" if fm_name == "elu" else favor_map(F_FAVOR, D)


def _num_features(fm_name):
    return D if fm_name == "elu" else F_FAVOR


def _mesh(shape, names=("seq",), explicit=False):
    """A mesh over the first prod(shape) of the 8 devices; Auto axes unless `explicit`."""
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(
        shape, names, axis_types=(kind,) * len(names), devices=jax.devices()[: int(np.prod(shape))]
    )


def _randn(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float64)


def _qkv(seed, t=T, s=None, batch=B, m=M):
    s = t if s is None else s
    return (_randn(seed, batch, t, H, D), _randn(seed + 1, batch, s, H, D), _randn(seed + 2, batch, s, H, m))


def _numpy_key_features(k, fm_name):
    k = np.asarray(k, np.float64)
    if fm_name == "elu":
        return np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0)))
    w_FD = np.asarray(favor_map(F_FAVOR, D).projection_FD, np.float64)
    x = k * k.shape[-1] ** -0.25
    return np.exp(x @ w_FD.T - 0.5 * np.sum(x * x, axis=-1, keepdims=True)) / np.sqrt(F_FAVOR)


def _numpy_state(k, v, fm_name="elu"):
    """(S, z) = (sum_s phi(k_s) v_s^T, sum_s phi(k_s)) in numpy (no compile)."""
    phi_k = _numpy_key_features(k, fm_name)
    return np.einsum("bshf,bshm->bhfm", phi_k, np.asarray(v)), phi_k.sum(axis=1)


def _history_state(seed, fm_name, batch=B):
    """A real, nonzero initial state: the (S, z) sums of 7 random keys and values."""
    _, k, v = _qkv(seed, t=7, batch=batch)
    return ops.LinearState(*(jnp.asarray(x) for x in _numpy_state(k, v, fm_name)))


def _weights(seed, t, fm_name, batch=B):
    """Coefficients of a random linear functional of (outputs, final S, final z)."""
    F = _num_features(fm_name)
    return (_randn(seed, batch, t, H, M), _randn(seed + 1, batch, H, F, M), _randn(seed + 2, batch, H, F))


def _functional(out, state, w):
    w_out, w_s, w_z = w
    return jnp.sum(out * w_out) + jnp.sum(state.s_BHFM * w_s) + jnp.sum(state.z_BHF * w_z)


def _per_device(state):
    """One copy of the state per device along a new leading axis (out_specs P("seq")), so the
    test sees what every device returned."""
    return jax.tree.map(lambda x: x[None], state)


def _mean_copy(states):
    # Every device's copy enters the loss, so the gradient flows back through every copy.
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), states)


def _causal(impl, fm_name, sequence_axis=None):
    return functools.partial(
        ops.causal_linear_attention,
        implementation=impl,
        chunk_size=CHUNK,
        feature_map=_fm(fm_name),
        return_state=True,
        sequence_axis=sequence_axis,
    )


@functools.lru_cache(maxsize=None)
def _causal_value_and_grad(impl, fm_name, p):
    """jit(value_and_grad) of the functional w.r.t. q, k, v and the initial state, with
    (outputs, per-device final states) as aux; p=None: one device, else shard_map over p."""
    if p is None:

        def run(q, k, v, state, key_lengths):
            out, final = _causal(impl, fm_name)(q, k, v, initial_state=state, key_lengths=key_lengths)
            return out, _per_device(final)
    else:

        def local(q, k, v, state, key_lengths):
            out, final = _causal(impl, fm_name, "seq")(q, k, v, initial_state=state, key_lengths=key_lengths)
            return out, _per_device(final)

        run = jax.shard_map(
            local, mesh=_mesh((p,)), in_specs=(TIME, TIME, TIME, P(), P()), out_specs=(TIME, P("seq"))
        )

    def loss(q, k, v, state, key_lengths, w):
        out, finals = run(q, k, v, state, key_lengths)
        return _functional(out, _mean_copy(finals), w), (out, finals)

    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _check_against_one_device(got, expected, p):
    """Outputs, every device's final state, and gradients equal one device's."""
    (_, (out, finals)), grads = got
    (_, (out1, finals1)), grads1 = expected
    chex.assert_trees_all_close(out, out1, **TOL)
    assert finals.s_BHFM.shape[0] == p, finals.s_BHFM.shape
    for i in range(p):
        chex.assert_trees_all_close(
            jax.tree.map(lambda x: x[i], finals), jax.tree.map(lambda x: x[0], finals1), **TOL
        )
    chex.assert_trees_all_close(grads, grads1, **GRAD_TOL)


# Chunked at P = 2 and 8, scan at 4 and 8, all four impls at P = 4; all from an initial state,
# and a few from none.
CAUSAL_CASES = (
    [(2, "chunked", "elu", True), (8, "chunked", "elu", True), (4, "scan", "elu", True)]
    + [(4, impl, "elu", True) for impl in ("reference", "associative_scan")]
    + [(4, "chunked", "favor", True)]
    + [(4, "chunked", "elu", False), (8, "scan", "elu", False)]
)


@pytest.mark.parametrize("p,impl,fm_name,with_state", CAUSAL_CASES)
def test_causal_in_shard_map_equals_one_device(x64, p, impl, fm_name, with_state):
    q, k, v = _qkv(1)
    state0 = _history_state(10, fm_name) if with_state else None
    w = _weights(20, T, fm_name)
    got = _causal_value_and_grad(impl, fm_name, p)(q, k, v, state0, None, w)
    # One device: the chunked form stands for every impl (they agree to rounding; one compile).
    expected = _causal_value_and_grad("chunked", fm_name, None)(q, k, v, state0, None, w)
    _check_against_one_device(got, expected, p)
    if with_state:  # the initial state really matters: it gets a gradient
        assert all(float(jnp.max(jnp.abs(g))) > 1e-3 for g in jax.tree.leaves(got[1][3]))


@pytest.mark.parametrize("p,impl,lengths", [(4, "chunked", (T, 9)), (8, "scan", (13, 0))])
def test_causal_key_lengths_are_global(x64, p, impl, lengths):
    """Key lengths index the global sequence: devices wholly past them add nothing."""
    q, k, v = _qkv(2)
    state0 = _history_state(11, "elu")
    key_lengths = jnp.asarray(lengths, jnp.int32)
    w_out, w_s, w_z = _weights(21, T, "elu")
    valid_BT11 = (jnp.arange(T)[None] < key_lengths[:, None])[:, :, None, None]
    w = (jnp.where(valid_BT11, w_out, 0), w_s, w_z)
    got = _causal_value_and_grad(impl, "elu", p)(q, k, v, state0, key_lengths, w)
    expected = _causal_value_and_grad("chunked", "elu", None)(q, k, v, state0, key_lengths, w)
    _check_against_one_device(got, expected, p)
    # ...and the state is the one of the valid prefix.
    for b, n in enumerate(lengths):
        prefix = _numpy_state(k[b : b + 1, :n], v[b : b + 1, :n])
        chex.assert_trees_all_close(
            tuple(x[0, b : b + 1] for x in got[0][1][1]),
            tuple(np.asarray(x[b : b + 1]) + c for x, c in zip(state0, prefix)),
            **TOL,
        )


def test_causal_state_with_replicated_out_spec(x64):
    """The returned state is the same on every device, and typed so: out_specs=P() works (with
    shard_map's replication checks on) and its gradient matches one device."""
    q, k, v = _qkv(3)
    state0 = _history_state(12, "elu")
    w = _weights(22, T, "elu")

    def local(q, k, v, state):
        return _causal("chunked", "elu", "seq")(q, k, v, initial_state=state)

    run = jax.shard_map(local, mesh=_mesh((4,)), in_specs=(TIME, TIME, TIME, P()), out_specs=(TIME, P()))

    def loss(q, k, v, state, run):
        out, final = run(q, k, v, state)
        return _functional(out, final, w), (out, final)

    def one_run(q, k, v, state):
        return _causal("chunked", "elu")(q, k, v, initial_state=state)

    got = jit(jax.value_and_grad(functools.partial(loss, run=run), argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, state0
    )
    expected = jit(
        jax.value_and_grad(functools.partial(loss, run=one_run), argnums=(0, 1, 2, 3), has_aux=True)
    )(q, k, v, state0)
    chex.assert_trees_all_close(got[0], expected[0], **TOL)
    chex.assert_trees_all_close(got[1], expected[1], **GRAD_TOL)


def _global_value_and_grad(op):
    """value_and_grad of the functional of op(q, k, v, state, key_lengths) -> (out, state)."""

    def loss(q, k, v, state, key_lengths, w):
        out, final = op(q, k, v, state, key_lengths)
        return _functional(out, final, w), (out, final)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


def _causal_global(impl, sequence_axis):
    def op(q, k, v, state, key_lengths):
        return _causal(impl, "elu", sequence_axis)(q, k, v, initial_state=state, key_lengths=key_lengths)

    return op


@pytest.mark.parametrize("impl", ["chunked", "scan"])
def test_causal_outside_shard_map_with_a_mesh_set(x64, impl):
    """Global arrays, `sequence_axis` and a mesh set: the op wraps itself in shard_map."""
    q, k, v = _qkv(4)
    state0 = _history_state(13, "elu")
    key_lengths = jnp.asarray([T, 11], jnp.int32)
    w = _weights(23, T, "elu")
    expected = jit(_global_value_and_grad(_causal_global(impl, None)))(q, k, v, state0, key_lengths, w)
    with jax.set_mesh(_mesh((4,))):
        got = jit(_global_value_and_grad(_causal_global(impl, "seq")))(q, k, v, state0, key_lengths, w)
    chex.assert_trees_all_close(got[0], expected[0], **TOL)
    chex.assert_trees_all_close(got[1], expected[1], **GRAD_TOL)


@pytest.mark.parametrize("form,batch", [("shard_map", B), ("global", B), ("global", 3)])
def test_causal_on_a_two_d_mesh_batch_on_data(x64, form, batch):
    """Mesh ("data", "seq") = (2, 4): batch over "data", time over "seq". (Outside shard_map a
    batch of 3 does not divide over "data": it stays whole.)"""
    mesh = _mesh((2, 4), ("data", "seq"))
    q, k, v = _qkv(5, batch=batch)
    state0 = _history_state(14, "elu", batch=batch)
    key_lengths = jnp.asarray([T, 7, 18][:batch], jnp.int32)
    w = _weights(24, T, "elu", batch=batch)
    expected = jit(_global_value_and_grad(_causal_global("chunked", None)))(q, k, v, state0, key_lengths, w)
    if form == "shard_map":

        def local(q, k, v, state, key_lengths):
            out, final = _causal("chunked", "elu", "seq")(
                q, k, v, initial_state=state, key_lengths=key_lengths
            )
            return out, _per_device(final)

        bt = P("data", "seq")
        run = jax.shard_map(
            local, mesh=mesh, in_specs=(bt, bt, bt, P("data"), P("data")), out_specs=(bt, P("seq", "data"))
        )

        def loss(q, k, v, state, key_lengths, w):
            out, finals = run(q, k, v, state, key_lengths)
            return _functional(out, _mean_copy(finals), w), (out, finals)

        (value, (out, finals)), grads = jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
            q, k, v, state0, key_lengths, w
        )
        for i in range(4):  # every device on "seq" returned the global state
            chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], finals), expected[0][1][1], **TOL)
        got = (value, (out, _mean_copy(finals))), grads
    else:
        with jax.set_mesh(mesh):
            got = jit(_global_value_and_grad(_causal_global("chunked", "seq")))(
                q, k, v, state0, key_lengths, w
            )
    chex.assert_trees_all_close(got[0], expected[0], **TOL)
    chex.assert_trees_all_close(got[1], expected[1], **GRAD_TOL)


@pytest.mark.parametrize("sequence_axis", ["seq", None])
def test_causal_on_an_explicit_axes_mesh(x64, sequence_axis):
    """Inputs device_put to P("data", "seq") on an explicit-axes mesh run sequence-parallel,
    whether `sequence_axis` is given or left out (the time sharding is detected)."""
    mesh = _mesh((2, 4), ("data", "seq"), explicit=True)
    q, k, v = _qkv(6)
    state0 = _history_state(15, "elu")
    key_lengths = jnp.asarray([19, T], jnp.int32)
    w = _weights(25, T, "elu")
    fn = _global_value_and_grad(_causal_global("chunked", None))
    expected = jit(fn)(q, k, v, state0, key_lengths, w)

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    args = [put(x, "data", "seq") for x in (q, k, v)] + [
        jax.tree.map(lambda x: put(x, "data"), state0),
        put(key_lengths, "data"),
        (put(w[0], "data", "seq"), put(w[1], "data"), put(w[2], "data")),
    ]
    with jax.set_mesh(mesh):
        fn = _global_value_and_grad(_causal_global("chunked", sequence_axis))
        got = jit(fn)(*args)
        jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert "shard_map" in jaxpr, "the time-sharded inputs did not run sequence-parallel"
    chex.assert_trees_all_close(got[0], expected[0], **TOL)
    chex.assert_trees_all_close(got[1], expected[1], **GRAD_TOL)


# ---------------------------------------------------------------- non-causal linear attention


@functools.lru_cache(maxsize=None)
def _linear_value_and_grad(p, fm_name):
    """linear_attention outputs and linear_state_from_keys (per device) and the gradient of a
    functional of both w.r.t. q, k, v; p=None: one device."""
    fm = _fm(fm_name)

    def both(q, k, v, key_lengths, axis):
        out = ops.linear_attention(q, k, v, feature_map=fm, key_lengths=key_lengths, sequence_axis=axis)
        state = ops.linear_state_from_keys(k, v, feature_map=fm, key_lengths=key_lengths, sequence_axis=axis)
        return out, _per_device(state)

    if p is None:
        run = functools.partial(both, axis=None)
    else:
        run = jax.shard_map(
            functools.partial(both, axis="seq"),
            mesh=_mesh((p,)),
            in_specs=(TIME, TIME, TIME, P()),
            out_specs=(TIME, P("seq")),
        )

    def loss(q, k, v, key_lengths, w):
        out, states = run(q, k, v, key_lengths)
        return _functional(out, _mean_copy(states), w), (out, states)

    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("p,lengths,fm_name", [(8, (11, S), "elu"), (2, (9, 14), "favor")])
def test_linear_attention_and_state_from_keys_psum_over_the_axis(x64, p, lengths, fm_name):
    q, k, v = _qkv(7, t=T, s=S)
    key_lengths = jnp.asarray(lengths, jnp.int32)
    w = _weights(26, T, fm_name)
    got = _linear_value_and_grad(p, fm_name)(q, k, v, key_lengths, w)
    expected = _linear_value_and_grad(None, fm_name)(q, k, v, key_lengths, w)
    _check_against_one_device(got, expected, p)
    chex.assert_trees_all_close(
        got[0][1][0],
        ops.linear_attention_reference(q, k, v, feature_map=_fm(fm_name), key_lengths=key_lengths),
        **TOL,
    )


# ---------------------------------------------------------------- softmax attention


@functools.lru_cache(maxsize=None)
def _softmax_value_and_grad(p, causal):
    def attend(q, k, v, key_lengths, axis):
        return ops.softmax_attention(q, k, v, causal=causal, key_lengths=key_lengths, sequence_axis=axis)

    if p is None:
        run = functools.partial(attend, axis=None)
    else:
        run = jax.shard_map(
            functools.partial(attend, axis="seq"),
            mesh=_mesh((p,)),
            in_specs=(TIME, TIME, TIME, P()),
            out_specs=TIME,
        )

    def loss(q, k, v, key_lengths, w):
        out = run(q, k, v, key_lengths)
        return jnp.sum(out * w), out

    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


# (p, causal, key lengths, value features): M != D takes the explicit-weights path on one
# device, M == D jax.nn.dot_product_attention.
SOFTMAX_CASES = [(4, True, (T, 9), M), (8, True, None, M), (4, True, (13, T), D), (2, False, (3, S), D)]


@pytest.mark.parametrize("p,causal,lengths,m", SOFTMAX_CASES)
def test_softmax_attention_sequence_parallel_equals_one_device(x64, p, causal, lengths, m):
    q, k, v = _qkv(8, t=T, s=T if causal else S, m=m)
    key_lengths = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    w = _randn(27, B, T, H, m)
    (_, out), grads = _softmax_value_and_grad(p, causal)(q, k, v, key_lengths, w)
    (_, out1), grads1 = _softmax_value_and_grad(None, causal)(q, k, v, key_lengths, w)
    chex.assert_trees_all_close(out, out1, **TOL)
    chex.assert_trees_all_close(grads, grads1, **GRAD_TOL)
    # (jax.nn.dot_product_attention, which one device uses for M == D, forms its logits in
    # float32 even for float64 inputs: float32 accuracy against the explicit formula there.)
    chex.assert_trees_all_close(
        out,
        ops.softmax_attention_reference(q, k, v, causal=causal, key_lengths=key_lengths),
        **(TOL if m != D else F32_TOL),
    )


def test_softmax_outside_shard_map_with_a_mesh_set(x64):
    q, k, v = _qkv(9)
    key_lengths = jnp.asarray([T, 10], jnp.int32)
    expected = ops.softmax_attention_reference(q, k, v, causal=True, key_lengths=key_lengths)
    with jax.set_mesh(_mesh((4,))):
        out = jit(functools.partial(ops.softmax_attention, causal=True, sequence_axis="seq"))(
            q, k, v, key_lengths=key_lengths
        )
    chex.assert_trees_all_close(out, expected, **TOL)


# ---------------------------------------------------------------- errors


def _zeros_qkv(t):
    return jnp.zeros((B, t, H, D)), jnp.zeros((B, t, H, D)), jnp.zeros((B, t, H, M))


def _call(op_name, q, k, v, **kwargs):
    if op_name == "causal_linear_attention":
        return ops.causal_linear_attention(q, k, v, **kwargs)
    if op_name == "linear_attention":
        return ops.linear_attention(q, k, v, **kwargs)
    if op_name == "linear_state_from_keys":
        return ops.linear_state_from_keys(k, v, **kwargs)
    return ops.softmax_attention(q, k, v, causal=True, **kwargs)


OP_NAMES = ["causal_linear_attention", "linear_attention", "linear_state_from_keys", "softmax_attention"]


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_time_not_divisible_by_the_axis_size(op_name):
    q, k, v = _zeros_qkv(10)
    with jax.set_mesh(_mesh((4,))), pytest.raises(ValueError) as info:
        _call(op_name, q, k, v, sequence_axis="seq")
    message = str(info.value)
    assert re.search(r"\b10\b", message) and re.search(r"\b4\b", message), message


@pytest.mark.parametrize("where", ["mesh without the axis", "shard_map without the axis", "no mesh"])
@pytest.mark.parametrize("op_name", OP_NAMES)
def test_sequence_axis_not_in_the_mesh(op_name, where):
    q, k, v = _zeros_qkv(8)
    axis = "seq" if where == "no mesh" else "time"
    with pytest.raises(ValueError, match=axis):
        if where == "mesh without the axis":
            with jax.set_mesh(_mesh((4,))):
                _call(op_name, q, k, v, sequence_axis=axis)
        elif where == "shard_map without the axis":

            def local(q, k, v):
                return jax.tree.leaves(_call(op_name, q, k, v, sequence_axis=axis))[0][:, :1]

            jax.shard_map(local, mesh=_mesh((4,)), in_specs=(TIME,) * 3, out_specs=P("seq"))(q, k, v)
        else:
            _call(op_name, q, k, v, sequence_axis=axis)


@pytest.mark.parametrize("where", ["shard_map", "global"])
def test_softmax_mask_with_sequence_axis(where):
    q, k, v = _zeros_qkv(8)
    mask = jnp.ones((8, 8), bool)

    def attend(q, k, v):
        return ops.softmax_attention(q, k, v, mask=mask, sequence_axis="seq")

    with pytest.raises(ValueError, match="mask"):
        if where == "shard_map":
            jax.shard_map(attend, mesh=_mesh((4,)), in_specs=(TIME,) * 3, out_specs=TIME)(q, k, v)
        else:
            with jax.set_mesh(_mesh((4,))):
                attend(q, k, v)


@pytest.mark.parametrize("op", ["softmax", "linear", "linear_state_from_keys"])
def test_time_sharded_inputs_on_an_explicit_axes_mesh_need_no_sequence_axis(x64, op):
    """Without `sequence_axis`, inputs whose time axes are sharded on an explicit mesh axis run
    sequence-parallel over it (on one device's program they would not type-check)."""
    mesh = _mesh((2, 4), ("data", "seq"), explicit=True)
    q, k, v = _qkv(31, s=S)
    key_lengths = jnp.asarray([11, S], jnp.int32)
    if op == "softmax":
        q, k, v = _qkv(31)  # causal: T == S
        key_lengths = None
    fns = {
        "softmax": lambda q, k, v, lengths: ops.softmax_attention(
            q, k, v, causal=True, implementation="reference"
        ),
        "linear": lambda q, k, v, lengths: ops.linear_attention(q, k, v, key_lengths=lengths),
        "linear_state_from_keys": lambda q, k, v, lengths: ops.linear_state_from_keys(
            k, v, key_lengths=lengths
        ),
    }

    def value_and_grad(q, k, v, lengths):
        def loss(q, k, v):
            return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(fns[op](q, k, v, lengths)))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    expected = jit(value_and_grad)(q, k, v, key_lengths)

    def put(x, *spec):
        return None if x is None else jax.device_put(x, NamedSharding(mesh, P(*spec)))

    args = [put(x, "data", "seq") for x in (q, k, v)] + [put(key_lengths, "data")]
    with jax.set_mesh(mesh):
        got = jit(value_and_grad)(*args)
        jaxpr = str(jax.make_jaxpr(value_and_grad)(*args))
    assert "shard_map" in jaxpr, "the time-sharded inputs did not run sequence-parallel"
    chex.assert_trees_all_close(got, expected, **TOL)
