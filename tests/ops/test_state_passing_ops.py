"""State into and out of the parallel forms, on one device, against slow references.

causal_linear_attention with `initial_state`, `return_state` and `key_lengths` for every impl
(values and gradients, w.r.t. the initial state too), segments carrying the state, the errors;
and the softmax KV-cache prefill against token-by-token steps and the causal reference.

Legend: B batch, T time, H heads, D key/query features, F feature-map features, M value features.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import chunk_size_for, favor_map
from cases import unoptimised_jit as jit

from linear_transformers import ops

B, H, D, M = 2, 2, 4, 6  # M != D throughout
F_FAVOR = 10  # != D: a state built for F = D does not fit
EPS = 1e-6  # the ops' default
T_HISTORY = 7


def _fm(fm_name):
    return "elu" if fm_name == "elu" else favor_map(F_FAVOR, D)


def _num_features(fm_name):
    return D if fm_name == "elu" else F_FAVOR


def _randn(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


def _inputs(seed, T):
    """q, k, v as float64 numpy arrays (the tests convert them inside their x64 context)."""
    return _randn(seed, B, T, H, D), _randn(seed + 1, B, T, H, D), _randn(seed + 2, B, T, H, M)


def _jnp(tree, dtype=jnp.float64):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def _jnp_state(state, dtype=jnp.float64):
    """A numpy (S, z) pair (or None) as an ops.LinearState."""
    return None if state is None else ops.LinearState(*_jnp(state, dtype))


def _numpy_features(fm_name):
    """Independent numpy feature maps (query_fn, key_fn)."""
    if fm_name == "elu":
        f = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))  # noqa: E731
        return f, f
    w_FD = np.asarray(favor_map(F_FAVOR, D).projection_FD, np.float64)

    def exponent(x):
        x = x * x.shape[-1] ** -0.25
        return x @ w_FD.T - 0.5 * np.sum(x * x, axis=-1, keepdims=True)

    def query_fn(x):  # divided by exp(max exponent): cancels in the normaliser, as in the op
        e = exponent(x)
        return np.exp(e - e.max(axis=-1, keepdims=True)) / np.sqrt(F_FAVOR)

    return query_fn, lambda x: np.exp(exponent(x)) / np.sqrt(F_FAVOR)


def _numpy_rnn(q, k, v, fm_name, initial_state=None, key_lengths=None):
    """The RNN, step by step in numpy float64: (out_BTHM, (S_BHFM, z_BHF) after the last step).

    S_t = S_{t-1} + phi(k_t) v_t^T, z_t = z_{t-1} + phi(k_t) from (S_0, z_0) = initial_state;
    a key at index >= key_lengths[b] leaves the state of b as it is.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    query_fn, key_fn = _numpy_features(fm_name)
    phi_q, phi_k = query_fn(q), key_fn(k)
    batch, T = q.shape[:2]
    F = phi_k.shape[-1]
    if initial_state is None:
        s, z = np.zeros((batch, H, F, M)), np.zeros((batch, H, F))
    else:
        s, z = (np.array(x, np.float64) for x in initial_state)
    lengths = np.full(batch, T) if key_lengths is None else np.asarray(key_lengths)
    out = np.zeros((batch, T, H, M))
    for t in range(T):
        adds = (t < lengths).astype(np.float64)
        s = s + adds[:, None, None, None] * phi_k[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + adds[:, None, None] * phi_k[:, t]
        num = np.einsum("bhf,bhfm->bhm", phi_q[:, t], s)
        den = np.einsum("bhf,bhf->bh", phi_q[:, t], z)
        out[:, t] = num / (den + EPS)[..., None]
    return out, (s, z)


def _history_state(seed, fm_name):
    """A real, nonzero state (numpy): the one after T_HISTORY random steps (z > 0)."""
    return _numpy_rnn(*_inputs(seed, T_HISTORY), fm_name)[1]


def _reference(q, k, v, fm_name, initial_state=None, key_lengths=None):
    """The differentiable reference: explicit prefix sums over time in jnp, (out, LinearState).

    Its values are checked against `_numpy_rnn` wherever it is used.
    """
    fm = ops.make_feature_map(_fm(fm_name))
    phi_q, phi_k = fm.query(q), fm.key(k)
    if key_lengths is not None:
        valid_BT11 = (jnp.arange(q.shape[1])[None] < key_lengths[:, None])[:, :, None, None]
        phi_k, v = jnp.where(valid_BT11, phi_k, 0), jnp.where(valid_BT11, v, 0)
    s_BTHFM = jnp.cumsum(jnp.einsum("bthf,bthm->bthfm", phi_k, v), axis=1)
    z_BTHF = jnp.cumsum(phi_k, axis=1)
    if initial_state is not None:
        s_BTHFM = s_BTHFM + initial_state.s_BHFM[:, None]
        z_BTHF = z_BTHF + initial_state.z_BHF[:, None]
    num_BTHM = jnp.einsum("bthf,bthfm->bthm", phi_q, s_BTHFM)
    den_BTH = jnp.einsum("bthf,bthf->bth", phi_q, z_BTHF)
    return num_BTHM / (den_BTH + EPS)[..., None], ops.LinearState(s_BTHFM[:, -1], z_BTHF[:, -1])


def _weights(seed, T, fm_name):
    """Coefficients of a random linear functional of (outputs, final S, final z)."""
    F = _num_features(fm_name)
    return _jnp((_randn(seed, B, T, H, M), _randn(seed + 1, B, H, F, M), _randn(seed + 2, B, H, F)))


def _functional(out, state, w):
    w_out, w_s, w_z = w
    return jnp.sum(out * w_out) + jnp.sum(state.s_BHFM * w_s) + jnp.sum(state.z_BHF * w_z)


def _op(impl, chunk_size, fm_name):
    return functools.partial(
        ops.causal_linear_attention,
        implementation=impl,
        chunk_size=chunk_size_for(impl, chunk_size),
        feature_map=_fm(fm_name),
    )


@functools.lru_cache(maxsize=None)
def _value_and_grad(impl, chunk_size, fm_name):
    """jit(value_and_grad) of the functional w.r.t. q, k, v and the initial state, with the
    outputs and final state as aux; implementation="prefix_sums" is `_reference`."""

    def run(q, k, v, state, key_lengths):
        if impl == "prefix_sums":
            return _reference(q, k, v, fm_name, state, key_lengths)
        return _op(impl, chunk_size, fm_name)(
            q, k, v, initial_state=state, key_lengths=key_lengths, return_state=True
        )

    def loss(q, k, v, state, key_lengths, w):
        out, final = run(q, k, v, state, key_lengths)
        return _functional(out, final, w), (out, final)

    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _assert_state(state, fm_name, dtype=jnp.float64, batch=B):
    assert isinstance(state, ops.LinearState), type(state)
    F = _num_features(fm_name)
    chex.assert_shape(state.s_BHFM, (batch, H, F, M))
    chex.assert_shape(state.z_BHF, (batch, H, F))
    assert state.s_BHFM.dtype == dtype and state.z_BHF.dtype == dtype, state


def _close(got, expected, rtol=1e-10, atol=1e-12):
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, tuple(got)), jax.tree.map(np.asarray, tuple(expected)), rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("fm_name", ["elu", "favor"])
def test_numpy_reference_continues_the_history(fm_name):
    """The numpy RNN from the history's state gives the block's part of the RNN over
    [history ; block], and the final state of the whole concatenation."""
    history, block = _inputs(20, T_HISTORY), _inputs(1, 9)
    out, final = _numpy_rnn(*block, fm_name, _history_state(20, fm_name))
    full_out, full_final = _numpy_rnn(*(np.concatenate(p, axis=1) for p in zip(history, block)), fm_name)
    _close((out,) + final, (full_out[:, T_HISTORY:],) + full_final, rtol=1e-12, atol=1e-12)
    assert final[1].min() > 0.1  # a sane normaliser, as a real state has


