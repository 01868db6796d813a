"""The "pallas" form (`ops/gated_linear/pallas.py`): its kernels, run by Pallas's interpreter
on the CPU (on a GPU, as Triton kernels), equal the dense reference over several chunks, in
values and gradients, for every decay shape with segments, key lengths, a starting state, a
normaliser and sizes that are not powers of two; strong decays stay exact; bfloat16 inputs keep
float32 states; and both kernels lower to Triton for CUDA on any machine.

Legend: B batch, T time, H heads, D key/query features, M value features.
"""

import functools
import re

import chex
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import tf32

from experiments.benchmarking import kernel_resources
from linear_transformers import ops
from linear_transformers.ops.gated_linear import pallas

B, T, H, D, M = 2, 40, 2, 3, 5  # three chunks of 16, the last one partly padding
CHUNK = 16
# Segments that cross chunk boundaries, padding (0) inside a chunk, one row a single segment.
SEGMENTS = np.array([[1] * 10 + [2] * 17 + [0] * 3 + [3] * 10, [4] * 33 + [5] * 7])
LENGTHS = np.array([T, 29])


def _inputs(seed, decay, *, normalize):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, T, H, D)), rng.standard_normal((B, T, H, D))
    v = rng.standard_normal((B, T, H, M))
    g = {
        "none": None,
        "head": -rng.uniform(0, 1, size=(H,)),
        "step": -rng.uniform(0, 1, size=(B, T, H)),
        "feature": -rng.uniform(0, 1, size=(B, T, H, D)),
    }[decay]
    s0 = rng.standard_normal((B, H, D, M))
    z0 = rng.uniform(0, 1, size=(B, H, D)) if normalize else None
    w = rng.standard_normal((B, T, H, M))
    return tuple(None if x is None else jnp.asarray(x) for x in (q, k, v, g, s0, z0, w))


def _loss(implementation, q, k, v, g, s0, z0, w, *, normalize, packed):
    out, state = ops.gated_linear_attention(
        q,
        k,
        v,
        log_decay=g,
        normalize=normalize,
        feature_map="elu" if normalize else None,
        implementation=implementation,
        chunk_size=CHUNK if implementation == "pallas" else None,
        initial_state=ops.LinearState(s0, z0),
        return_state=True,
        segment_ids=jnp.asarray(SEGMENTS) if packed else None,
        key_lengths=jnp.asarray(LENGTHS) if packed else None,
    )
    z_term = 0.0 if z0 is None else jnp.sum(jnp.cos(state.z_BHF))
    return jnp.sum(jnp.sin(out) * w) + jnp.sum(state.s_BHFM**2) + z_term, (out, state)


def _primals_and_loss(seed, decay, *, normalize, packed):
    """The primals (q, k, v[, g], s0[, z0]) of `_inputs`, and `_loss(implementation, *primals)`."""
    q, k, v, g, s0, z0, w = _inputs(seed, decay, normalize=normalize)

    def loss(implementation, *args):
        it = iter(args)
        q, k, v = next(it), next(it), next(it)
        g_ = None if g is None else next(it)
        s0_, z0_ = next(it), None if z0 is None else next(it)
        return _loss(implementation, q, k, v, g_, s0_, z0_, w, normalize=normalize, packed=packed)

    return [x for x in (q, k, v, g, s0, z0) if x is not None], loss


@pytest.mark.parametrize("decay", ["none", "head", "step", "feature"])
@pytest.mark.parametrize("normalize,packed", [(False, True), (True, False)])
def test_values_and_gradients_equal_the_dense_reference(x64, decay, normalize, packed):
    """W.r.t. q, k, v, the log decays and the initial state (s and z), through the outputs and
    the final state, in float64."""
    primals, loss = _primals_and_loss(0, decay, normalize=normalize, packed=packed)

    grad = jax.jit(
        jax.value_and_grad(loss, argnums=tuple(range(1, len(primals) + 1)), has_aux=True), static_argnums=0
    )
    (_, want), want_grads = grad("reference", *primals)
    (_, got), got_grads = grad("pallas", *primals)
    chex.assert_trees_all_close(got, want, rtol=1e-10, atol=1e-10)
    chex.assert_trees_all_close(got_grads, want_grads, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "decay,normalize,packed,launch",
    [
        ("none", False, True, {}),
        ("step", True, False, {}),
        ("feature", False, True, {"split_backward": False}),
        ("none", True, False, {"walks": 3}),
        ("step", True, True, {"walks": 2}),
        ("feature", False, False, {"walks": 2}),
    ],
)
def test_the_parallel_forward_and_backward_give_the_same_result(x64, decay, normalize, packed, launch):
    """`Tuning.parallel_forward`: the states entering every chunk first, then every chunk's
    output at once; `Tuning.parallel_backward`: the states entering every chunk and the
    cotangents of those leaving it first, then every chunk's gradients at once (dq in programs
    of their own, or with dk and dv). With `walks`, the three chunks walked in stretches of one
    chunk each or of two and one, each from zero, joined after (no factors; those of segments
    and a decay per step; a decay per feature's). Values, final states and gradients (the initial
    states' included) equal the dense reference in float64."""
    primals, loss = _primals_and_loss(3, decay, normalize=normalize, packed=packed)

    grad = jax.value_and_grad(loss, argnums=tuple(range(1, len(primals) + 1)), has_aux=True)
    want = grad("reference", *primals)
    with pallas.tuning(parallel_forward=True, parallel_backward=True, **launch):
        got = grad("pallas", *primals)
    chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "decay,normalize,packed,launch",
    [
        ("none", True, False, {"walks": 3}),
        ("step", True, True, {"walks": 2}),
        ("feature", False, False, {"walks": 2}),
        ("head", False, True, {"walks": 3, "split_backward": False}),
        ("step", True, True, {"walks": 2, "split_key_value": True, "parallel_forward": True}),
    ],
)
def test_the_one_pass_kernels_walk_in_stretches_too(x64, decay, normalize, packed, launch):
    """`Tuning.walks` without a parallel form: a kernel walks each stretch from zero, writing
    only its final states and total factor; XLA joins them; then each stretch's program of
    the one-pass kernel walks it from the states entering it (forward), or the backward's
    passes from the states entering it and the cotangents of those leaving it. Three chunks
    in stretches of one or of two and one: no factors, segments and a decay per step, a decay
    per feature, a decay per head with the backward's passes in one program, and dq, dk and
    dv apart after the parallel forward. Values, final states and gradients (the initial
    states' included) equal the dense reference in float64."""
    primals, loss = _primals_and_loss(8, decay, normalize=normalize, packed=packed)

    grad = jax.value_and_grad(loss, argnums=tuple(range(1, len(primals) + 1)), has_aux=True)
    want = grad("reference", *primals)
    with pallas.tuning(**launch):
        got = grad("pallas", *primals)
    chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("parallel", [False, True], ids=["one-pass", "parallel"])
