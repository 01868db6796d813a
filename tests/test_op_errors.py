"""Bad arguments to the attention ops raise ValueErrors that say what is wrong.

Legend: B batch, T query time, S key time, H heads, D key/query features, F feature-map features,
M value features.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from linear_transformers import ops

B, T, S, H, D, M = 2, 5, 7, 2, 4, 6


def _zeros(*shape):
    return jnp.zeros(shape, jnp.float32)


def _qkv(t=T, s=S, d=D, m=M):
    return _zeros(B, t, H, d), _zeros(B, s, H, d), _zeros(B, s, H, m)


def _causal_qkv():
    return _qkv(t=T, s=T)


# ---------------------------------------------------------------- feature maps


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


# ---------------------------------------------------------------- causal linear attention


def test_unknown_impl():
    q, k, v = _causal_qkv()
    with pytest.raises(ValueError, match=r"unknown impl 'flash'; expected one of \("):
        ops.causal_linear_attention(q, k, v, impl="flash")


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


# ---------------------------------------------------------------- shapes, shared by every op


SHAPE_OPS = {
    # id: (name in the message, call(q, k, v))
    "causal_linear": ("causal_linear_attention", ops.causal_linear_attention),
    "causal_linear_jit_scan": (
        "causal_linear_attention",
        jax.jit(functools.partial(ops.causal_linear_attention, impl="scan", chunk_size=4)),
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


# ---------------------------------------------------------------- softmax attention


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


# ---------------------------------------------------------------- recurrent steps


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