# Gradients: every impl at T = 37 (not a multiple of the chunk, 8), the recurrent-inference
# forms with FAVOR+ (F != D) too, and the chunked form with a block shorter than a chunk and with
# a single step.
STATE_GRAD_CASES = (
    [(impl, 37, "elu") for impl in ops.LINEAR_IMPLEMENTATIONS]
    + [(impl, 37, "favor") for impl in ("chunked", "scan")]
    + [("chunked", 5, "elu"), ("chunked", 1, "elu")]
)


@pytest.mark.parametrize("impl,T,fm_name", STATE_GRAD_CASES)
def test_initial_and_final_state_values_and_gradients(x64, impl, T, fm_name):
    q, k, v = _inputs(1, T)
    state0 = _history_state(20, fm_name)
    w = _weights(30 + T, T, fm_name)
    args = (*_jnp((q, k, v)), _jnp_state(state0), None, w)
    (_, (out, final)), grads = _value_and_grad(impl, 8, fm_name)(*args)
    (_, (out_ref, final_ref)), grads_ref = _value_and_grad("prefix_sums", None, fm_name)(*args)
    chex.assert_shape(out, (B, T, H, M))
    assert out.dtype == jnp.float64
    _assert_state(final, fm_name)
    expected_out, expected_final = _numpy_rnn(q, k, v, fm_name, state0)
    _close((out,) + tuple(final), (expected_out,) + expected_final)
    _close((out_ref,) + tuple(final_ref), (expected_out,) + expected_final)
    # The initial state matters: without it the outputs differ.
    assert not np.allclose(out, _numpy_rnn(q, k, v, fm_name)[0], atol=1e-3)

    assert isinstance(grads[3], ops.LinearState), type(grads[3])
    for g in jax.tree.leaves(grads_ref):  # the functional depends on every input
        assert float(jnp.max(jnp.abs(g))) > 1e-3
    chex.assert_trees_all_close(grads, grads_ref, rtol=1e-8, atol=1e-10)


