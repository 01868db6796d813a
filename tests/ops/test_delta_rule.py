"""`ops.delta_rule_attention`: every form against an independent NumPy recurrence (FLA's
`delta_rule_recurrence` written per step), values, final states and gradients, in float64, for
each decay shape (DeltaNet, Gated DeltaNet, KDA), with packed segments, padding and an initial
state; bad arguments named."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops
from linear_transformers.ops.delta_rule import chunked

B, T, H, D, M = 2, 13, 2, 4, 3
FORMS = ["reference", "scan", "chunked"]
DECAYS = ["none", "head", "step", "feature"]


def _numpy_delta_rule(q, k, v, beta, g, ids, s0, scale):
    """The recurrence as FLA's naive function writes it: S += k (beta (v - S^T k))^T, after the
    decay; S dropped where the segment id changes; id 0 writes nothing and reads 0."""
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * scale
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    out, s = np.zeros(v.shape), s0.copy()
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            if ids[b, t] == 0:
                continue
            if t > 0 and ids[b, t] != ids[b, t - 1]:
                s[b] = 0
            if g is not None:
                s[b] = np.exp(g[b, t])[..., None] * s[b]  # g [H, X]
            for h in range(q.shape[2]):
                correction = beta[b, t, h] * (v[b, t, h] - s[b, h].T @ k[b, t, h])
                s[b, h] = s[b, h] + np.outer(k[b, t, h], correction)
                out[b, t, h] = s[b, h].T @ q[b, t, h]
    return out, s


def _case(decay, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, H, D)) for _ in range(2))
    v = rng.standard_normal((B, T, H, M))
    beta = rng.uniform(0, 2, (B, T, H))
    shape = {"none": None, "head": (H,), "step": (B, T, H), "feature": (B, T, H, D)}[
        decay.removeprefix("strong ")
    ]
    # Strong decays: a chunk's exceed exp(30) from its midpoint, so the scores sum every pair's.
    low, high = (10.0, 40.0) if decay.startswith("strong") else (0.01, 1.0)
    g = None if shape is None else -rng.uniform(low, high, shape)
    ids = np.array([[1] * 5 + [2] * 6 + [0] * 2, [3] * 2 + [4] * 11])
    s0 = rng.standard_normal((B, H, D, M))
    return q, k, v, beta, g, ids, s0


def _per_step(g):
    if g is None:
        return None
    g = np.broadcast_to(g, (B, T, H)) if g.ndim == 1 else g
    return g if g.ndim == 4 else g[..., None]


@pytest.mark.parametrize("decay", [*DECAYS, "strong feature"])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_is_the_recurrence(x64, form, decay):
    q, k, v, beta, g, ids, s0 = _case(decay)
    want, want_s = _numpy_delta_rule(q, k, v, beta, _per_step(g), ids, s0, D**-0.5)
    got, state = ops.delta_rule_attention(
        *(jnp.asarray(x) for x in (q, k, v, beta)),
        log_decay=None if g is None else jnp.asarray(g),
        implementation=form,
        chunk_size=4,
        initial_state=ops.LinearState(jnp.asarray(s0), None),
        return_state=True,
        segment_ids=jnp.asarray(ids),
    )
    chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10)
    # Row 0 ends in padding: its state is that of its last segment.
    chex.assert_trees_all_close(state.s_BHFM, want_s, rtol=1e-10, atol=1e-10)
    assert state.z_BHF is None


@pytest.mark.parametrize("decay", ["none", "feature", "strong feature"])
@pytest.mark.parametrize("form", ["scan", "chunked"])
def test_gradients_equal_the_references(x64, form, decay):
    q, k, v, beta, g, ids, s0 = (None if x is None else jnp.asarray(x) for x in _case(decay, seed=1))
    lengths = jnp.array([11, 9])

    def loss(q, k, v, beta, g, s0, implementation):
        out, state = ops.delta_rule_attention(
            q, k, v, beta, log_decay=g, implementation=implementation, chunk_size=4,
            initial_state=ops.LinearState(s0, None), return_state=True, key_lengths=lengths,
            segment_ids=ids,
        )  # fmt: skip
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(state.s_BHFM))

    argnums = (0, 1, 2, 3, 5) if g is None else (0, 1, 2, 3, 4, 5)
    want = jax.grad(loss, argnums)(q, k, v, beta, g, s0, "reference")
    got = jax.grad(loss, argnums)(q, k, v, beta, g, s0, form)
    chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("decay", ["none", "step", "feature", "strong feature"])
def test_the_chunked_form_in_segments_is_the_recurrence_values_and_gradients(x64, monkeypatch, decay):
    """Segments of 5 steps (the CPU's outer loop, `chunked.segment_length`), chunks of 4 inside
    them: segments and chunks both padded, packed segments crossing them, an initial state. Per
    feature, weak decays take the factored scores and strong ones every pair on its own."""
    monkeypatch.setattr(chunked, "segment_length", lambda platform=None: 5)
    case = _case(decay, seed=4)
    want, want_s = _numpy_delta_rule(*case[:4], _per_step(case[4]), case[5], case[6], D**-0.5)
    q, k, v, beta, g, ids, s0 = (None if x is None else jnp.asarray(x) for x in case)
    lengths = jnp.array([11, 9])

    def attention(q, k, v, beta, g, s0, implementation, key_lengths=None):
        out, state = ops.delta_rule_attention(
            q, k, v, beta, log_decay=g, implementation=implementation, chunk_size=4,
            initial_state=ops.LinearState(s0, None), return_state=True, segment_ids=ids,
            key_lengths=key_lengths,
        )  # fmt: skip
        return out, state.s_BHFM

    chex.assert_trees_all_close(
        attention(q, k, v, beta, g, s0, "chunked"), (want, want_s), rtol=1e-10, atol=1e-10
    )

    def loss(*args):
        out, s = attention(*args, key_lengths=lengths)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(s))

    argnums = (0, 1, 2, 3, 5) if g is None else (0, 1, 2, 3, 4, 5)
    want = jax.grad(loss, argnums)(q, k, v, beta, g, s0, "reference")
    chex.assert_trees_all_close(
        jax.grad(loss, argnums)(q, k, v, beta, g, s0, "chunked"), want, rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("chunk_size,segment", [(4, None), (4, 8), (3, 8), (16, 5)])
def test_the_per_feature_scores_are_factored_where_every_chunk_fits(chunk_size, segment):
    """`chunked.fits_factored` (two sums per chunk) is the definition: |u| <= FACTOR_RANGE at
    every step of every chunk the form sees, u the log decay from the chunk's midpoint
    (`chunk_scores.from_midpoint`), chunks of C from each segment's start."""
    from linear_transformers.ops.gated_linear import chunk_scores

    def by_definition(g):
        L = g.shape[1] if segment is None else segment
        C = min(chunk_size, L)
        for start in range(0, g.shape[1], L):
            for chunk in range(start, min(start + L, g.shape[1]), C):
                g_C = g[:, chunk : min(chunk + C, start + L, g.shape[1])]
                g_C = np.pad(g_C, [(0, 0), (0, C - g_C.shape[1]), (0, 0), (0, 0)])
                if np.max(np.abs(chunk_scores.from_midpoint(jnp.asarray(g_C), axis=1))) > 30:
                    return False
        return True

    rng = np.random.default_rng(5)
    T_long = 21
    for trial in range(12):
        g = -rng.uniform(0, 3, (1, T_long, 2, 3))
        g[0, rng.integers(T_long), rng.integers(2), rng.integers(3)] = -rng.choice([25.0, 40.0, 1e4])
        want = by_definition(g)
        assert bool(chunked.fits_factored(jnp.asarray(g), chunk_size, segment)) == want, trial


def test_the_cpu_runs_small_chunks_in_segments_other_platforms_every_chunk_at_once():
    assert (chunked.default_chunk_size("cpu"), chunked.segment_length("cpu")) == (32, 256)
    for platform in ("gpu", "tpu"):
        assert (chunked.default_chunk_size(platform), chunked.segment_length(platform)) == (64, None)


def test_the_chunked_form_holds_in_float32_over_many_chunks():
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.standard_normal((1, 300, 2, 16)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 300, 2, 16)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (1, 300, 2)), jnp.float32)
    g = jnp.asarray(-rng.uniform(0, 0.2, (1, 300, 2)), jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(1, 7), 50)[None])
    with jax.default_matmul_precision("highest"):
        want = ops.delta_rule_attention(q, k, v, beta, log_decay=g, implementation="scan", segment_ids=ids)
        got = ops.delta_rule_attention(q, k, v, beta, log_decay=g, segment_ids=ids)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("segment", [None, 64], ids=["whole", "segments"])
