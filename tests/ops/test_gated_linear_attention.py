"""Gated linear attention: every impl, the step and the prefill equal a plain numpy recurrence
(values and gradients), for every decay shape, with segments, padding and a starting state;
strong decays stay finite and exact.

Legend: B batch, T time, H heads, D key/query features, M value features.
"""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops

B, T, H, D, M = 2, 13, 2, 3, 4
DECAYS = ["none", "head", "step", "feature"]
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0, 3, 3, 3, 3], [4] * 6 + [5] * 6 + [0]])
LENGTHS = np.array([T, 10])


def _decay(kind, rng, shape=(B, T, H), strength=2.0):
    if kind == "none":
        return None
    if kind == "head":
        return -rng.uniform(0, strength, size=(H,))
    if kind == "step":
        return -rng.uniform(0, strength, size=shape)
    return -rng.uniform(0, strength, size=shape + (D,))


def _per_step(g):
    """g as [B, T, H, X] (X = 1 or D)."""
    if g is None:
        return None
    if g.ndim == 1:
        return np.broadcast_to(g[None, None, :, None], (B, T, H, 1))
    return g[..., None] if g.ndim == 3 else g


def numpy_recurrence(q, k, v, g, *, scale, normalize, s0, z0, segment_ids=None, key_lengths=None, eps=1e-6):
    """The definition, one step at a time in float64: decay, drop the state where a segment
    begins, add the key; padding (index >= key_lengths, segment 0) changes nothing."""
    g = _per_step(g)
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    s_final, z_final = [], []
    for b in range(q.shape[0]):
        s, z = np.array(s0[b], np.float64), None if z0 is None else np.array(z0[b], np.float64)
        previous = None if segment_ids is None else segment_ids[b, 0]
        for t in range(q.shape[1]):
            valid = (key_lengths is None or t < key_lengths[b]) and (
                segment_ids is None or segment_ids[b, t] != 0
            )
            if valid:
                if segment_ids is not None and segment_ids[b, t] != previous:
                    s, z = 0 * s, None if z is None else 0 * z
                if segment_ids is not None:
                    previous = segment_ids[b, t]
                if g is not None:
                    a = np.exp(g[b, t])  # [H, X]
                    s = a[:, :, None] * s
                    z = None if z is None else a * z
                s = s + k[b, t][:, :, None] * v[b, t][:, None, :]
                z = None if z is None else z + k[b, t]
            num = np.einsum("hf,hfm->hm", scale * q[b, t], s)
            out[b, t] = num if z is None else num / (np.einsum("hf,hf->h", scale * q[b, t], z) + eps)[:, None]
        s_final.append(s)
        z_final.append(z)
    return out, np.stack(s_final), None if z0 is None else np.stack(z_final)


def _case(seed, decay, normalize):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, T, H, D))
    if normalize:  # the normaliser needs non-negative features
        q, k = np.abs(q), np.abs(k)
    v = rng.standard_normal((B, T, H, M))
    s0 = rng.standard_normal((B, H, D, M))
    z0 = np.abs(rng.standard_normal((B, H, D))) if normalize else None
    return q, k, v, _decay(decay, rng), s0, z0


def _valid(segment_ids, key_lengths):
    valid = np.ones((B, T), bool)
    if segment_ids is not None:
        valid &= segment_ids != 0
    if key_lengths is not None:
        valid &= np.arange(T)[None] < key_lengths[:, None]
    return valid