def test_dq_dk_and_dv_in_programs_of_their_own_give_the_same_result(x64, parallel):
    """`Tuning.split_key_value`: the backward's dk and dv in programs of their own, each walking
    back with the states' cotangents (the one that gives dk also writes the initial states'):
    values, final states and gradients equal the dense reference in float64."""
    primals, loss = _primals_and_loss(6, "step", normalize=True, packed=True)
    grad = jax.value_and_grad(loss, argnums=tuple(range(1, len(primals) + 1)), has_aux=True)
    want = grad("reference", *primals)
    with pallas.tuning(split_key_value=True, parallel_forward=parallel, parallel_backward=parallel):
        got = grad("pallas", *primals)
    chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "decay,launch,normalize",
    [
        ("none", {"split_backward": False}, False),
        ("feature", {}, False),
        ("step", {}, True),
        ("step", {"parallel_backward": True}, True),
        ("feature", {"split_key_value": True}, True),
        ("step", {"walks": 2}, True),
    ],
    ids=[
        "one-program",
        "two-programs",
        "two-programs-normalised",
        "parallel-normalised",
        "three-programs",
        "walks-normalised",
    ],
)
def test_a_grid_over_value_blocks_gives_the_same_result(x64, decay, launch, normalize):
    """With programs of 16 value features (M = 20: two blocks, the second mostly padding), each
    backward program's part of dq, dk and the decays' cotangent sums to the whole, the
    normaliser's part counted once, with the backward's passes in one program, in two (the
    default, which every other test runs), in three (dq, dk and dv apart), in parallel, or
    in two for each walk over a stretch of the sequence (three chunks in walks of two and
    one): values and gradients equal the dense reference in float64."""
    rng = np.random.default_rng(5)
    q, k = (jnp.asarray(rng.standard_normal((1, 40, 2, 3))) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 40, 2, 20)))
    g = {"none": None, "step": (1, 40, 2), "feature": (1, 40, 2, 3)}[decay]
    g = None if g is None else jnp.asarray(-rng.uniform(0, 1, size=g))
    segments = jnp.asarray(SEGMENTS[:1])

    def loss(q, k, v, g, implementation):
        out, state = ops.gated_linear_attention(
            q,
            k,
            v,
            log_decay=g,
            normalize=normalize,
            feature_map="elu" if normalize else None,
            implementation=implementation,
            segment_ids=segments,
            return_state=True,
        )
        z_term = 0.0 if state.z_BHF is None else jnp.sum(jnp.cos(state.z_BHF))
        return jnp.sum(jnp.sin(out)) + jnp.sum(state.s_BHFM**2) + z_term

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2) if g is None else (0, 1, 2, 3))
    want = grad(q, k, v, g, "reference")
    with pallas.tuning(value_block=16, **launch):
        got = grad(q, k, v, g, "pallas")
    chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-9)


