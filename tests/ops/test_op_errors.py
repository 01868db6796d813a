"""Bad arguments to the attention ops raise ValueErrors that say what is wrong, and the ops never
misread an input: float masks, masks of an ambiguous rank, integer queries/keys/values and key
lengths outside [0, S] are refused with an error naming the value; under `jit` out-of-range key
lengths act as clamped, as documented; an empty sequence gives an empty result (the state passing
through) or a clear error; a non-finite value reaches only the outputs that can see it.

Legend: B batch, T query time, S key time, H heads, D key/query features, F feature-map features,
M value features.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_transformers import ops

B, T, S, H, D, M = 2, 5, 7, 2, 4, 6


def _zeros(*shape):
    return jnp.zeros(shape, jnp.float32)


def _qkv(t=T, s=S, d=D, m=M):
    return _zeros(B, t, H, d), _zeros(B, s, H, d), _zeros(B, s, H, m)


def _causal_qkv():
    return _qkv(t=T, s=T)


SHAPE_OPS = {
    # id: (name in the message, call(q, k, v))
    "causal_linear": ("causal_linear_attention", ops.causal_linear_attention),
    "causal_linear_jit_scan": (
        "causal_linear_attention",
        jax.jit(functools.partial(ops.causal_linear_attention, implementation="scan", chunk_size=4)),
    ),
    "linear": ("linear_attention", ops.linear_attention),
    "softmax": ("softmax_attention", ops.softmax_attention),
    "softmax_xla": ("softmax_attention", functools.partial(ops.softmax_attention, implementation="xla")),
    "softmax_reference": (
        "softmax_attention",
        functools.partial(ops.softmax_attention, implementation="reference"),
    ),
}


BAD_SHAPES = {
    # name: (q, k, v shapes, message pattern)
    "q_ndim": ((B, T, H * D), (B, T, H, D), (B, T, H, D), r"q must have 4 dimensions .*\(2, 5, 8\)"),
    "k_ndim": ((B, T, H, D), (1, B, T, H, D), (B, T, H, D), "k must have 4 dimensions"),
    "v_ndim": ((B, T, H, D), (B, T, H, D), (B, T, H), "v must have 4 dimensions"),
    "k_features": (
        (B, T, H, D),
        (B, T, H, D + 1),
        (B, T, H, D),
        re.escape(f"k shape {(B, T, H, D + 1)} does not match q shape {(B, T, H, D)}"),
    ),
    "k_heads": ((B, T, H, D), (B, T, H + 1, D), (B, T, H, D), "k shape .* does not match q shape"),
    "k_batch": ((B, T, H, D), (B + 1, T, H, D), (B, T, H, D), "k shape .* does not match q shape"),
    "v_length": (
        (B, T, H, D),
        (B, T, H, D),
        (B, T + 1, H, D),
        re.escape(f"v shape {(B, T + 1, H, D)} does not match k shape {(B, T, H, D)}"),
    ),
    "v_heads": ((B, T, H, D), (B, T, H, D), (B, T, H + 1, D), "v shape .* does not match k shape"),
}


def _bad_shape_params():
    for op_id in SHAPE_OPS:
        for bad in sorted(BAD_SHAPES):
            yield pytest.param(op_id, bad, id=f"{op_id}-{bad}")


B, T, S, H, D = 2, 5, 7, 2, 4


ROTATIONS = jnp.asarray(np.random.default_rng(9).standard_normal((2, D, 2)), jnp.float32)


PROJECTION = jnp.asarray(np.random.default_rng(8).standard_normal((S, 3)), jnp.float32)


def _x(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _random_qkv(t=T, s=S):
    """Random q, k, v (M = D), where a zero would hide a misread value."""
    return _x(0, B, t, H, D), _x(1, B, s, H, D), _x(2, B, s, H, D)


def _bool_mask():
    return jnp.asarray(np.random.default_rng(3).random((B, 1, T, S)) < 0.7).at[..., 0].set(True)


def _ops_on(q, k, v):
    """Every op that takes [B, T, H, D] q/k/v, as (name, thunk)."""
    causal_q = q[:, :T]
    yield "softmax", lambda: ops.softmax_attention(q, k, v)
    yield "softmax reference", lambda: ops.softmax_attention_reference(q, k, v)
    yield "linear", lambda: ops.linear_attention(q, k, v)
    for impl in ops.LINEAR_IMPLEMENTATIONS:
        yield (
            impl,
            lambda implementation=impl: ops.causal_linear_attention(
                causal_q, k[:, :T], v[:, :T], implementation=impl
            ),
        )
    yield "lsh", lambda: ops.lsh_attention(k, v, ROTATIONS, chunk_size=4)
    yield "linformer", lambda: ops.linformer_attention(q, k, v, PROJECTION, PROJECTION)


def _key_length_ops(q, k, v, lengths):
    yield "softmax", lambda: ops.softmax_attention(q, k, v, key_lengths=lengths)
    yield "linear", lambda: ops.linear_attention(q, k, v, key_lengths=lengths)
    yield "state", lambda: ops.linear_state_from_keys(k, v, key_lengths=lengths)
    yield "causal", lambda: ops.causal_linear_attention(k, k, v, key_lengths=lengths)
    yield "lsh", lambda: ops.lsh_attention(k, v, ROTATIONS, chunk_size=4, key_lengths=lengths)
    yield "linformer", lambda: ops.linformer_attention(q, k, v, PROJECTION, PROJECTION, key_lengths=lengths)


def _qkv_with(bad, where, T=12, s=7):
    """Clean q, k, v [1, T, 2, 4] and copies with `bad` at time s in `where` ("v" or "k")."""
    q, k, v = (jax.random.normal(jax.random.key(i), (1, T, 2, 4)) for i in range(3))
    spoiled = {"k": k, "v": v}
    spoiled[where] = spoiled[where].at[:, s].set(bad)
    return (q, k, v), (q, spoiled["k"], spoiled["v"])


@pytest.mark.parametrize("where", ["make_feature_map", "causal", "linear", "step"])
def test_unknown_feature_map_lists_registered_ones(where):
    q, k, v = _causal_qkv()
    call = {
        "make_feature_map": lambda: ops.make_feature_map("softmaxish"),
        "causal": lambda: ops.causal_linear_attention(q, k, v, feature_map="softmaxish"),
        "linear": lambda: ops.linear_attention(q, k, v, feature_map="softmaxish"),
        "step": lambda: ops.linear_attention_step(
            ops.init_linear_state(B, H, D, M), q[:, 0], k[:, 0], v[:, 0], feature_map="softmaxish"
        ),
    }[where]
    with pytest.raises(ValueError, match="unknown feature map 'softmaxish'") as info:
        call()
    registered = ops.registered_feature_maps()
    assert {"elu", "relu", "favor"} <= set(registered)
    for name in registered:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize("kwargs", [{}, {"head_dim": D}, {"key": "key"}])
def test_favor_without_rng_or_head_dim(kwargs):
    kwargs = {k: (jax.random.key(0) if v == "key" else v) for k, v in kwargs.items()}
    with pytest.raises(ValueError, match="needs an explicit RNG"):
        ops.make_feature_map("favor", **kwargs)


def test_favor_as_bare_string_in_an_op():
    q, k, v = _causal_qkv()
    with pytest.raises(ValueError, match="'favor'.*explicit RNG"):
        ops.causal_linear_attention(q, k, v, feature_map="favor")
    with pytest.raises(ValueError, match="'favor'.*explicit RNG"):
        ops.linear_attention(q, k, v, feature_map="favor")


def test_bad_feature_map_options():
    with pytest.raises(ValueError, match=r"bad options \['sharpness'\] for feature map 'elu'"):
        ops.make_feature_map("elu", sharpness=2)
    with pytest.raises(ValueError, match="given with a callable feature map"):
        ops.make_feature_map(jax.nn.softplus, sharpness=2)
    fm = ops.make_feature_map("relu")
    with pytest.raises(ValueError, match="given with a FeatureMap instance"):
        ops.make_feature_map(fm, sharpness=2)


@pytest.mark.parametrize("spec", [3, None, ("elu",)])
def test_feature_map_of_wrong_type(spec):
    with pytest.raises(ValueError, match="feature_map must be a name from"):
        ops.make_feature_map(spec)


def test_register_existing_feature_map_name():
    before = ops.registered_feature_maps()
    with pytest.raises(ValueError, match="'elu' is already registered"):
        ops.register_feature_map("elu")(lambda: ops.make_feature_map("relu"))
    assert ops.registered_feature_maps() == before
    assert repr(ops.make_feature_map("elu")) == "CallableFeatureMap(elu)"  # not replaced


def test_favor_projection_shape_errors():
    with pytest.raises(ValueError, match=re.escape("[num_features, head_dim] matrix")):
        ops.FavorFeatureMap(_zeros(2, 3, 4))
    fm = ops.FavorFeatureMap(_zeros(8, D))
    with pytest.raises(ValueError, match=f"drawn for head_dim={D}, used with head_dim={D + 1}"):
        fm(_zeros(3, D + 1))
    with pytest.raises(ValueError, match=f"drawn for head_dim={D}"):
        fm.query(_zeros(3, D + 1))
    q, k, v = _qkv(t=S, d=D + 1)
    with pytest.raises(ValueError, match=f"drawn for head_dim={D}"):
        ops.causal_linear_attention(q, k, v, feature_map=fm)
    for num_features, head_dim in ((0, D), (8, 0)):
        with pytest.raises(ValueError, match="num_features and head_dim must be >= 1"):
            ops.favor_projection(jax.random.key(0), num_features, head_dim)


def test_unknown_impl():
    q, k, v = _causal_qkv()
    with pytest.raises(ValueError, match=r"unknown implementation 'flash'; expected one of \("):
        ops.causal_linear_attention(q, k, v, implementation="flash")


@pytest.mark.parametrize("chunk_size", [0, -4, 2.0, 2.5, "8"])
def test_bad_chunk_size(chunk_size):
    q, k, v = _causal_qkv()
    with pytest.raises(
        ValueError, match="chunk_size must be None or an integer >= 1, got " + re.escape(repr(chunk_size))
    ):
        ops.causal_linear_attention(q, k, v, chunk_size=chunk_size)


def test_causal_linear_needs_equal_lengths():
    q, k, v = _qkv(t=T, s=S)
    with pytest.raises(ValueError, match=f"same length, got T={T} and S={S}"):
        ops.causal_linear_attention(q, k, v)


@pytest.mark.parametrize("op_id,bad", list(_bad_shape_params()))
def test_bad_shapes(op_id, bad):
    name, op = SHAPE_OPS[op_id]
    q_shape, k_shape, v_shape, pattern = BAD_SHAPES[bad]
    with pytest.raises(ValueError, match=f"{name}: {pattern}"):
        op(_zeros(*q_shape), _zeros(*k_shape), _zeros(*v_shape))


@pytest.mark.parametrize(
    "key_lengths",
    [jnp.array([3, 4, 5]), jnp.array([[3], [4]]), jnp.array(3), jnp.array([3.0, 4.0]), [3, 4, 5]],
)
@pytest.mark.parametrize(
    "op_name,implementation",
    [
        ("linear_attention", None),
        ("softmax_attention", None),
        ("softmax_attention", "xla"),
        ("softmax_attention", "reference"),
    ],
)
def test_bad_key_lengths(op_name, implementation, key_lengths):
    q, k, v = _qkv(m=D)
    kwargs = {} if implementation is None else {"implementation": implementation}
    with pytest.raises(
        ValueError,
        match=rf"{op_name}: key_lengths must be an integer array of "
        rf"shape \({B},\)",
    ):
        getattr(ops, op_name)(q, k, v, key_lengths=key_lengths, **kwargs)


@pytest.mark.parametrize("implementation", [None, "xla", "reference"])
def test_causal_softmax_needs_equal_lengths(implementation):
    q, k, v = _qkv(t=T, s=S, m=D)
    with pytest.raises(ValueError, match=f"causal=True needs as many queries as keys, got T={T} and S={S}"):
        ops.softmax_attention(q, k, v, causal=True, implementation=implementation)


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_dot_product_attention_needs_equal_feature_dims(implementation):
    q, k, v = _qkv(d=D, m=M)
    with pytest.raises(
        ValueError,
        match=f"implementation='{implementation}'.*needs value features "
        f"M equal to key features D, got D={D}, M={M}",
    ):
        ops.softmax_attention(q, k, v, implementation=implementation)


@pytest.mark.parametrize("implementation", ["flash", "XLA", ""])
def test_unknown_softmax_implementation(implementation):
    q, k, v = _qkv(m=D)
    with pytest.raises(
        ValueError,
        match=f"unknown implementation {implementation!r}; expected "
        r"one of \(None, 'xla'",
    ):
        ops.softmax_attention(q, k, v, implementation=implementation)


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_softmax_mask_that_does_not_broadcast(implementation):
    q, k, v = _qkv(m=D)
    with pytest.raises(
        ValueError,
        match=re.escape(f"mask of shape {(T, S + 1)} does not broadcast to [B, H, T, S] = {(B, H, T, S)}"),
    ):
        ops.softmax_attention(q, k, v, mask=jnp.ones((T, S + 1), bool), implementation=implementation)


@pytest.mark.parametrize(
    "state_shapes",
    [
        ((B, H, D + 1, M), (B, H, D + 1)),  # F of another feature map
        ((B, H, D, M + 1), (B, H, D)),  # M
        ((B + 1, H, D, M), (B + 1, H, D)),  # batch
        ((B, H, D, M), (B, H + 1, D)),  # z alone wrong
    ],
)
def test_linear_attention_step_state_of_wrong_shape(state_shapes):
    s_shape, z_shape = state_shapes
    state = ops.LinearState(_zeros(*s_shape), _zeros(*z_shape))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"linear_attention_step: state shapes s {s_shape}, z {z_shape} do not fit the inputs, "
            f"which need s {(B, H, D, M)} and z {(B, H, D)}"
        ),
    ):
        ops.linear_attention_step(state, _zeros(B, H, D), _zeros(B, H, D), _zeros(B, H, M))


def test_linear_attention_step_state_sized_for_head_dim_with_favor():
    """FAVOR+ with F != D needs init_linear_state(B, H, F, M), not D."""
    fm = ops.FavorFeatureMap(jnp.ones((3 * D, D)))
    state = ops.init_linear_state(B, H, D, M)
    with pytest.raises(ValueError, match=re.escape(f"need s {(B, H, 3 * D, M)}")):
        ops.linear_attention_step(state, _zeros(B, H, D), _zeros(B, H, D), _zeros(B, H, M), feature_map=fm)


@pytest.mark.parametrize(
    "shapes,pattern",
    [
        (((B, 1, H, D), (B, H, D), (B, H, M)), "q_t must have 3 dimensions"),
        (((B, H, D), (B, H, D + 1), (B, H, M)), "q_t shape .* and k_t shape .* must be equal"),
        (((B, H, D), (B, H, D), (B + 1, H, M)), "v_t shape .* must share batch and heads"),
    ],
)
@pytest.mark.parametrize("step", ["linear", "softmax"])
def test_step_input_shapes(step, shapes, pattern):
    q, k, v = (_zeros(*s) for s in shapes)
    if step == "linear":
        name, call = (
            "linear_attention_step",
            lambda: ops.linear_attention_step(ops.init_linear_state(B, H, D, M), q, k, v),
        )
    else:
        name, call = (
            "softmax_attention_step",
            lambda: ops.softmax_attention_step(ops.init_kv_cache(B, 4, H, D, M), q, k, v),
        )
    with pytest.raises(ValueError, match=f"{name}: {pattern}"):
        call()


def test_softmax_attention_step_cache_of_wrong_shape():
    cache = ops.init_kv_cache(B, 4, H, D, M + 1)
    with pytest.raises(ValueError, match="softmax_attention_step: cache shapes"):
        ops.softmax_attention_step(cache, _zeros(B, H, D), _zeros(B, H, D), _zeros(B, H, M))


@pytest.mark.parametrize("max_length", [0, -1])
def test_init_kv_cache_needs_a_slot(max_length):
    with pytest.raises(ValueError, match=f"max_length must be >= 1, got {max_length}"):
        ops.init_kv_cache(B, max_length, H, D, M)


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_a_float_mask_is_refused_not_cast(implementation):
    q, k, v = _random_qkv()
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
    q, k, v = _random_qkv()
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


@pytest.mark.parametrize("bad", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_integer_or_boolean_q_k_v_are_refused(bad, dtype):
    arrays = dict(zip("qkv", _random_qkv()))
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


@pytest.mark.parametrize("lengths", [[-1, 3], [S + 1, 3], [2, 100]])
def test_key_lengths_outside_zero_to_s_are_refused_eagerly(lengths):
    q, k, v = _random_qkv()
    bad = [n for n in lengths if not 0 <= n <= S]
    for name, run in _key_length_ops(q, k, v, jnp.asarray(lengths, jnp.int32)):
        message = re.escape(f"key_lengths must be in [0, {S}]") + ".*" + re.escape(f"got {bad}")
        with pytest.raises(ValueError, match=message):
            run()


def test_key_lengths_under_jit_act_as_clamped():
    q, k, v = _random_qkv()

    @jax.jit
    def outputs(lengths):
        return [run() for _, run in _key_length_ops(q, k, v, lengths)]

    out_of_range = outputs(jnp.asarray([-3, S + 4], jnp.int32))
    clamped = outputs(jnp.asarray([0, S], jnp.int32))
    for got, want in zip(out_of_range, clamped):
        np.testing.assert_array_equal(jax.tree.leaves(got)[0], jax.tree.leaves(want)[0])


def test_key_lengths_at_the_bounds_are_accepted():
    q, k, v = _random_qkv()
    for _, run in _key_length_ops(q, k, v, jnp.asarray([0, S], jnp.int32)):
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(run()))


@pytest.mark.parametrize("impl", ops.LINEAR_IMPLEMENTATIONS)
def test_an_empty_sequence_returns_nothing_and_keeps_the_state(impl):
    q = jnp.zeros((B, 0, H, D))
    state = ops.LinearState(_x(4, B, H, D, D), jnp.abs(_x(5, B, H, D)))
    out, final = ops.causal_linear_attention(
        q, q, q, implementation=impl, initial_state=state, return_state=True
    )
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


@pytest.mark.parametrize("where, bad", [("v", jnp.nan), ("v", -jnp.inf), ("k", jnp.nan), ("k", jnp.inf)])
@pytest.mark.parametrize("impl", ["reference", "chunked", "associative_scan", "scan"])
def test_causal_linear_a_bad_later_value_never_reaches_earlier_outputs(impl, where, bad):
    s = 7
    clean, spoiled = _qkv_with(bad, where, s=s)
    kw = dict(implementation=impl, chunk_size=4, return_state=True)  # s sits mid-chunk: chunk [4, 8)
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
        lambda q, k, v: ops.causal_linear_attention(q, k, v, implementation="reference"),
        lambda q, k, v: ops.causal_linear_attention(q, k, v, implementation="chunked", chunk_size=4),
        lambda q, k, v: ops.softmax_attention(q, k, v, causal=True),
    ):
        grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[:, :7]), argnums=(0, 1, 2))(*spoiled)
        expected = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[:, :7]), argnums=(0, 1, 2))(*clean)
        for g, e in zip(grads, expected):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def _state(normalizer=True):
    return ops.init_linear_state(B, H, D, M, normalizer=normalizer)


SCALED_OPS = {
    "gated_linear_attention": lambda q, k, v, scale: ops.gated_linear_attention(q, k, v, scale=scale),
    "delta_rule_attention": lambda q, k, v, scale: ops.delta_rule_attention(
        q, k, v, jnp.ones(q.shape[:3]), scale=scale
    ),
    "softmax_attention": lambda q, k, v, scale: ops.softmax_attention(q, k, v, scale=scale),
    "gated_linear_attention_step": lambda q, k, v, scale: ops.gated_linear_attention_step(
        _state(normalizer=False), q[:, 0], k[:, 0], v[:, 0], scale=scale
    ),
    "delta_rule_attention_step": lambda q, k, v, scale: ops.delta_rule_attention_step(
        _state(normalizer=False),
        q[:, 0],
        k[:, 0],
        v[:, 0],
        jnp.ones((B, H)),
        scale=scale,
    ),
}


@pytest.mark.parametrize("name", SCALED_OPS)
@pytest.mark.parametrize(
    "scale, error, message",
    [
        (jnp.ones((H,)), ValueError, r"got an array of shape \(2,\) and dtype float32"),
        (jnp.asarray(2), ValueError, r"got an array of shape \(\) and dtype int32"),
        ("0.5", TypeError, r"got '0.5'"),
        (True, TypeError, r"got True"),
    ],
)
def test_a_scale_of_another_shape_or_kind_is_refused(name, scale, error, message):
    """A per-head scale would broadcast against the features instead of scaling the products."""
    with pytest.raises(error, match=f"{name}: scale must be None, a real number or a scalar .*{message}"):
        SCALED_OPS[name](*_causal_qkv(), scale)


NORMALISED_OPS = {
    "gated_linear_attention": lambda q, k, v, eps: ops.gated_linear_attention(q, k, v, eps=eps),
    "causal_linear_attention": lambda q, k, v, eps: ops.causal_linear_attention(q, k, v, eps=eps),
    "linear_attention": lambda q, k, v, eps: ops.linear_attention(q, k, v, eps=eps),
    "gated_linear_attention_step": lambda q, k, v, eps: ops.gated_linear_attention_step(
        _state(), q[:, 0], k[:, 0], v[:, 0], eps=eps
    ),
    "linear_attention_step": lambda q, k, v, eps: ops.linear_attention_step(
        _state(), q[:, 0], k[:, 0], v[:, 0], eps=eps
    ),
    "linear_attention_from_state": lambda q, k, v, eps: ops.linear_attention_from_state(_state(), q, eps=eps),
}


@pytest.mark.parametrize("name", NORMALISED_OPS)
@pytest.mark.parametrize(
    "eps, error, message",
    [
        (-1e-6, ValueError, r"got -1e-06"),
        (float("nan"), ValueError, r"got nan"),
        (jnp.asarray(-1.0), ValueError, r"got Array\(-1"),
        (jnp.ones((H,)), ValueError, r"got an array of shape \(2,\)"),
        ("1e-6", TypeError, r"got '1e-6'"),
    ],
)
def test_an_eps_below_zero_or_of_another_kind_is_refused(name, eps, error, message):
    """eps is added to the normaliser: a negative one can make it 0."""
    with pytest.raises(error, match=f"{name}: eps .* must be a finite number >= 0 .*{message}"):
        NORMALISED_OPS[name](*_causal_qkv(), eps)
