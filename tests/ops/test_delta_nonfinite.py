"""The delta rule's one semantics for non-finite inputs, in every form: a log decay of -inf is a
reset (per head; per feature, of its row); a NaN one, or a positive one read under `jit`, makes
NaN every output of its head from its step to its segment's end and the final state it reaches;
a non-finite value, or entry of the initial state, its column alone (the state's columns never
mix). The gradients through the other outputs are finite and those of the finite inputs.

Legend: B batch, T time, H heads, D key/query features, M value features.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import unoptimised_jit

from linear_transformers import ops
from linear_transformers.ops.delta_rule import chunked

B, T, H, D, M = 2, 12, 2, 3, 2
# Example 0 holds two packed sequences: the second (steps 9..11) sees nothing of the first.
SEGMENTS = np.array([[1] * 9 + [2] * 3, [1] * T])


def _inputs(shape):
    """q, k, v, beta, log decays of `shape` and an initial state, with a NaN decay (example 0,
    step 5, head 0), a -inf (example 1, step 4, head 1) and a positive one (example 1, step 8,
    head 0); per head, head 0 NaN and head 1 -inf. A NaN value (example 0, step 10, head 1,
    column 1) and a NaN initial entry (example 1, head 1, row 1, column 0)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, H, n)) for n in (D, D, M))
    beta = rng.uniform(0, 2, (B, T, H))
    g = -rng.uniform(0.05, 0.5, shape)
    if len(shape) == 1:
        g[:] = [np.nan, -np.inf]
    else:
        g[0, 5, 0], g[1, 4, 1], g[1, 8, 0] = np.nan, -np.inf, 0.5
    v[0, 10, 1, 1] = np.nan
    s0 = rng.standard_normal((B, H, D, M))
    s0[1, 1, 1, 0] = np.nan
    return q, k, v, beta, g, s0


def _recurrence(q, k, v, beta, g, s0):
    """The recurrence in NumPy, where NaN spreads as arithmetic spreads it: exp(-inf) = 0
    multiplies the state, a segment's start drops it (after its step's decay)."""
    g = np.where(g > 0, np.nan, g)
    g = np.broadcast_to(g[None, None, :, None], (B, T, H, 1)) if g.ndim == 1 else g
    g = g[..., None] if g.ndim == 3 else g
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * D**-0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    s, outs = s0.copy(), []
    for t in range(T):
        s = np.exp(g[:, t])[..., None] * s
        if t:
            s = np.where((SEGMENTS[:, t] != SEGMENTS[:, t - 1])[:, None, None, None], 0.0, s)
        correction = beta[:, t, :, None] * (v[:, t] - np.einsum("bhd,bhdm->bhm", k[:, t], s))
        s = s + np.einsum("bhd,bhm->bhdm", k[:, t], correction)
        outs.append(np.einsum("bhd,bhdm->bhm", q[:, t], s))
    return np.stack(outs, axis=1), s


def _op(implementation):
    def run(q, k, v, beta, g, s0):
        out, state = ops.delta_rule_attention(
            q,
            k,
            v,
            beta,
            log_decay=g,
            implementation=implementation,
            chunk_size=4,
            initial_state=ops.LinearState(s0, None),
            return_state=True,
            segment_ids=SEGMENTS,
        )
        return out, state.s_BHFM

    return run


def _with_gradients(run, seen_BTHM, weights_BTHM):
    """(out, s, gradients of every input of a loss that reads only the outputs not in
    `seen_BTHM`), as one compiled program."""

    def loss(*args):
        out, s = run(*args)
        return jnp.sum(jnp.where(seen_BTHM, 0.0, out * weights_BTHM)), (out, s)

    def run_and_differentiate(*args):
        (_, (out, s)), grads = jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True)(*args)
        return out, s, grads

    return unoptimised_jit(run_and_differentiate)


@pytest.mark.parametrize("shape", [(H,), (B, T, H), (B, T, H, D)], ids=["head", "step", "feature"])
def test_every_form_gives_the_stated_result_for_non_finite_inputs(x64, monkeypatch, shape):
    q, k, v, beta, g, s0 = _inputs(shape)
    want_out, want_s = _recurrence(q, k, v, beta, g, s0)
    seen = ~np.isfinite(want_out)
    # What the recurrence says, spelled out (decays per step or feature): the NaN decay spoils
    # example 0, head 0 from step 5 to its sequence's end, the positive one example 1, head 0
    # from step 8, the -inf nothing; the NaN value column 1 of example 0, head 1 from step 10;
    # the initial entry column 0 of example 1, head 1 throughout.
    if len(shape) > 1:
        expected = np.zeros((B, T, H, M), bool)
        expected[0, 5:9, 0] = expected[1, 8:, 0] = expected[0, 10:, 1, 1] = expected[1, :, 1, 0] = True
        np.testing.assert_array_equal(seen, expected)
    clean_v, clean_g, clean_s0 = np.nan_to_num(v), np.where(np.isnan(g) | (g > 0), 0.0, g), np.nan_to_num(s0)
    weights = np.random.default_rng(1).standard_normal(want_out.shape)
    want_grads = _with_gradients(_op("reference"), seen, weights)(q, k, clean_v, beta, clean_g, clean_s0)[2]
    for implementation in ("reference", "scan", "chunked", "chunked in segments of 5"):
        with monkeypatch.context() as patch:  # Segments carry the guarded state from one to the next.
            patch.setattr(
                chunked, "segment_length", lambda platform=None: 5 if "segments" in implementation else None
            )
            run = _op(implementation.split()[0])
            out, s, grads = _with_gradients(run, seen, weights)(q, k, v, beta, g, s0)
        np.testing.assert_array_equal(np.isfinite(out), ~seen, err_msg=implementation)
        np.testing.assert_allclose(np.where(seen, 0, out), np.where(seen, 0, want_out), atol=1e-12)
        np.testing.assert_array_equal(np.isfinite(s), np.isfinite(want_s), err_msg=implementation)
        np.testing.assert_allclose(np.nan_to_num(s), np.nan_to_num(want_s), atol=1e-12)
        for name, got, want in zip(("q", "k", "v", "beta", "g", "s0"), grads, want_grads):
            assert np.isfinite(got).all(), (implementation, name)
            np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"{implementation}: d{name}")


@pytest.mark.parametrize("implementation", ["scan", "chunked"])
def test_a_decay_of_zero_is_a_reset_in_float32(implementation, float32_products):
    """-inf at every step: each output reads its own key alone (beta v, projected on q), with no
    precision lost to the floor the forms read -inf as (float32 products: TF32's would lose
    1e-3 of their own)."""
    q, k, v, beta, _, _ = (x.astype(np.float32) for x in _inputs((B, T, H)))
    v = np.nan_to_num(v)
    out = ops.delta_rule_attention(
        q, k, v, beta, log_decay=np.full((B, T, H), -np.inf, np.float32), implementation=implementation
    )
    q_n, k_n = (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6) for x in (q, k))
    want = np.einsum("bthd,bthd,bth,bthm->bthm", q_n * D**-0.5, k_n, beta, v)
    np.testing.assert_allclose(out, want, atol=1e-6)