def test_numpy_float64_inputs_without_x64_run_as_float32():
    """JAX reads NumPy's float64 as float32 where x64 is off, and so does the op's accumulation:
    the parallel forward's states, written in it, are float32 too (they were float64 buffers
    given float32 values, which Pallas refuses)."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 20, 1, 3)) for _ in range(3))
    g = -rng.uniform(0, 1, (1, 20, 1))
    with pallas.tuning(parallel_forward=True):
        got = ops.gated_linear_attention(q, k, v, log_decay=g, implementation="pallas", chunk_size=CHUNK)
        want = ops.gated_linear_attention(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
            log_decay=jnp.asarray(g, jnp.float32),
            implementation="pallas",
            chunk_size=CHUNK,
        )
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("decay", ["step", "feature"])
def test_bfloat16_inputs_with_a_float64_state_accumulate_in_float64(x64, decay):
    """A float64 initial state makes the op accumulate in float64 (`input_checks`); the kernels
    then multiply in float64 too, not in bfloat16 (whose products sum in float32): the output,
    final state and gradients equal the dense reference's on the same inputs in float64. (A
    scale of 1: the XLA forms scale bfloat16 queries in bfloat16, the kernels in float64.)"""
    q, k, v, g, s0, _, w = _inputs(5, decay, normalize=False)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))

    def loss(q, k, v, g, s0, implementation):
        out, state = ops.gated_linear_attention(
            q,
            k,
            v,
            log_decay=g,
            scale=1.0,
            implementation=implementation,
            chunk_size=CHUNK if implementation == "pallas" else None,
            initial_state=ops.LinearState(s0, None),
            return_state=True,
        )
        return jnp.sum(jnp.sin(out) * w) + jnp.sum(state.s_BHFM**2), (out, state)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
    (value, (out, state)), grads = grad(q, k, v, g, s0, "pallas")
    (want_value, (want_out, want_state)), want_grads = grad(q, k, v, g, s0, "reference")
    assert out.dtype == jnp.bfloat16 and state.s_BHFM.dtype == jnp.float64
    # The output is bfloat16, rounded from equal float64 values.
    chex.assert_trees_all_close((value, out, state), (want_value, want_out, want_state), rtol=1e-9, atol=1e-9)
    chex.assert_trees_all_close(grads[3:], want_grads[3:], rtol=1e-9, atol=1e-9)  # dg, ds0
    # q, k and v's cotangents are bfloat16, where the reference's XLA gradient sums some parts
    # in bfloat16: within a rounding of their scale.
    for got_x, want_x in zip(grads[:3], want_grads[:3]):
        got_x, want_x = np.asarray(got_x, np.float64), np.asarray(want_x, np.float64)
        np.testing.assert_allclose(got_x, want_x, rtol=0, atol=8e-3 * np.abs(want_x).max())


@pytest.mark.parametrize("parallel", [False, True], ids=["one-pass", "parallel"])
def test_every_walk_reports_the_non_finite_values_it_reads(parallel):
    """With walks (`Tuning.walks`) and value blocks, each program of the one-pass forward, or
    of the parallel forward's states kernel, reports whether the v and decays it read were
    finite, in a flag of its own: a NaN v read only by the first of three walks, in the second
    value block, makes NaN the outputs the guard says (its column, from its step on) and
    nothing else."""
    rng = np.random.default_rng(9)
    q, k = (rng.standard_normal((1, 40, 2, 3)) for _ in range(2))
    v = rng.standard_normal((1, 40, 2, 20))
    v[0, 5, 1, 17] = np.nan
    g = -rng.uniform(0, 1, (1, 40, 2))
    with pallas.tuning(value_block=16, parallel_forward=parallel, walks=3):
        out = ops.gated_linear_attention(q, k, v, log_decay=g, implementation="pallas", chunk_size=CHUNK)
    seen = np.zeros(out.shape, bool)
    seen[0, 5:, 1, 17] = True
    np.testing.assert_array_equal(np.isnan(out), seen)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"value_block": 8}, "value_block must be a power of two >= 16 or None, got 8"),
        ({"value_block": 48}, "value_block must be a power of two >= 16 or None, got 48"),
        ({"num_warps": 6}, r"num_warps must be a power of two from 1 to 32 \(Triton's\), got 6"),
        ({"num_stages": 0}, "num_stages must be >= 1, got 0"),
        ({"parallel_forward": "yes"}, "parallel_forward must be True or False, got 'yes'"),
        ({"parallel_backward": 1}, "parallel_backward must be True or False, got 1"),
        ({"split_key_value": 1}, "split_key_value must be True or False, got 1"),
        (
            {"split_key_value": True, "split_backward": False},
            r"split_key_value=True needs split_backward=True \(dq in programs of its own\)",
        ),
        ({"walks": 0}, "walks must be an int >= 1, got 0"),
        ({"walks": True}, "walks must be an int >= 1, got True"),
    ],
)
def test_launch_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        with pallas.tuning(**options):
            pass


@pytest.mark.parametrize("strength,factored", [(1.0, True), (12.0, False)])
def test_per_feature_decays_take_either_form_exactly(x64, strength, factored):
    """Per feature, a chunk's scores are one matmul of q and k rescaled from its midpoint where
    its decays stay within exp(+-30) of it, else every pair's decay on its own (a loop over the
    chunk's keys): values and gradients equal the reference in float64 either way, with a
    segment that begins inside a chunk."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 1, 4))) for _ in range(3))
    g = jnp.asarray(-rng.uniform(0, strength, size=(1, 64, 1, 4)))
    segments = jnp.asarray([[1] * 20 + [2] * 44])
    # The largest sum of log decays from a chunk's midpoint m = 16 (chunks of 32), either way.
    chunks = np.asarray(g).reshape(2, 32, 4)
    spread = max(max(np.abs(c[17:].sum(0)).max(), np.abs(c[1:17].sum(0)).max()) for c in chunks)
    assert pallas.DEFAULT_CHUNK_SIZE == 32 and (spread <= 30) == factored

    def loss(q, k, v, g, implementation):
        out = ops.gated_linear_attention(
            q, k, v, log_decay=g, implementation=implementation, segment_ids=segments
        )
        return jnp.sum(jnp.sin(out))

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    chex.assert_trees_all_close(
        grad(q, k, v, g, "pallas"), grad(q, k, v, g, "reference"), rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("decay,chunk", [("step", 64), ("feature", 64)])
def test_strong_decays_stay_finite_and_exact(decay, chunk, float32_products):
    """Log decays of -10 per step over whole chunks (sums down to -640 within one): in float32
    as exact as the float64 reference of the same inputs."""
    rng = np.random.default_rng(1)
    n = 150
    q, k, v = (jnp.asarray(rng.standard_normal((1, n, H, 4)), jnp.float32) for _ in range(3))
    g = -rng.uniform(0, 10, size=(1, n, H) + ((4,) if decay == "feature" else ()))
    g[:, :70] = -10.0
    g = jnp.asarray(g, jnp.float32)
    got = ops.gated_linear_attention(q, k, v, log_decay=g, implementation="pallas", chunk_size=chunk)
    with jax.enable_x64(True):
        q64, k64, v64, g64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, g))
        want = ops.gated_linear_attention(q64, k64, v64, log_decay=g64, implementation="reference")
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("decay", ["step", "feature"])
def test_float32_decays_are_summed_at_float32_precision(decay, float32_products):
    """The kernels' sums of log decays and of the decays' cotangent terms (three bfloat16 parts
    on tensor cores) lose nothing of float32: values and gradients within 1e-6 of the float64
    reference's scale (7e-7 at most here; two parts give 1.4e-5, one 1e-2), with chunk decays
    of up to 29 (a decay per feature: the factored form, from the chunk's midpoint)."""
    rng = np.random.default_rng(4)
    n, d = 96, 16
    q, k, v = (rng.standard_normal((1, n, H, d)).astype(np.float32) for _ in range(3))
    g = -rng.uniform(0, 1.8, size=(1, n, H) + ((d,) if decay == "feature" else ())).astype(np.float32)
    w = rng.standard_normal((1, n, H, d))

    def loss(q, k, v, g, implementation):
        chunk = 32 if implementation == "pallas" else None
        out = ops.gated_linear_attention(
            q, k, v, log_decay=g, implementation=implementation, chunk_size=chunk
        )
        return jnp.sum(out * w.astype(out.dtype)), out

    value_and_grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, got), got_grads = value_and_grads(q, k, v, g, "pallas")
    with jax.enable_x64(True):
        (_, want), want_grads = value_and_grads(*(x.astype(np.float64) for x in (q, k, v, g)), "reference")
    for got_x, want_x in zip((got, *got_grads), (want, *want_grads)):
        want_x = np.asarray(want_x)
        np.testing.assert_allclose(got_x, want_x, rtol=0, atol=1e-6 * np.abs(want_x).max())


