"""Attention ops never misread an input: float masks, masks of an ambiguous rank, integer
queries/keys/values and key lengths outside [0, S] are refused with an error naming the value;
under `jit` out-of-range key lengths act as clamped, as documented; an empty sequence gives an
empty result (the state passing through) or a clear error.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops

B, T, S, H, D = 2, 5, 7, 2, 4
ROTATIONS = jnp.asarray(np.random.default_rng(9).standard_normal((2, D, 2)), jnp.float32)
PROJECTION = jnp.asarray(np.random.default_rng(8).standard_normal((S, 3)), jnp.float32)


def _x(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(t=T, s=S):
    return _x(0, B, t, H, D), _x(1, B, s, H, D), _x(2, B, s, H, D)


# --- masks -------------------------------------------------------------------------------------


def _bool_mask():
    return jnp.asarray(np.random.default_rng(3).random((B, 1, T, S)) < 0.7).at[..., 0].set(True)


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_a_float_mask_is_refused_not_cast(implementation):
    q, k, v = _qkv()
    allowed = _bool_mask()
    additive = jnp.where(allowed, 0.0, -1e9)  # the form many libraries use
    with pytest.raises(
        ValueError,
        match=r"mask must be boolean \(True = attend\), got float32; "
        r".*pass `mask == 0`",
    ):
        ops.softmax_attention(q, k, v, mask=additive, implementation=implementation)
    # The advice in the message gives the intended result.
    np.testing.assert_allclose(
        ops.softmax_attention(q, k, v, mask=additive == 0, implementation=implementation),
        ops.softmax_attention_reference(q, k, v, mask=allowed),
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="got int32"):
        ops.softmax_attention_reference(q, k, v, mask=allowed.astype(jnp.int32))


def test_mask_ranks_two_and_four_agree_and_rank_three_is_refused():
    q, k, v = _qkv()
    allowed_TS = _bool_mask()[0, 0]
    two = ops.softmax_attention_reference(q, k, v, mask=allowed_TS)
    four = ops.softmax_attention_reference(q, k, v, mask=allowed_TS[None, None])
    np.testing.assert_array_equal(two, four)
    assert not np.allclose(two, ops.softmax_attention_reference(q, k, v), atol=1e-3)
    for rank3 in (jnp.broadcast_to(allowed_TS, (B, T, S)), allowed_TS[None]):
        with pytest.raises(
            ValueError,
            match=r"mask must be \[T, S\] or \[B, H, T, S\].*got "
            r"shape \(\d, 5, 7\); for a per-example \[B, T, S\] "
            r"mask pass mask\[:, None\]",
        ):
            ops.softmax_attention(q, k, v, mask=rank3)


# --- dtypes of q, k, v ---------------------------------------------------------------------------


def _ops_on(q, k, v):
    """Every op that takes [B, T, H, D] q/k/v, as (name, thunk)."""
    causal_q = q[:, :T]
    yield "softmax", lambda: ops.softmax_attention(q, k, v)
    yield "softmax reference", lambda: ops.softmax_attention_reference(q, k, v)
    yield "linear", lambda: ops.linear_attention(q, k, v)
    for impl in ops.IMPLS:
        yield impl, lambda impl=impl: ops.causal_linear_attention(causal_q, k[:, :T], v[:, :T], impl=impl)
    yield "lsh", lambda: ops.lsh_attention(k, v, ROTATIONS, chunk_size=4)
    yield "linformer", lambda: ops.linformer_attention(q, k, v, PROJECTION, PROJECTION)


@pytest.mark.parametrize("bad", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_integer_or_boolean_q_k_v_are_refused(bad, dtype):
    arrays = dict(zip("qkv", _qkv()))
    arrays[bad] = (arrays[bad] > 0).astype(dtype)
    checked = 0
    for name, run in _ops_on(arrays["q"], arrays["k"], arrays["v"]):
        if name == "lsh" and bad == "q":
            continue  # LSH shares queries and keys: it takes k as both
        with pytest.raises(
            ValueError,
            match=rf"must be a floating-point array .*got "
            rf"{jnp.dtype(dtype).name}",
        ):
            run()
        checked += 1
    assert checked >= 8


def test_integer_steps_are_refused():
    q_t = jnp.ones((B, H, D), jnp.int32)
    f_t = jnp.ones((B, H, D), jnp.float32)
    with pytest.raises(ValueError, match="q_t must be a floating-point array"):
        ops.linear_attention_step(ops.init_linear_state(B, H, D, D), q_t, f_t, f_t)
    with pytest.raises(ValueError, match="v_t must be a floating-point array"):
        ops.softmax_attention_step(ops.init_kv_cache(B, 4, H, D, D), f_t, f_t, q_t)


# --- key lengths ---------------------------------------------------------------------------------


def _key_length_ops(q, k, v, lengths):
    yield "softmax", lambda: ops.softmax_attention(q, k, v, key_lengths=lengths)
    yield "linear", lambda: ops.linear_attention(q, k, v, key_lengths=lengths)
    yield "state", lambda: ops.linear_state_from_keys(k, v, key_lengths=lengths)
    yield "causal", lambda: ops.causal_linear_attention(k, k, v, key_lengths=lengths)
    yield "lsh", lambda: ops.lsh_attention(k, v, ROTATIONS, chunk_size=4, key_lengths=lengths)
    yield "linformer", lambda: ops.linformer_attention(q, k, v, PROJECTION, PROJECTION, key_lengths=lengths)


@pytest.mark.parametrize("lengths", [[-1, 3], [S + 1, 3], [2, 100]])
def test_key_lengths_outside_zero_to_s_are_refused_eagerly(lengths):
    q, k, v = _qkv()
    bad = [n for n in lengths if not 0 <= n <= S]
    for name, run in _key_length_ops(q, k, v, jnp.asarray(lengths, jnp.int32)):
        message = re.escape(f"key_lengths must be in [0, {S}]") + ".*" + re.escape(f"got {bad}")
        with pytest.raises(ValueError, match=message):
            run()


def test_key_lengths_under_jit_act_as_clamped():
    q, k, v = _qkv()

    @jax.jit
    def outputs(lengths):
        return [run() for _, run in _key_length_ops(q, k, v, lengths)]

    out_of_range = outputs(jnp.asarray([-3, S + 4], jnp.int32))
    clamped = outputs(jnp.asarray([0, S], jnp.int32))
    for got, want in zip(out_of_range, clamped):
        np.testing.assert_array_equal(jax.tree.leaves(got)[0], jax.tree.leaves(want)[0])


def test_key_lengths_at_the_bounds_are_accepted():
    q, k, v = _qkv()
    for _, run in _key_length_ops(q, k, v, jnp.asarray([0, S], jnp.int32)):
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(run()))


# --- empty sequences -----------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_an_empty_sequence_returns_nothing_and_keeps_the_state(impl):
    q = jnp.zeros((B, 0, H, D))
    state = ops.LinearState(_x(4, B, H, D, D), jnp.abs(_x(5, B, H, D)))
    out, final = ops.causal_linear_attention(q, q, q, impl=impl, initial_state=state, return_state=True)
    assert out.shape == (B, 0, H, D)
    np.testing.assert_array_equal(final.s_BHFM, state.s_BHFM)
    np.testing.assert_array_equal(final.z_BHF, state.z_BHF)


def test_empty_sequences_in_the_other_ops():
    q = jnp.zeros((B, 0, H, D))
    for name, out in (
        ("softmax", ops.softmax_attention(q, q, q, causal=True)),
        ("softmax reference", ops.softmax_attention_reference(q, q, q)),
        ("linear", ops.linear_attention(q, q, q)),
    ):
        assert out.shape == (B, 0, H, D), name
    with pytest.raises(ValueError, match="needs at least one position to hash, got an empty sequence"):
        ops.lsh_attention(q, q, ROTATIONS, chunk_size=4)


# --- sub-pixel values ----------------------------------------------------------------------------


def test_image_generator_refuses_sub_pixels_outside_its_classes():
    from flax import nnx

    from linear_transformers import ImageGenerator, TransformerConfig

    config = TransformerConfig(
        num_layers=1, num_heads=2, model_dim=8, feed_forward_dim=16, dropout=0.0, attention="linear"
    )
    model = ImageGenerator(config, num_classes=17, num_mixtures=2, max_length=6, rngs=nnx.Rngs(0))
    x = np.zeros((2, 6), np.int32)
    assert np.isfinite(float(model.nll(x)))
    for bad, where in ((300, "nll"), (-1, "log_prob"), (17, "__call__")):
        x_bad = x.copy()
        x_bad[1, 3] = bad
        run = {"nll": model.nll, "log_prob": model.log_prob, "__call__": model}[where]
        low, high = min(bad, 0), max(bad, 0)
        with pytest.raises(
            ValueError, match=re.escape(f"sub-pixels must be in [0, 17), got values in [{low}, {high}]")
        ):
            run(x_bad)


def test_the_image_trainer_refuses_data_outside_the_classes(monkeypatch):
    from configs import digits
    from experiments.data import pipeline
    from experiments.tasks.image_generation import load_split

    images = np.zeros((4, 8, 8, 1), np.uint16)
    images[2, 3, 3, 0] = 300
    monkeypatch.setattr(pipeline, "load_images", lambda *args, **kwargs: images)
    config = digits.get_config("smoke")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "split 'train' of 'digits' has sub-pixel values in [0, 300]; the model takes [0, 17)"
        ),
    ):
        load_split(config, "train")
    images[2, 3, 3, 0] = 16
    assert load_split(config, "train").shape == (4, 64)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_a_checkpointer_always_keeps_the_newest_checkpoint(tmp_path, bad):
    from experiments.training.checkpoints import Checkpointer

    with pytest.raises(
        ValueError,
        match=re.escape(
            f"max_to_keep must be an int >= 1 (the newest checkpoint is always kept), got {bad!r}"
        ),
    ):
        Checkpointer(tmp_path / "checkpoints", max_to_keep=bad)


# ---- Non-finite values reach only the queries that can see them ----


def _qkv_with(bad, where, T=12, s=7):
    """Clean q, k, v [1, T, 2, 4] and copies with `bad` at time s in `where` ("v" or "k")."""
    q, k, v = (jax.random.normal(jax.random.key(i), (1, T, 2, 4)) for i in range(3))
    spoiled = {"k": k, "v": v}
    spoiled[where] = spoiled[where].at[:, s].set(bad)
    return (q, k, v), (q, spoiled["k"], spoiled["v"])


@pytest.mark.parametrize("where, bad", [("v", jnp.nan), ("v", -jnp.inf), ("k", jnp.nan), ("k", jnp.inf)])
@pytest.mark.parametrize("impl", ["quadratic", "chunked", "associative_scan", "scan"])
def test_causal_linear_a_bad_later_value_never_reaches_earlier_outputs(impl, where, bad):
    s = 7
    clean, spoiled = _qkv_with(bad, where, s=s)
    kw = dict(impl=impl, chunk_size=4, return_state=True)  # s sits mid-chunk: chunk [4, 8)
    out_clean, _ = ops.causal_linear_attention(*clean, **kw)
    out, state = ops.causal_linear_attention(*spoiled, **kw)
    np.testing.assert_allclose(out[:, :s], out_clean[:, :s], rtol=1e-6, atol=1e-7)
    if where == "v":  # (a bad key may still weigh 0: elu(-inf) + 1 = 0)
        assert (~np.isfinite(np.asarray(out[:, s:]))).all()
        assert (~np.isfinite(np.asarray(state.s_BHFM))).all()


@pytest.mark.parametrize("where, bad", [("v", jnp.nan), ("v", jnp.inf), ("k", jnp.nan)])
@pytest.mark.parametrize("implementation", [None, "reference"])
def test_softmax_a_bad_value_never_reaches_queries_that_cannot_see_it(implementation, where, bad):
    s = 7
    clean, spoiled = _qkv_with(bad, where, s=s)
    kw = dict(implementation=implementation)
    causal = ops.softmax_attention(*spoiled, causal=True, **kw)
    np.testing.assert_allclose(
        causal[:, :s], ops.softmax_attention(*clean, causal=True, **kw)[:, :s], rtol=1e-6, atol=1e-7
    )
    if where == "v":  # (a bad key may still weigh 0: a logit of -inf)
        assert (~np.isfinite(np.asarray(causal[:, s:]))).all()
    # A padded key (s >= key_lengths) and a key an explicit mask hides are never seen.
    lengths = jnp.array([s])
    padded = ops.softmax_attention(*spoiled, key_lengths=lengths, **kw)
    np.testing.assert_allclose(
        padded, ops.softmax_attention(*clean, key_lengths=lengths, **kw), rtol=1e-6, atol=1e-7
    )
    mask = jnp.ones((12, 12), bool).at[:, s].set(False)
    hidden = ops.softmax_attention(*spoiled, mask=mask, **kw)
    np.testing.assert_allclose(hidden, ops.softmax_attention(*clean, mask=mask, **kw), rtol=1e-6, atol=1e-7)
    seen_by_some = ops.softmax_attention(*spoiled, mask=mask.at[:3, s].set(True), **kw)
    np.testing.assert_allclose(seen_by_some[:, 3:], hidden[:, 3:], rtol=1e-6, atol=1e-7)
    if where == "v":
        assert (~np.isfinite(np.asarray(seen_by_some[:, :3]))).all()


def test_bad_values_leave_gradients_of_unaffected_outputs_finite():
    clean, spoiled = _qkv_with(jnp.nan, "v")
    for f in (
        lambda q, k, v: ops.causal_linear_attention(q, k, v, impl="quadratic"),
        lambda q, k, v: ops.causal_linear_attention(q, k, v, impl="chunked", chunk_size=4),
        lambda q, k, v: ops.softmax_attention(q, k, v, causal=True),
    ):
        grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[:, :7]), argnums=(0, 1, 2))(*spoiled)
        expected = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[:, :7]), argnums=(0, 1, 2))(*clean)
        for g, e in zip(grads, expected):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
