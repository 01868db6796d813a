"""`ops.short_convolution`: the windowed form against a step-by-step loop (NumPy for values and
states, `short_convolution_step` under `jax.grad` for gradients), float64, with packed segments,
padding, key_lengths and an initial state; steps continue a call; bad arguments named.

Legend: B batch, T time, E features, W window.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops

B, T, E = 3, 11, 5
# Row 0: two segments and padding between and after them; row 1: padding first; row 2 one run.
IDS = np.array([[1] * 4 + [2] * 3 + [0] * 2 + [3] * 2, [0] * 2 + [5] * 9, [7] * T])
LENGTHS = np.array([T, 9, 6])


def _case(W, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, E))
    return x, rng.standard_normal((W, E)), rng.standard_normal(E), rng.standard_normal((B, W - 1, E))


def _flags(ids, lengths):
    valid = (ids != 0) & (np.arange(T)[None] < lengths[:, None])
    previous = np.concatenate([ids[:, :1], ids[:, :-1]], axis=1)
    return valid, valid & (ids != previous)


def _numpy_loop(x, w, b, s0, ids, lengths):
    """Step by step: the state is dropped where a segment begins, skipped where a step does not
    count (its output 0)."""
    valid, reset = _flags(ids, lengths)
    y, s = np.zeros_like(x), s0.copy()
    for r in range(B):
        for t in range(T):
            if reset[r, t]:
                s[r] = 0
            if valid[r, t]:
                window = np.concatenate([s[r], x[r, t][None]])
                pre = (window * w).sum(0) + b
                y[r, t] = pre / (1 + np.exp(-pre))
                s[r] = window[1:]
    return y, s


def _run(x, w, b, s0, ids, lengths):
    return ops.short_convolution(
        x, w, b, initial_state=s0, return_state=True, segment_ids=ids, key_lengths=lengths
    )


@pytest.mark.parametrize("W", [1, 2, 4])
def test_the_windowed_form_is_the_loop_in_values_states_and_gradients(x64, W):
    x, w, b, s0 = _case(W)
    x[0, 7] = np.nan  # Padding (id 0): seen by no window.
    want_y, want_s = _numpy_loop(x, w, b, s0, IDS, LENGTHS)
    y, s = _run(*(jnp.asarray(a) for a in (x, w, b, s0)), IDS, LENGTHS)
    chex.assert_trees_all_close((y, s), (want_y, want_s), rtol=1e-12, atol=1e-12)

    x = np.nan_to_num(x)
    valid, reset = _flags(IDS, LENGTHS)
    weights_y, weights_s = np.random.default_rng(1).standard_normal(want_y.shape), np.ones(want_s.shape)

    def loop_loss(x, w, b, s0):
        def body(s, inputs):
            x_t, valid_t, reset_t = inputs
            s = jnp.where(reset_t[:, None, None], 0, s)
            new_s, y_t = ops.short_convolution_step(s, x_t, w, b)
            return jnp.where(valid_t[:, None, None], new_s, s), jnp.where(valid_t[:, None], y_t, 0)

        s, y = jax.lax.scan(body, s0, (jnp.swapaxes(x, 0, 1), valid.T, reset.T))
        return jnp.sum(jnp.swapaxes(y, 0, 1) * weights_y) + jnp.sum(s * weights_s)

    def loss(x, w, b, s0):
        y, s = _run(x, w, b, s0, IDS, LENGTHS)
        return jnp.sum(y * weights_y) + jnp.sum(s * weights_s)

    args = tuple(jnp.asarray(a) for a in (x, w, b, s0))
    want = jax.grad(loop_loss, argnums=(0, 1, 2, 3))(*args)
    chex.assert_trees_all_close(jax.grad(loss, argnums=(0, 1, 2, 3))(*args), want, rtol=1e-10, atol=1e-12)


def test_steps_continue_a_call(x64):
    x, w, b, s0 = _case(4, seed=2)
    whole = ops.short_convolution(x, w, b, initial_state=s0)
    y, s = ops.short_convolution(x[:, :7], w, b, initial_state=s0, return_state=True)
    steps = []
    for t in range(7, T):
        s, y_t = ops.short_convolution_step(s, x[:, t], w, b)
        steps.append(y_t)
    chex.assert_trees_all_close(jnp.concatenate([y, jnp.stack(steps, 1)], 1), whole, rtol=1e-12)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(weight=np.ones((4, 3))), r"weight must be \[W, E\] with E=5"),
        (dict(activation="relu"), r"activation must be one of \('silu', None\), got 'relu'"),
        (dict(initial_state=np.zeros((B, 2, E))), r"the state must be \[B, W - 1, E\]=\[3, 3, 5\]"),
        (dict(bias=np.ones(4)), r"bias must be \[E\]=\[5\]"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    x, w, b, _ = _case(4)
    args = dict(weight=w, bias=b) | {k: v for k, v in kwargs.items() if k in ("weight", "bias")}
    options = {k: v for k, v in kwargs.items() if k not in ("weight", "bias")}
    with pytest.raises(ValueError, match=message):
        ops.short_convolution(x.astype(np.float32), args["weight"], args["bias"], **options)