def test_a_strong_decay_per_head_keeps_its_small_gradient(float32_products):
    """A head whose decay (exp(-12) a step) lets nothing through has a gradient a millionth of
    the weak head's; summed over every step of q . dq - k . dk, each step's own score, in both
    terms, would cancel only up to its rounding: 1.4 times that gradient. Each head's gradient
    within 1e-4 of its own value (float32 against the float64 reference)."""
    rng = np.random.default_rng(5)
    q, k, v, w = (rng.standard_normal((2, 64, 2, 16)).astype(np.float32) for _ in range(4))
    g = np.asarray([-0.05, -12.0], np.float32)

    def loss(g, implementation):
        chunk = CHUNK if implementation == "pallas" else None
        out = ops.gated_linear_attention(
            q, k, v, log_decay=g, implementation=implementation, chunk_size=chunk
        )
        return jnp.sum(out * w.astype(out.dtype))

    got = jax.grad(loss)(g, "pallas")
    with jax.enable_x64(True):
        want = np.asarray(jax.grad(loss)(g.astype(np.float64), "reference"))
    assert np.abs(want[1]) < 1e-5 * np.abs(want[0])
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_bfloat16_products_keep_a_strong_head_s_small_gradient():
    """The decays' gradient is formed within each chunk. Summed across chunks instead (q . dq
    less k . dk of every later chunk, and the final state times its cotangent), the state
    rounded to bfloat16 for the products against its rounded cotangent leaves errors that do
    not cancel: -92 for the strong head's -0.009 here, where the loss squares the final state.
    Each head within 2% of the float64 reference of the same bfloat16 inputs."""
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.bfloat16) for _ in range(3))
    w = rng.standard_normal((1, 64, 2, 16)).astype(np.float32)
    g = np.asarray([-0.05, -10.0], np.float32)

    def loss(q, k, v, g, implementation):
        out, state = ops.gated_linear_attention(
            q,
            k,
            v,
            log_decay=g,
            normalize=True,
            feature_map="elu",
            implementation=implementation,
            chunk_size=CHUNK if implementation == "pallas" else None,
            return_state=True,
        )
        return jnp.sum(out.astype(g.dtype) * w.astype(g.dtype)) + jnp.sum(state.s_BHFM.astype(g.dtype) ** 2)

    got = jax.grad(loss, argnums=3)(q, k, v, g, "pallas")
    with jax.enable_x64(True):
        want = jax.grad(loss, argnums=3)(*(x.astype(jnp.float64) for x in (q, k, v, g)), "reference")
    np.testing.assert_allclose(got, np.asarray(want), rtol=2e-2)