@functools.lru_cache(maxsize=None)
def _three_calls(impl, chunk_size, fm_name):
    """From a state without return_state, from a zero state, and from none (one compile)."""
    op = _op(impl, chunk_size, fm_name)

    def run(q, k, v, state, zero):
        return (
            op(q, k, v, initial_state=state),
            op(q, k, v, initial_state=zero, return_state=True),
            op(q, k, v, return_state=True),
        )

    return jit(run)


# Values only: a single step for the other impls, and the default impl.
STATE_VALUE_CASES = [(impl, 1) for impl in ("reference", "associative_scan", "scan")] + [("chunked", 13)]


@pytest.mark.parametrize("impl,T", STATE_VALUE_CASES)
def test_return_state_false_and_a_zero_initial_state(x64, impl, T):
    """return_state=False returns a plain array; a zero initial state is no initial state."""
    q, k, v = _inputs(2, T)
    state0 = _history_state(21, "elu")
    zero = ops.init_linear_state(B, H, D, M, dtype=jnp.float64)
    out, (out_zero, final_zero), (out_none, final_none) = _three_calls(impl, 4, "elu")(
        *_jnp((q, k, v)), _jnp_state(state0), zero
    )
    assert isinstance(out, jax.Array), type(out)
    _close([out], [_numpy_rnn(q, k, v, "elu", state0)[0]])
    _assert_state(final_none, "elu")
    expected_out, expected_final = _numpy_rnn(q, k, v, "elu")
    _close((out_zero,) + tuple(final_zero), (expected_out,) + expected_final)
    _close((out_none,) + tuple(final_none), (expected_out,) + expected_final)


KEY_LENGTH_CASES = [(impl, (13, 5), True) for impl in ops.LINEAR_IMPLEMENTATIONS] + [
    ("chunked", (0, 12), False)
]


@pytest.mark.parametrize("impl,lengths,with_state", KEY_LENGTH_CASES)
def test_key_lengths_give_the_state_of_the_unpadded_prefix(x64, impl, lengths, with_state):
    """Right-padded keys add nothing: the returned state is the prefix's, valid outputs are the
    prefix's outputs, and so are the gradients of a functional of those (0 on padded k, v)."""
    T = 13
    q, k, v = _inputs(3, T)
    # Padded steps hold large values, so any leak shows.
    pad_BT11 = (np.arange(T)[None] >= np.asarray(lengths)[:, None])[:, :, None, None]
    k, v = np.where(pad_BT11, 30 * k, k), np.where(pad_BT11, 30 * v, v)
    state0 = _history_state(21, "elu") if with_state else None
    w_out, w_s, w_z = _weights(40, T, "elu")
    w = (jnp.where(pad_BT11, 0, w_out), w_s, w_z)  # a functional of valid outputs and the state
    args = (*_jnp((q, k, v)), _jnp_state(state0), jnp.asarray(lengths, jnp.int32), w)
    (_, (out, final)), grads = _value_and_grad(impl, 4, "elu")(*args)
    _assert_state(final, "elu")
    chex.assert_tree_all_finite(out)
    for b, n in enumerate(lengths):
        b_state0 = None if state0 is None else tuple(x[b : b + 1] for x in state0)
        expected_out, expected_state = _numpy_rnn(*(x[b : b + 1, :n] for x in (q, k, v)), "elu", b_state0)
        _close([out[b : b + 1, :n]], [expected_out])
        _close([x[b : b + 1] for x in final], expected_state)
    # The whole block: padded queries see the valid keys (and the initial state) only.
    masked_out, masked_final = _numpy_rnn(q, k, v, "elu", state0, lengths)
    _close((out,) + tuple(final), (masked_out,) + masked_final)
    _, grads_ref = _value_and_grad("prefix_sums", None, "elu")(*args)
    chex.assert_trees_all_close(grads, grads_ref, rtol=1e-8, atol=1e-10)
    for g in grads[1:3]:  # nothing reaches padded keys and values
        assert np.all(np.asarray(jnp.where(pad_BT11, g, 0)) == 0)