def _run(q, k, v, g, s0, z0, **kw):
    state = ops.LinearState(jnp.asarray(s0), None if z0 is None else jnp.asarray(z0))
    return ops.gated_linear_attention(
        jnp.asarray(q),
        jnp.asarray(k),
        jnp.asarray(v),
        log_decay=None if g is None else jnp.asarray(g),
        initial_state=state,
        return_state=True,
        **kw,
    )


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize(
    "impl,chunk_size",
    [
        ("reference", None),
        ("associative_scan", None),
        ("scan", None),
        ("chunked", 4),
        ("chunked", None),
        ("pallas", None),
    ],
)
def test_every_impl_equals_the_numpy_recurrence(x64, decay, impl, chunk_size):
    for normalize, packed in itertools.product((False, True), (False, True)):
        q, k, v, g, s0, z0 = _case(0, decay, normalize)
        segment_ids, key_lengths = (SEGMENTS, LENGTHS) if packed else (None, None)
        want, want_s, want_z = numpy_recurrence(
            q,
            k,
            v,
            g,
            scale=0.7,
            normalize=normalize,
            s0=s0,
            z0=z0,
            segment_ids=segment_ids,
            key_lengths=key_lengths,
        )
        out, state = _run(
            q,
            k,
            v,
            g,
            s0,
            z0,
            scale=0.7,
            normalize=normalize,
            implementation=impl,
            chunk_size=chunk_size,
            segment_ids=None if segment_ids is None else jnp.asarray(segment_ids),
            key_lengths=None if key_lengths is None else jnp.asarray(key_lengths),
        )
        valid = _valid(segment_ids, key_lengths)
        np.testing.assert_allclose(np.asarray(out)[valid], want[valid], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(state.s_BHFM, want_s, rtol=1e-10, atol=1e-10)
        if normalize:
            np.testing.assert_allclose(state.z_BHF, want_z, rtol=1e-10, atol=1e-10)
        else:
            assert state.z_BHF is None


@pytest.mark.parametrize("decay", DECAYS)
def test_gradients_of_every_impl_equal_the_quadratic_reference(x64, decay):
    """W.r.t. q, k, v, the log decays and the initial state, through outputs and final state."""
    q, k, v, g, s0, _ = _case(1, decay, False)
    g = jnp.zeros((H,)) if g is None else jnp.asarray(g)  # a zero decay is no decay: its gradient counts
    ids = jnp.asarray(SEGMENTS)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, H, M)))

    def loss(q, k, v, g, s0, impl):
        out, state = ops.gated_linear_attention(
            q,
            k,
            v,
            log_decay=g,
            implementation=impl,
            chunk_size=4,
            initial_state=ops.LinearState(s0, None),
            return_state=True,
            segment_ids=ids,
        )
        return jnp.sum(jnp.sin(out) * w) + jnp.sum(state.s_BHFM**2)

    args = tuple(jnp.asarray(x) for x in (q, k, v)) + (g, jnp.asarray(s0))
    # Compiled (one program per impl) rather than op by op: eager gradients of the scans are slow.
    grad = jax.jit(jax.grad(loss, argnums=range(5)), static_argnums=5)
    want = grad(*args, "reference")
    for impl in ("associative_scan", "chunked", "scan"):
        got = grad(*args, impl)
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


def test_chunked_gradients_match_numerical_derivatives(x64):
    """Independent of the quadratic reference: finite differences of the chunked form itself."""
    q, k, v, g, s0, _ = _case(3, "feature", False)
    ids = jnp.asarray(SEGMENTS)
    jax.test_util.check_grads(
        lambda q, k, v, g, s0: ops.gated_linear_attention(
            q, k, v, log_decay=g, chunk_size=4, initial_state=ops.LinearState(s0, None), segment_ids=ids
        ),
        tuple(jnp.asarray(x) for x in (q, k, v, g, s0)),
        order=1,
        modes=("rev",),
    )


@pytest.mark.parametrize("decay", ["step", "feature"])
def test_strong_decays_stay_finite_and_exact_at_chunk_64(decay, float32_products):
    """Log decays down to -10 per step at chunk 64: factors like exp(-640) inside a chunk, never
    exp(+640); float32 and bfloat16 inputs against a float64 recurrence of the same inputs, with
    float32 matrix products (TF32's tolerance: tests/ops/test_default_precision.py)."""
    rng = np.random.default_rng(4)
    T_long = 150
    q, k, v = (rng.standard_normal((B, T_long, H, D)) for _ in range(3))
    g = -rng.uniform(0, 10, size=(B, T_long, H) + ((D,) if decay == "feature" else ()))
    g[:, :70] = -10.0  # the whole first chunk at the strongest decay
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)):
        inputs = [jnp.asarray(x, dtype) for x in (q, k, v)]
        out = ops.gated_linear_attention(*inputs, log_decay=jnp.asarray(g, jnp.float32), chunk_size=64)
        assert out.dtype == dtype
        exact = [np.asarray(x, np.float64) for x in inputs]  # the same (rounded) inputs
        g32 = np.asarray(np.float32(g), np.float64)
        want, _, _ = numpy_recurrence(
            *exact, g32, scale=D**-0.5, normalize=False, s0=np.zeros((B, H, D, D)), z0=None
        )
        got = np.asarray(out, np.float64)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("decay", DECAYS)