def test_the_decays_gradient_takes_q_and_k_as_the_products_rounded_them():
    """With a decay per head, each pair of steps in a chunk gives q . dq and k . dk the same
    part, which cancels in their difference only if both take q and k as the scores' bfloat16
    products did: with the scaled queries of three features unrounded the strong head's
    gradient is 2.7e-2 off. Each head within 1e-2 of the float64 reference of the same bfloat16
    inputs (measured: 4.4e-3 and 3.8e-4)."""
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.standard_normal((1, 64, 2, 3)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 64, 2, 16)), jnp.bfloat16)
    w = rng.standard_normal((1, 64, 2, 16)).astype(np.float32)
    g = -np.asarray([0.5, 8.0], np.float32) * rng.uniform(0.5, 1, 2).astype(np.float32)

    def loss(q, k, v, g, implementation):
        chunk = CHUNK if implementation == "pallas" else None
        out, state = ops.gated_linear_attention(
            q, k, v, log_decay=g, implementation=implementation, chunk_size=chunk, return_state=True
        )
        return jnp.sum(out.astype(g.dtype) * w.astype(g.dtype)) + jnp.sum(state.s_BHFM.astype(g.dtype) ** 2)

    got = jax.grad(loss, argnums=3)(q, k, v, g, "pallas")
    with jax.enable_x64(True):
        want = jax.grad(loss, argnums=3)(*(x.astype(jnp.float64) for x in (q, k, v, g)), "reference")
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-2)


def test_tf32_products_give_the_decays_gradient_q_and_k_as_they_took_them():
    """The same with float32 inputs at TF32 (a GPU's default; emulated on the CPU): the kernels
    round each operand to TF32 themselves, and q . dq and k . dk take q and k so rounded. With
    them as they are the strong head's gradient is 1.2e-2 off. Each head within 3.5e-3 of the
    float64 reference (measured: 5.4e-6 and 9.7e-4; XLA's chunked form 7.9e-5 and 7.6e-4)."""
    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal((1, 64, 2, 3)).astype(np.float32) for _ in range(2))
    v, w = (rng.standard_normal((1, 64, 2, 16)).astype(np.float32) for _ in range(2))
    g = -np.asarray([0.5, 8.0], np.float32) * rng.uniform(0.5, 1, 2).astype(np.float32)

    def loss(q, k, v, g, implementation):
        chunk = CHUNK if implementation == "pallas" else None
        out, state = ops.gated_linear_attention(
            q, k, v, log_decay=g, implementation=implementation, chunk_size=chunk, return_state=True
        )
        return jnp.sum(out * w.astype(out.dtype)) + jnp.sum(state.s_BHFM**2)

    with tf32.tf32_products():
        got = jax.grad(loss, argnums=3)(q, k, v, g, "pallas")
    with jax.enable_x64(True):
        want = jax.grad(loss, argnums=3)(*(x.astype(np.float64) for x in (q, k, v, g)), "reference")
    np.testing.assert_allclose(got, np.asarray(want), rtol=3.5e-3)


@pytest.mark.parametrize(
    "dtype, precision, mode, products",
    [
        (jnp.bfloat16, None, "triton", "bfloat16"),
        (jnp.bfloat16, None, "interpret", "bfloat16"),
        (jnp.bfloat16, "tensorfloat32", "triton", "tensorfloat32"),
        (jnp.bfloat16, "highest", "triton", None),
        (jnp.float32, None, "triton", "tensorfloat32"),
        (jnp.float32, "high", "triton", "tensorfloat32"),
        (jnp.float32, None, "interpret", None),
        (jnp.float32, "tensorfloat32", "interpret", "tensorfloat32"),
        (jnp.float32, "highest", "triton", None),
        (jnp.float32, "BF16_BF16_F32", "triton", "bfloat16"),
        (jnp.float64, None, "triton", None),
    ],
)
def test_the_products_follow_the_inputs_precision_and_platform(dtype, precision, mode, products):
    """What the kernels' products take (`pallas.products`): what Triton would multiply on a GPU
    at that precision (TF32 for float32 by default), what the CPU's interpreter is asked for."""
    with jax.default_matmul_precision(precision), jax.enable_x64(dtype == jnp.float64):
        acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
        assert pallas.products(dtype, acc, mode) == products


