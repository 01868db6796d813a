"""One semantics for non-finite and extreme decays in every form of the gated op: a log decay of
-inf is a reset (finite, exact); a NaN one, or a positive one read under `jit`, makes NaN the
outputs of its segment from its step on and the rows of the final state it decays, and nothing
else; the gradients through the other outputs are finite and those of the finite inputs.

Legend: B batch, T time, H heads, D key/query features (F = D: identity feature map), M value
features, X decay features (1 or D).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import chunk_size_for, unoptimised_jit

from linear_transformers import ops

B, T, H, D, M = 2, 12, 2, 3, 2
IMPLEMENTATIONS = ops.LINEAR_IMPLEMENTATIONS
# Example 0 holds two packed sequences: the second (steps 9..11) sees nothing of the first.
SEGMENTS = np.array([[1] * 9 + [2] * 3, [1] * T])


def _inputs(shape):
    """q, k, v and log decays of `shape` with a NaN (example 0, step 5, head 0), a -inf (example
    1, step 4, head 1) and a positive value (example 1, step 8, head 0); for a decay per head,
    head 0 is NaN and head 1 is -inf."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, H, n)) for n in (D, D, M))
    g = -rng.uniform(0.05, 0.5, shape)
    if len(shape) == 1:
        g[:] = [np.nan, -np.inf]
    else:
        g[0, 5, 0], g[1, 4, 1], g[1, 8, 0] = np.nan, -np.inf, 0.5
    return q, k, v, g


def _recurrence(q, k, v, g):
    """The RNN in numpy, with the stated semantics: exp(-inf) = 0 multiplies the state, NaN (and
    a positive value, read as NaN) spreads through it, a segment's start drops it."""
    g = np.where(g > 0, np.nan, g)
    g = np.broadcast_to(g[None, None, :, None], (B, T, H, 1)) if g.ndim == 1 else g
    g = g[..., None] if g.ndim == 3 else g
    s, outs = np.zeros((B, H, D, M)), []
    for t in range(T):
        s = np.exp(g[:, t])[..., None] * s
        if t:
            s = np.where((SEGMENTS[:, t] != SEGMENTS[:, t - 1])[:, None, None, None], 0.0, s)
        s = s + np.einsum("bhf,bhm->bhfm", k[:, t], v[:, t])
        outs.append(np.einsum("bhf,bhfm->bhm", q[:, t] * D**-0.5, s))
    return np.stack(outs, axis=1), s


def _op(implementation):
    def run(q, k, v, g):
        out, state = ops.gated_linear_attention(
            q,
            k,
            v,
            log_decay=g,
            implementation=implementation,
            chunk_size=chunk_size_for(implementation, 4),
            return_state=True,
            segment_ids=SEGMENTS,
        )
        return out, state.s_BHFM

    return run


def _with_gradients(run, seen_BTHM, weights_BTHM):
    """(out, s, gradients of q, k, v and g of a loss that reads only the outputs not in
    `seen_BTHM`), as one compiled program."""

    def loss(*args):
        out, s = run(*args)
        return jnp.sum(jnp.where(seen_BTHM, 0.0, out * weights_BTHM)), (out, s)

    def run_and_differentiate(*args):
        (_, (out, s)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        return out, s, grads

    return unoptimised_jit(run_and_differentiate)


@pytest.mark.parametrize("shape", [(H,), (B, T, H), (B, T, H, D)], ids=["head", "step", "feature"])
def test_every_form_gives_the_stated_result_for_nan_inf_and_positive_decays(x64, shape):
    q, k, v, g = _inputs(shape)
    want_out, want_s = _recurrence(q, k, v, g)
    seen = ~np.isfinite(want_out)
    # What the recurrence says, spelled out: the NaN spoils example 0, head 0 from step 5 up to
    # its sequence's end; the positive decay example 1, head 0 from step 8; the -inf nothing.
    if len(shape) > 1:
        expected = np.zeros((B, T, H), bool)
        expected[0, 5:9, 0] = expected[1, 8:, 0] = True
        np.testing.assert_array_equal(seen, np.broadcast_to(expected[..., None], seen.shape))
    clean_g = np.where(np.isnan(g) | (g > 0), 0.0, g)
    weights = np.random.default_rng(1).standard_normal(want_out.shape)
    want_grads = _with_gradients(_op("reference"), seen, weights)(q, k, v, clean_g)[2]
    for implementation in IMPLEMENTATIONS:
        out, s, grads = _with_gradients(_op(implementation), seen, weights)(q, k, v, g)
        np.testing.assert_array_equal(np.isfinite(out), ~seen, err_msg=implementation)
        np.testing.assert_allclose(np.where(seen, 0, out), np.where(seen, 0, want_out), atol=1e-12)
        np.testing.assert_array_equal(np.isfinite(s), np.isfinite(want_s), err_msg=implementation)
        np.testing.assert_allclose(np.nan_to_num(s), np.nan_to_num(want_s), atol=1e-12)
        for name, got, want in zip("qkvg", grads, want_grads):
            assert np.isfinite(got).all(), (implementation, name)
            np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"{implementation}: d{name}")


def test_a_positive_decay_is_refused_eagerly_and_an_infinite_negative_one_is_not(float32_products):
    q, k, v, g = (x.astype(np.float32) for x in _inputs((B, T, H)))
    with pytest.raises(ValueError, match="log_decay must be <= 0.*largest value of 0.5"):
        ops.gated_linear_attention(q, k, v, log_decay=np.where(np.isnan(g), 0.0, g))
    out = ops.gated_linear_attention(q, k, v, log_decay=np.full((B, T, H), -np.inf, np.float32))
    # A reset at every step: each output reads its own key alone.
    want = np.einsum("bthd,bthd,bthm->bthm", q * D**-0.5, k, v)
    np.testing.assert_allclose(out, want, atol=1e-5)