def test_steps_and_prefills_equal_one_parallel_call(x64, decay):
    q, k, v, g, s0, _ = _case(5, decay, False)
    q, k, v, s0 = (jnp.asarray(x) for x in (q, k, v, s0))
    g = None if g is None else jnp.asarray(g)
    start = ops.LinearState(s0, None)
    want, want_state = ops.gated_linear_attention(
        q, k, v, log_decay=g, initial_state=start, return_state=True
    )

    def decay_at(t):
        return None if g is None or g.ndim == 1 else g[:, t]

    state, outs = start, []
    for t in range(T):
        state, out_t = ops.gated_linear_attention_step(
            state, q[:, t], k[:, t], v[:, t], log_decay=g if g is not None and g.ndim == 1 else decay_at(t)
        )
        outs.append(out_t)
    chex.assert_trees_all_close(jnp.stack(outs, 1), want, rtol=1e-10, atol=1e-10)
    chex.assert_trees_all_close(state, want_state, rtol=1e-10, atol=1e-10)

    def block(lo, hi):
        return (q[:, lo:hi], k[:, lo:hi], v[:, lo:hi]), None if g is None or g.ndim == 1 else g[:, lo:hi]

    (qkv1, g1), (qkv2, g2) = block(0, 6), block(6, T)
    state, out1 = ops.gated_linear_attention_prefill(
        start, *qkv1, log_decay=g if g1 is None else g1, chunk_size=4
    )
    state, out2 = ops.gated_linear_attention_prefill(
        state, *qkv2, log_decay=g if g2 is None else g2, chunk_size=4
    )
    chex.assert_trees_all_close(jnp.concatenate([out1, out2], 1), want, rtol=1e-10, atol=1e-10)
    chex.assert_trees_all_close(state, want_state, rtol=1e-10, atol=1e-10)


def test_prefill_after_a_packed_block_continues_its_last_segment(x64):
    """The state a packed block leaves is its last segment's: the steps after it equal the steps
    after that segment alone."""
    q, k, v, g, _, _ = _case(6, "step", False)
    q, k, v, g = (jnp.asarray(x) for x in (q, k, v, g))
    ids = jnp.asarray([[1] * 5 + [2] * 8, [3] * 9 + [4] * 4])
    zero = ops.init_linear_state(B, H, D, M, jnp.float64, normalizer=False)
    state, _ = ops.gated_linear_attention_prefill(
        zero, q[:, :-1], k[:, :-1], v[:, :-1], log_decay=g[:, :-1], segment_ids=ids[:, :-1]
    )
    _, got = ops.gated_linear_attention_step(state, q[:, -1], k[:, -1], v[:, -1], log_decay=g[:, -1])
    for b, start in ((0, 5), (1, 9)):
        alone = ops.gated_linear_attention(
            *(x[b : b + 1, start:] for x in (q, k, v)), log_decay=g[b : b + 1, start:]
        )
        chex.assert_trees_all_close(got[b], alone[0, -1], rtol=1e-10, atol=1e-10)


def test_causal_linear_attention_is_the_undecayed_normalised_elu_case(x64):
    q, k, v, _, s0, z0 = _case(7, "none", True)
    want, want_state = _run(q, k, v, None, s0, z0, feature_map="elu", normalize=True, scale=1.0)
    state = ops.LinearState(jnp.asarray(s0), jnp.asarray(z0))
    got, got_state = ops.causal_linear_attention(
        *(jnp.asarray(x) for x in (q, k, v)), initial_state=state, return_state=True
    )
    chex.assert_trees_all_close((got, got_state), (want, want_state), rtol=1e-12, atol=1e-12)


def test_a_scale_array_is_differentiated_in_every_impl(x64):
    """A learned scale (traced under `jit`): its gradient in every impl (the Pallas kernel's
    applied before the kernel) equals the reference's, which equals a central difference. (A
    normaliser divides the scale out but for eps: a large eps keeps its gradient large.)"""
    q, k, v, g = (jnp.asarray(x) for x in _case(4, "step", False)[:4])

    def loss(scale, impl):
        out = ops.gated_linear_attention(
            q, k, v, log_decay=g, scale=scale, feature_map="elu", normalize=True, eps=0.5, implementation=impl
        )
        return jnp.sum(jnp.sin(out))

    value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    scale, h = jnp.asarray(0.7), 1e-5
    want = value_and_grad(scale, "reference")
    reference = jax.jit(loss, static_argnums=1)
    difference = (reference(scale + h, "reference") - reference(scale - h, "reference")) / (2 * h)
    np.testing.assert_allclose(want[1], difference, rtol=1e-7)
    assert abs(want[1]) > 1e-2
    for impl in ("associative_scan", "chunked", "scan", "pallas"):
        chex.assert_trees_all_close(value_and_grad(scale, impl), want, rtol=1e-9, atol=1e-12)