def test_bfloat16_inputs_keep_float32_states(float32_products):
    q, k, v, g, s0, _, _ = _inputs(2, "step", normalize=False)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    g, s0 = g.astype(jnp.float32), s0.astype(jnp.float32)
    run = functools.partial(
        ops.gated_linear_attention,
        q,
        k,
        v,
        log_decay=g,
        initial_state=ops.LinearState(s0, None),
        return_state=True,
    )
    got, got_state = run(implementation="pallas")
    want, want_state = run(implementation="chunked")
    assert got.dtype == jnp.bfloat16 and got_state.s_BHFM.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )
    np.testing.assert_allclose(got_state.s_BHFM, want_state.s_BHFM, rtol=1e-5, atol=1e-5)

    # The decays' gradient is formed from float32 cotangents of q and k (from bfloat16 ones it is
    # 6% off): as close to the float64 reference of the same inputs as the chunked form's (both
    # 2.2e-3 of its scale: the rounding of bfloat16 outputs and their cotangents).
    w = np.random.default_rng(3).standard_normal(got.shape)

    def loss(q, k, v, g, implementation):
        out = ops.gated_linear_attention(q, k, v, log_decay=g, implementation=implementation)
        return jnp.sum(out.astype(g.dtype) * w.astype(g.dtype))

    got_g = jax.grad(loss, argnums=3)(q, k, v, g, "pallas")
    with jax.enable_x64(True):
        want_g = jax.grad(loss, argnums=3)(*(x.astype(jnp.float64) for x in (q, k, v, g)), "reference")
    want_g = np.asarray(want_g)
    np.testing.assert_allclose(got_g, want_g, rtol=0, atol=4e-3 * np.abs(want_g).max())


def _bfloat16_case(decay: str, normalize: bool):
    """(value_and_grads(q, k, v, g, implementation) -> ((loss, out), grads), (q, k, v, g)):
    bfloat16 inputs, float32 log decays (None: no decay), eight chunks of 16 at D = M = 16."""
    rng = np.random.default_rng(5)
    n, d = 128, 16
    q, k, v = (jnp.asarray(rng.standard_normal((1, n, H, d)), jnp.bfloat16) for _ in range(3))
    g = {"none": None, "step": (1, n, H), "feature": (1, n, H, d)}[decay]
    g = None if g is None else -jnp.asarray(rng.uniform(0, 0.5, g), jnp.float32)
    w = rng.standard_normal((1, n, H, d)).astype(np.float32)

    def loss(q, k, v, g, implementation):
        out = ops.gated_linear_attention(
            q,
            k,
            v,
            log_decay=g,
            normalize=normalize,
            feature_map="elu" if normalize else None,
            implementation=implementation,
            chunk_size=CHUNK if implementation == "pallas" else None,
        )
        return jnp.sum(out.astype(jnp.float32) * w), out

    argnums = (0, 1, 2) if g is None else (0, 1, 2, 3)
    return jax.value_and_grad(loss, argnums=argnums, has_aux=True), (q, k, v, g)


BFLOAT16_CASES = [("none", True), ("step", False), ("feature", False)]


WALKS = {"parallel_forward": True, "parallel_backward": True, "walks": 4}


@pytest.mark.parametrize(
    "decay,normalize,launch",
    [(*case, {}) for case in BFLOAT16_CASES] + [("step", True, WALKS), ("step", True, {"walks": 4})],
)
def test_bfloat16_inputs_multiply_in_bfloat16_close_to_float64(decay, normalize, launch):
    """At JAX's default matmul precision bfloat16 inputs multiply in bfloat16 in the kernels
    (the scores, the states and the rescaled q and k rounded before each product, summed in
    float32): values and gradients within 2e-2 of the float64 reference's scale, where the
    rounding of bfloat16 outputs alone is 4e-3 (measured: at most 1.1e-2, the normalised dq;
    1e-3 to 4e-3 with float32 products). So too the parallel forms walking in four stretches,
    whose chunks add their walk's first state, in bfloat16, to the bfloat16 one the walk wrote
    (measured: 8.3e-3), and the one-pass kernels walking four stretches, each from a float32
    state (8.3e-3, as in one walk)."""
    value_and_grads, inputs = _bfloat16_case(decay, normalize)
    with pallas.tuning(**launch):
        (_, got), got_grads = value_and_grads(*inputs, "pallas")
    with jax.enable_x64(True):
        upcast = (None if x is None else np.asarray(x, np.float64) for x in inputs)
        (_, want), want_grads = value_and_grads(*upcast, "reference")
    for got_x, want_x in zip((got, *got_grads), (want, *want_grads)):
        want_x = np.asarray(want_x)
        scale = np.abs(want_x).max()
        np.testing.assert_allclose(np.asarray(got_x, np.float64), want_x, rtol=0, atol=2e-2 * scale)


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (the op's `jit`, custom rules)."""
    yield from jaxpr.eqns
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _equations(sub)


def _snapshot_dtypes(value_and_grads, q, k, v, g) -> set:
    """The dtypes of the [B, H, chunks * D, M] arrays the parallel forms' kernels write (the
    states entering, or leaving, each chunk)."""
    pallas_form = functools.partial(value_and_grads, implementation="pallas")
    eqns = _equations(jax.make_jaxpr(pallas_form)(q, k, v, g).jaxpr)
    shape = (q.shape[0], q.shape[2], q.shape[1], v.shape[-1])  # chunks * D = T at D = CHUNK
    written = (x.aval for e in eqns if e.primitive.name == "pallas_call" for x in e.outvars)
    return {str(x.dtype) for x in written if x.shape == shape}


@pytest.mark.parametrize("decay,normalize", BFLOAT16_CASES)
def test_the_parallel_forms_keep_bfloat16_states_where_the_products_round_them(decay, normalize):
    """With bfloat16 products the states the parallel forms write for every chunk (and their
    cotangents) are bfloat16, half the bytes, with the one-pass kernels' results: each chunk's
    program uses them only in products, which round them to bfloat16 anyway (equal here, in the
    interpreter; on a GPU within a bfloat16 rounding). With float32 products they stay float32.
    The decays' gradient through the state carried through each chunk is the one place where
    the rounding differs (the one-pass backward rounds that state after its decay, the
    parallel before): within 2e-4 of its scale (measured: 5.6e-5). At JAX's default precision,
    pinned: a session at TF32 would give float32 products."""
    value_and_grads, inputs = _bfloat16_case(decay, normalize)
    with jax.default_matmul_precision("default"):
        one_pass = jax.tree.leaves(value_and_grads(*inputs, "pallas"))
        with pallas.tuning(parallel_forward=True, parallel_backward=True):
            parallel = jax.tree.leaves(value_and_grads(*inputs, "pallas"))
            assert _snapshot_dtypes(value_and_grads, *inputs) == {"bfloat16"}
            with jax.default_matmul_precision("float32"):
                assert _snapshot_dtypes(value_and_grads, *inputs) == {"float32"}
    for i, (got, want) in enumerate(zip(parallel, one_pass)):
        want = np.asarray(want, np.float64)
        tolerance = 0 if jax.default_backend() == "cpu" else 8e-3
        if decay != "none" and i == len(one_pass) - 1:  # the decays' gradient
            tolerance = max(tolerance, 2e-4)
        atol = tolerance * np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=atol)