@functools.lru_cache(maxsize=None)
def _segmented_value_and_grad(impl, bounds):
    """The block in segments [a, b), each starting from the previous one's returned state."""

    def loss(q, k, v, state, w):
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            out, state = ops.causal_linear_attention(
                q[:, a:b],
                k[:, a:b],
                v[:, a:b],
                implementation=impl,
                chunk_size=chunk_size_for(impl, 8),
                initial_state=state,
                return_state=True,
            )
            outs.append(out)
        out = jnp.concatenate(outs, axis=1)
        return _functional(out, state, w), (out, state)

    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize("impl", ["chunked", "scan"])
def test_segments_carrying_the_state_equal_one_pass(x64, impl):
    T = 37
    bounds = (0, 10, 13, 37)  # lengths 10 (not a multiple of the chunk), 3 (< chunk), 24
    q, k, v = _inputs(1, T)
    state0 = _history_state(20, "elu")
    w = _weights(30 + T, T, "elu")  # as in test_initial_and_final_state_...: shared compiles
    args = (*_jnp((q, k, v)), _jnp_state(state0), w)
    (_, (out, final)), grads = _segmented_value_and_grad(impl, bounds)(*args)
    # One pass of the reference and of the op (both compiled for the test above already).
    (_, aux_ref), grads_ref = _value_and_grad("prefix_sums", None, "elu")(*args[:4], None, w)
    (_, aux_one), grads_one = _value_and_grad(impl, 8, "elu")(*args[:4], None, w)
    _assert_state(final, "elu")
    expected_out, expected_final = _numpy_rnn(q, k, v, "elu", state0)
    for got in ((out, final), aux_ref, aux_one):
        _close((got[0],) + tuple(got[1]), (expected_out,) + expected_final)
    chex.assert_trees_all_close(grads, grads_ref, rtol=1e-8, atol=1e-10)
    chex.assert_trees_all_close(grads, grads_one, rtol=1e-8, atol=1e-10)


def test_state_is_float32_for_bfloat16_inputs():
    q, k, v = _inputs(6, 19)
    state0 = _history_state(24, "elu")
    out, final = jit(functools.partial(_op("chunked", 8, "elu"), return_state=True))(
        *_jnp((q, k, v), jnp.bfloat16), initial_state=_jnp_state(state0, jnp.float32)
    )
    assert out.dtype == jnp.bfloat16
    _assert_state(final, "elu", dtype=jnp.float32)
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (q, k, v)]
    expected_out, expected_final = _numpy_rnn(*rounded, "elu", state0)
    _close([out.astype(jnp.float32)], [expected_out], rtol=2e-2, atol=2e-2)
    # (phi(k) computed from bfloat16 keys may be rounded to bfloat16: ~0.4% each)
    _close(final, expected_final, rtol=2e-2, atol=2e-2)


def _shape_pattern(shape):
    """A shape as the message may print it: (2, 2, 5, 6) or [2, 2, 5, 6]."""
    return r"[(\[]" + re.escape(", ".join(map(str, shape))) + r",?[)\]]"


BAD_STATES = {  # name: (fm_name, S shape, z shape, the shape the message must name)
    "S features": ("elu", (B, H, D + 1, M), (B, H, D + 1), (B, H, D + 1, M)),
    "z only": ("elu", (B, H, D, M), (B, H, D + 1), (B, H, D + 1)),
    "batch": ("elu", (B + 1, H, D, M), (B + 1, H, D), (B + 1, H, D, M)),
    "value features": ("elu", (B, H, D, M + 1), (B, H, D), (B, H, D, M + 1)),
    "favor F": ("favor", (B, H, D, M), (B, H, D), (B, H, D, M)),
}