BAD = [
    (dict(log_decay=np.zeros((H + 1,))), r"log_decay must be \[H\]=\[2\]"),
    (dict(log_decay=np.zeros((B, T))), r"log_decay must be .* got shape \(2, 13\)"),
    (dict(log_decay=np.full((H,), 0.5)), r"log_decay must be <= 0 .* largest value of 0.5"),
    (dict(log_decay=np.zeros((H,), np.int32)), r"log_decay must be a floating-point array"),
    (
        dict(segment_ids=np.zeros((B, T), np.float32)),
        r"segment_ids must be an integer array of shape \(2, 13\)",
    ),
    (
        dict(segment_ids=np.array([[1] * 5 + [2] * 4 + [1] * 4] * 2)),
        r"segment id 1 comes back after another id",
    ),
    (dict(segment_ids=np.full((B, T), -1)), r"segment_ids must be >= 0"),
    (dict(normalize=1), r"normalize must be a bool"),
    (dict(implementation="fast"), r"unknown implementation 'fast'"),
    (dict(initial_state=ops.init_linear_state(B, H, D, M)), r"initial_state shapes .* need .* z None"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_arguments_are_named(kwargs, message):
    q, k, v = (jnp.ones((B, T, H, n)) for n in (D, D, M))
    kwargs = {
        key: jnp.asarray(value) if isinstance(value, np.ndarray) else value for key, value in kwargs.items()
    }
    with pytest.raises(ValueError, match="gated_linear_attention: " + message):
        ops.gated_linear_attention(q, k, v, **kwargs)


def test_a_steps_decay_is_named_in_the_steps_shapes():
    state = ops.init_linear_state(B, H, D, M, normalizer=False)
    q, k, v = (jnp.ones((B, H, n)) for n in (D, D, M))
    step = ops.gated_linear_attention_step
    for shape in ((H,), (B, H), (B, H, D)):
        step(state, q, k, v, log_decay=-jnp.ones(shape))
    with pytest.raises(ValueError, match=r"\[B, H\]=\[2, 2\] \(per head\) .* got shape \(2, 1, 2\)"):
        step(state, q, k, v, log_decay=jnp.zeros((B, 1, H)))


@pytest.mark.parametrize("strength,factored", [(1.0, True), (12.0, False)])
def test_per_feature_decays_take_either_form_exactly(x64, strength, factored):
    """Per-feature decays within a chunk: one matmul of rescaled q and k while the decays stay
    within exp(+-30) of the chunk's midpoint, else blocks of 8 steps pair by pair and factors
    <= 1 between them. Both equal the dense reference, values and gradients."""
    from linear_transformers.ops.gated_linear import chunk_scores

    rng = np.random.default_rng(8)
    T_chunks = 32  # two chunks of 16: blocks of 8 inside each
    q, k, v = (jnp.asarray(rng.standard_normal((B, T_chunks, H, n))) for n in (D, D, M))
    g = jnp.asarray(-rng.uniform(0, strength, size=(B, T_chunks, H, D)))
    chunks = jnp.swapaxes(g, 1, 2).reshape(B, H, 2, 16, D)
    assert bool(chunk_scores.fits_factored(chunk_scores.from_midpoint(chunks, axis=3))) == factored

    def loss(q, k, v, g, impl):
        out = ops.gated_linear_attention(q, k, v, log_decay=g, implementation=impl, chunk_size=16)
        return jnp.sum(jnp.sin(out)), out

    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=range(4), has_aux=True), static_argnums=4)
    (_, got), got_grads = value_and_grad(q, k, v, g, "chunked")
    (_, want), want_grads = value_and_grad(q, k, v, g, "reference")
    chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-12)
    chex.assert_trees_all_close(got_grads, want_grads, rtol=1e-9, atol=1e-11)