def _product_operands(decay: str, dtype: str, precision: str | None) -> set:
    """The operand dtypes of every matrix product of the kernels, lowered for a GPU."""
    modules = kernel_resources.triton_modules(
        decay, n=64, head_dim=16, dtype=dtype, chunk_size=16, tuning={}, matmul_precision=precision
    )
    product = r"tt\.dot .* : tensor<\d+x\d+x(\w+)> \* tensor<\d+x\d+x(\w+)>"
    return {operands for ir in modules.values() for operands in re.findall(product, ir)}


@pytest.mark.parametrize("decay", ["none", "feature"])
def test_bfloat16_inputs_multiply_on_bfloat16_tensor_cores(decay):
    """Lowered for a GPU: with bfloat16 inputs at JAX's default precision every product takes
    bfloat16 operands (the decays' exact sums take theirs in bfloat16 parts); asked for more
    (float32, TF32), the float32 values multiply as they are, as they do for float32 inputs."""
    for precision in (None, "bfloat16", "BF16_BF16_F32"):
        assert _product_operands(decay, "bfloat16", precision) == {("bf16", "bf16")}, precision
    for dtype, precision in (("bfloat16", "float32"), ("bfloat16", "tensorfloat32"), ("float32", None)):
        assert ("f32", "f32") in _product_operands(decay, dtype, precision), (dtype, precision)


def test_tf32_products_round_their_operands_on_a_gpu():
    """Lowered for a GPU, float32 inputs at JAX's default precision (TF32 there) have the kernels
    round their products' operands to TF32 (`precision.round_to_tf32`: the mask that clears
    the 13 low bits), which Triton would hand the tensor cores to truncate; asked for float32,
    they do not."""

    def masks(precision):
        modules = kernel_resources.triton_modules(
            "step", n=64, head_dim=16, dtype="float32", chunk_size=16, tuning={}, matmul_precision=precision
        )
        return {name: ir.count("arith.constant -8192 : i32") for name, ir in modules.items()}

    assert all(masks(None).values()), masks(None)
    assert not any(masks("float32").values()), masks("float32")


def _export_for_cuda(fn, *specs):
    """The StableHLO text of `fn` lowered for CUDA, here, without a GPU."""
    return kernel_resources.export_for_cuda(fn, *specs).mlir_module()


@pytest.fixture
def triton(monkeypatch):
    """The pallas form traced as on a GPU (Triton kernels), whatever this machine has."""
    monkeypatch.setattr(pallas, "kernel_mode", lambda platform=None: "triton")