def _f32_inputs(T):
    return _jnp(_inputs(0, T), jnp.float32)


@pytest.mark.parametrize("impl", ["chunked", "scan", "reference"])
@pytest.mark.parametrize("case", BAD_STATES)
def test_initial_state_of_the_wrong_shape_names_the_shapes(impl, case):
    fm_name, s_shape, z_shape, bad = BAD_STATES[case]
    state = ops.LinearState(jnp.zeros(s_shape), jnp.zeros(z_shape))
    F = _num_features(fm_name)
    with pytest.raises(ValueError, match="initial_state") as info:
        _op(impl, 4, fm_name)(*_f32_inputs(5), initial_state=state)
    message = str(info.value)
    assert re.search(_shape_pattern(bad), message), message
    expected = (B, H, F, M) if case != "z only" else (B, H, F)
    assert re.search(_shape_pattern(expected), message), message


@pytest.mark.parametrize("impl", ["chunked", "scan"])
@pytest.mark.parametrize("bad", ["array", "dict"])
def test_initial_state_must_be_a_linear_state(impl, bad):
    s, z = jnp.zeros((B, H, D, M)), jnp.zeros((B, H, D))
    state = {"array": s, "dict": {"s_BHFM": s, "z_BHF": z}}[bad]
    with pytest.raises(ValueError, match="LinearState"):
        _op(impl, 4, "elu")(*_f32_inputs(5), initial_state=state)


@pytest.mark.parametrize("impl", ops.LINEAR_IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "key_lengths",
    [
        np.array([3], np.int32),
        np.array([3, 4, 5], np.int32),
        np.array([3.0, 4.0], np.float32),
        np.array([[3, 4]], np.int32),
    ],
)
def test_key_lengths_of_the_wrong_shape_or_dtype(impl, key_lengths):
    with pytest.raises(ValueError, match="key_lengths"):
        _op(impl, 4, "elu")(*_f32_inputs(5), key_lengths=jnp.asarray(key_lengths), return_state=True)


# ---------------------------------------------------------------- softmax KV-cache prefill

CAPACITY = 16