@pytest.mark.parametrize("decay", ["none", "step", "feature"])
def test_the_chunked_backward_keeps_its_inputs_and_the_chunk_states_alone(monkeypatch, decay, segment):
    """What `jax.vjp` keeps for the backward pass of the chunked form (float32, T = 256 in chunks
    of 32, D = M = 4), the sequence at once (as on GPUs) or in segments of 64 steps (as on the
    CPU): the inputs and one [D, M] state per chunk (or segment) and head. The scores, inverses,
    U and W it recomputes are each a sequence-sized tensor or larger (kept, they were 19-34x the
    inputs here)."""
    monkeypatch.setattr(chunked, "segment_length", lambda platform=None: segment)
    rng = np.random.default_rng(3)
    shape = (1, 256, 2, 4)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    beta = jnp.asarray(rng.uniform(0, 1, shape[:3]), jnp.float32)
    g = {"none": None, "step": -rng.uniform(0, 0.2, shape[:3]), "feature": -rng.uniform(0, 0.2, shape)}[decay]
    inputs = (q, k, v, beta) + (() if g is None else (jnp.asarray(g, jnp.float32),))

    def attention(q, k, v, beta, g=None):
        return ops.delta_rule_attention(q, k, v, beta, log_decay=g, chunk_size=32)

    _, backward = jax.vjp(attention, *inputs)
    kept = sum(x.nbytes for x in jax.tree_util.tree_leaves(backward) if hasattr(x, "nbytes"))
    chunk_states = (256 // 32) * 2 * 4 * 4 * 4  # N chunks x H x D x M floats.
    assert kept <= sum(x.nbytes for x in inputs) + chunk_states + 1024, kept


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(beta=np.full((B, T, H), 2.5)), r"beta must be in \[0, 2\] .* got values in \[2.5, 2.5\]"),
        (dict(beta=np.ones((B, T))), r"beta must be \[B, T, H\]=\[2, 13, 2\]"),
        (dict(implementation="fast"), r"unknown implementation 'fast'"),
        (dict(log_decay=np.full((H,), 0.5)), r"log_decay must be <= 0"),
        (dict(initial_state=ops.init_linear_state(B, H, D, M)), r"initial_state shapes .* need .* z None"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    q, k, v = (jnp.ones((B, T, H, n)) for n in (D, D, M))
    beta = jnp.asarray(kwargs.pop("beta", np.ones((B, T, H))))
    kwargs = {key: jnp.asarray(x) if isinstance(x, np.ndarray) else x for key, x in kwargs.items()}
    with pytest.raises(ValueError, match="delta_rule_attention: " + message):
        ops.delta_rule_attention(q, k, v, beta, **kwargs)


@pytest.mark.parametrize("decay", DECAYS)
def test_steps_and_a_prefill_continue_the_parallel_form(x64, decay):
    q, k, v, beta, g, _, s0 = (None if x is None else jnp.asarray(x) for x in _case(decay, seed=3))
    state0 = ops.LinearState(s0, None)
    want, want_state = ops.delta_rule_attention(
        q, k, v, beta, log_decay=g, initial_state=state0, return_state=True, chunk_size=4
    )
    split = 6
    g_prefix = None if g is None or g.ndim == 1 else g[:, :split]
    state, prefix = ops.delta_rule_attention_prefill(
        state0,
        q[:, :split],
        k[:, :split],
        v[:, :split],
        beta[:, :split],
        log_decay=g if g_prefix is None else g_prefix,
    )
    outs = [prefix]
    for t in range(split, T):
        g_t = None if g is None else (g if g.ndim == 1 else g[:, t])
        state, out = ops.delta_rule_attention_step(
            state, q[:, t], k[:, t], v[:, t], beta[:, t], log_decay=g_t
        )
        outs.append(out[:, None])
    chex.assert_trees_all_close(jnp.concatenate(outs, 1), want, rtol=1e-10, atol=1e-10)
    chex.assert_trees_all_close(state.s_BHFM, want_state.s_BHFM, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("size", [6, 37])
def test_the_unit_lower_inverse_is_the_inverse_with_its_gradient(x64, size):
    """The chunk's (I + A)^-1 by substitution in blocks (not LAPACK's trsm, which can deadlock
    XLA's CPU pool): the inverse of NumPy's, and a gradient equal to finite differences. 37
    steps: three blocks of 16 merged, the last one padded."""
    from jax.test_util import check_grads

    from linear_transformers.ops.delta_rule.triangular import unit_lower_inverse

    a = 0.3 * np.random.default_rng(size).standard_normal((2, size, size))
    want = np.linalg.inv(np.eye(size) + np.tril(a, -1))
    chex.assert_trees_all_close(unit_lower_inverse(jnp.asarray(a)), want, rtol=1e-12, atol=1e-12)
    check_grads(unit_lower_inverse, (jnp.asarray(a),), order=1, modes=["rev"], eps=1e-6)