@pytest.mark.parametrize(
    "decay,normalize,parallel,walks",
    [
        ("none", False, False, 1),
        ("step", True, False, 1),
        ("step", True, True, 2),
        ("step", True, False, 2),
        ("feature", False, False, 1),
        ("feature", False, True, 1),
        ("feature", False, True, 2),
    ],
)
def test_both_kernels_lower_to_triton_for_cuda(triton, decay, normalize, parallel, walks):
    """Every operation of the forward and backward kernels, the preparation they apply (elu,
    the scale, key lengths, the finite part) and the normaliser included, has a Triton
    lowering: lowered for CUDA here, without a GPU (what Triton then compiles is checked on a
    GPU). One kernel a pass (the normaliser runs in the values' programs), two for the parallel
    forward and two for the parallel backward, walking the chunks in one stretch or two; in two,
    the one-pass kernels too (after a kernel that walks the stretches from zero)."""
    n, d = 80, 16  # five chunks of 16, not a power of two
    spec = jax.ShapeDtypeStruct
    g = {"none": None, "step": spec((1, n, 2), jnp.float32), "feature": spec((1, n, 2, d), jnp.float32)}[
        decay
    ]

    def grads(q, k, v, g, segment_ids, key_lengths):
        def loss(q, k, v, g):
            out = ops.gated_linear_attention(
                q,
                k,
                v,
                log_decay=g,
                feature_map="elu",
                normalize=normalize,
                implementation="pallas",
                chunk_size=16,
                segment_ids=segment_ids,
                key_lengths=key_lengths,
            )
            return jnp.sum(out.astype(jnp.float32))

        return jax.value_and_grad(loss, argnums=(0, 1, 2) if g is None else (0, 1, 2, 3))(q, k, v, g)

    qk, v = spec((1, n, 2, d), jnp.bfloat16), spec((1, n, 2, 2 * d), jnp.bfloat16)
    # With a decay per feature, a grid over two value blocks (`pallas.Tuning`).
    block = 16 if decay == "feature" else None
    launch = dict(parallel_forward=parallel, parallel_backward=parallel, walks=walks)
    with pallas.tuning(value_block=block, **launch):
        module = _export_for_cuda(grads, qk, qk, v, g, spec((1, n), jnp.int32), spec((1,), jnp.int32))
    # forward and backward
    assert module.count("xla.gpu.triton(") == (4 if parallel or walks > 1 else 2)


@pytest.mark.parametrize("normalize", [False, True])
def test_the_forward_reads_the_callers_arrays_once(triton, normalize):
    """No prepared copy of q, k, v or the decays is written before the forward kernel, the
    normaliser does not read q, k and the decays again, and the non-finite guard does not read
    v and g again: up to the guard's marking branch (a `lax.cond`, run only when something is
    not finite) the kernel, given the function's own arguments, is the only operation that
    reads them."""
    spec = jax.ShapeDtypeStruct
    qkv = spec((1, 64, 2, 16), jnp.bfloat16)

    def forward(q, k, v, g):
        return ops.gated_linear_attention(
            q,
            k,
            v,
            log_decay=g,
            normalize=normalize,
            feature_map="elu" if normalize else None,
            implementation="pallas",
        )

    module = _export_for_cuda(forward, qkv, qkv, qkv, spec((1, 64, 2, 16), jnp.float32))
    # The op is a `jit` of its own: the module's main passes the arguments on to it, once.
    main = module[module.index("func.func public @main") :]
    call = re.search(r"call @(\w+)\(%arg0, %arg1, %arg2, %arg3, ", main)
    op = module[module.index(f"func.func private @{call[1]}(") :]
    before_marking = op[: op.index('"stablehlo.case"')].splitlines()[1:]
    reads = [line for line in before_marking if "%arg" in line]
    assert len(reads) == 1 and "xla.gpu.triton(%arg0, %arg1, %arg2, %arg3, " in reads[0], reads


def test_the_platform_chooses_the_kernel_mode():
    assert pallas.kernel_mode("gpu") == "triton"
    assert pallas.kernel_mode("cpu") == "interpret"
    with pytest.raises(
        ValueError, match=r'implementation="pallas" is a GPU kernel.*on \'tpu\' use "chunked"'
    ):
        pallas.kernel_mode("tpu")


@pytest.mark.parametrize("chunk_size", [8, 48])
def test_chunk_sizes_must_be_powers_of_two_from_16(chunk_size):
    q = jnp.ones((1, 4, 1, 2))
    with pytest.raises(
        ValueError, match=rf"chunk_size must be a power of two >= 16 \(a Triton block\), got {chunk_size}"
    ):
        ops.gated_linear_attention(q, q, q, implementation="pallas", chunk_size=chunk_size)


def test_inside_shard_map_the_interpreter_refuses_and_the_gpu_kernel_runs():
    """Pallas's CPU interpreter cannot run the kernel inside shard_map: a clear error, not a
    JAX-internal one. On a GPU the Triton kernel runs there, and equals the XLA form."""
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    q = jax.random.normal(jax.random.key(0), (1, 32, 1, 16))
    spec = jax.sharding.PartitionSpec(None, "seq")

    def split(implementation):
        def local(q):
            return ops.gated_linear_attention(q, q, q, implementation=implementation, sequence_axis="seq")

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))

    if jax.default_backend() == "cpu":
        with pytest.raises(
            NotImplementedError, match=r"inside jax.shard_map .* axes \['seq'\]\) runs only as the GPU"
        ):
            split("pallas")(q)
    else:
        np.testing.assert_allclose(split("pallas")(q), split("chunked")(q), rtol=1e-2, atol=1e-2)  # TF32


def test_a_traced_eps_is_refused_with_a_clear_error():
    """eps is a static option of the kernels: a traced one is named, not misread."""
    q = jnp.ones((1, 16, 1, 4))

    @jax.jit
    def run(eps):
        return ops.gated_linear_attention(
            q, q, q, normalize=True, feature_map="elu", implementation="pallas", eps=eps
        )

    with pytest.raises(TypeError, match='implementation="pallas" takes eps as a number known when'):
        run(1e-6)