def _numpy_causal_softmax(q, k, v, scale=None):
    """softmax(q k^T * scale) v with query t seeing keys s <= t, in numpy float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    T = q.shape[1]
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bshm->bthm", weights, v)


# Compiled once per shape: op by op, each new shape would compile every primitive anew.
_step = jit(ops.softmax_attention_step, static_argnames="scale")
_prefill = jit(ops.softmax_attention_prefill, static_argnames="scale")


def _steps(cache, q, k, v, scale=None):
    """Token by token through softmax_attention_step: (cache, out_BTHM; None for no token)."""
    outs = []
    for t in range(q.shape[1]):
        cache, out = _step(cache, q[:, t], k[:, t], v[:, t], scale=scale)
        outs.append(out)
    return cache, (jnp.stack(outs, axis=1) if outs else None)


# (3, 13) fills the cache exactly.
@pytest.mark.parametrize(
    "first,n_before,T,scale",
    [
        ("steps", 0, 5, None),
        ("steps", 3, 13, None),
        ("steps", 4, 1, None),
        ("prefill", 3, 5, None),
        ("prefill", 6, 7, 0.3),
    ],
)
def test_softmax_prefill_equals_steps_and_the_causal_reference(x64, first, n_before, T, scale):
    """The first n_before tokens go in by steps or by a prefill; then a prefill of T tokens."""
    q, k, v = _inputs(60, n_before + T)
    jq, jk, jv = _jnp((q, k, v))
    cache = ops.init_kv_cache(B, CAPACITY, H, D, M, dtype=jnp.float64)
    before = tuple(x[:, :n_before] for x in (jq, jk, jv))
    block = tuple(x[:, n_before:] for x in (jq, jk, jv))
    expected = _numpy_causal_softmax(q, k, v, scale)
    if first == "steps":
        cache, _ = _steps(cache, *before, scale=scale)
    else:
        cache, out_before = _prefill(cache, *before, scale=scale)
        _close([out_before], [expected[:, :n_before]])
    assert int(cache.length) == n_before
    new_cache, out = _prefill(cache, *block, scale=scale)
    assert isinstance(new_cache, ops.KVCache), type(new_cache)
    assert int(new_cache.length) == n_before + T
    chex.assert_shape(out, (B, T, H, M))
    assert out.dtype == jnp.float64
    _close([out], [expected[:, n_before:]])

    step_cache, out_steps = _steps(cache, *block, scale=scale)
    _close([out], [out_steps])
    n = n_before + T
    _close([new_cache.k_BSHD[:, :n], new_cache.v_BSHM[:, :n]], [k, v], rtol=0, atol=0)
    _close(new_cache, step_cache, rtol=0, atol=0)


def test_softmax_prefill_eagerly(x64):
    q, k, v = _inputs(61, 9)
    jq, jk, jv = _jnp((q, k, v))
    cache = ops.init_kv_cache(B, CAPACITY, H, D, M, dtype=jnp.float64)
    cache, out = ops.softmax_attention_prefill(cache, jq, jk, jv)  # op by op, not compiled
    assert int(cache.length) == 9
    _close([out], [_numpy_causal_softmax(q, k, v)])


@pytest.mark.parametrize("n_before,T", [(5, 4), (0, 9), (8, 1)])
def test_softmax_prefill_overflow_raises_eagerly(n_before, T):
    capacity = 8
    q, k, v = _jnp(_inputs(62, T), jnp.float32)
    cache = ops.init_kv_cache(B, capacity, H, D, M)._replace(length=jnp.asarray(n_before, jnp.int32))
    with pytest.raises(ValueError) as info:
        ops.softmax_attention_prefill(cache, q, k, v)
    assert re.search(r"\b8\b", str(info.value)), str(info.value)  # names the capacity


def test_softmax_prefill_overflow_under_jit_is_nan():
    """Slots past the capacity cannot be written: those outputs are NaN, never silently wrong."""
    capacity, n_before, T = 8, 5, 4
    q, k, v = _jnp(_inputs(63, T), jnp.float32)
    cache = ops.init_kv_cache(B, capacity, H, D, M)._replace(length=jnp.asarray(n_before, jnp.int32))
    _, out = _prefill(cache, q, k, v)
    assert np.all(np.isnan(np.asarray(out[:, capacity - n_before :]))), out


@pytest.mark.parametrize("n_before,T,scale", [(0, 6, None), (5, 6, 0.5)])
def test_softmax_prefill_gradients_match_the_reference(x64, n_before, T, scale):
    """W.r.t. the block's q, k, v and the cache contents (the earlier keys and values; slots
    the block overwrites or never reaches get 0)."""
    q, k, v = _jnp(_inputs(64, n_before + T))
    w = jnp.asarray(_randn(65, B, T, H, M))
    cache = ops.init_kv_cache(B, CAPACITY, H, D, M, dtype=jnp.float64)
    cache = cache._replace(
        k_BSHD=cache.k_BSHD.at[:, :n_before].set(k[:, :n_before]),
        v_BSHM=cache.v_BSHM.at[:, :n_before].set(v[:, :n_before]),
        length=jnp.asarray(n_before, jnp.int32),
    )

    def loss(qb, kb, vb, k_cache, v_cache):
        c = cache._replace(k_BSHD=k_cache, v_BSHM=v_cache)
        _, out = ops.softmax_attention_prefill(c, qb, kb, vb, scale=scale)
        return jnp.sum(out * w)

    block = tuple(x[:, n_before:] for x in (q, k, v))
    grads = jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*block, cache.k_BSHD, cache.v_BSHM)

    def loss_ref(qb, kb, vb, k_before, v_before):
        full_k = jnp.concatenate([k_before, kb], axis=1)
        full_v = jnp.concatenate([v_before, vb], axis=1)
        full_q = jnp.concatenate([q[:, :n_before], qb], axis=1)
        out = ops.softmax_attention_reference(full_q, full_k, full_v, causal=True, scale=scale)
        return jnp.sum(out[:, n_before:] * w)

    expected = jit(jax.grad(loss_ref, argnums=(0, 1, 2, 3, 4)))(*block, k[:, :n_before], v[:, :n_before])
    chex.assert_trees_all_close(grads[:3], expected[:3], rtol=1e-8, atol=1e-10)
    for g_cache, g_before in zip(grads[3:], expected[3:]):
        chex.assert_trees_all_close(g_cache[:, :n_before], g_before, rtol=1e-8, atol=1e-10)
        assert np.all(np.asarray(g_cache[:, n_before:]) == 0)
    for g in expected[:3]:
        assert float(jnp.max(jnp.abs(g))) > 1e-3
