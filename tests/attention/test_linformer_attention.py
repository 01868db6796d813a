"""Linformer attention: identity projections give full softmax, shorter inputs equal explicit
zero padding, padding content cannot reach outputs, the memory form equals the parallel one,
and what it cannot do (causal, masks, too-long inputs) is refused by name."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_transformers import MultiHeadAttention, TransformerConfig, ops

B, T, S, H, D, M = 2, 7, 9, 3, 4, 5


def _qkv(s=S, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, T, H, D)).astype(dtype),
        rng.standard_normal((B, s, H, D)).astype(dtype),
        rng.standard_normal((B, s, H, M)).astype(dtype),
    )


def test_identity_projections_with_k_equal_n_are_full_softmax(x64):
    q, k, v = _qkv()
    eye = np.eye(S)
    out = ops.linformer_attention(q, k, v, eye, eye)
    np.testing.assert_allclose(out, ops.softmax_attention_reference(q, k, v), atol=1e-12)


def test_equals_its_formula_and_gradients_agree(x64):
    q, k, v = _qkv()
    rng = np.random.default_rng(1)
    e, f = rng.standard_normal((S, 3)), rng.standard_normal((S, 3))

    def formula(q, k, v, e, f):
        return ops.softmax_attention_reference(
            q, jnp.einsum("bshd,sk->bkhd", k, e), jnp.einsum("bshm,sk->bkhm", v, f)
        )

    np.testing.assert_allclose(ops.linformer_attention(q, k, v, e, f), formula(q, k, v, e, f), atol=1e-12)
    w = rng.standard_normal((B, T, H, M))
    g1 = jax.grad(lambda *a: jnp.sum(w * ops.linformer_attention(*a)), argnums=range(5))(q, k, v, e, f)
    g2 = jax.grad(lambda *a: jnp.sum(w * formula(*a)), argnums=range(5))(q, k, v, e, f)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-10)


def test_shorter_inputs_equal_zero_padding_to_max_length(x64):
    q, k, v = _qkv(s=6)
    rng = np.random.default_rng(2)
    e, f = rng.standard_normal((S, 4)), rng.standard_normal((S, 4))
    pad = [(0, 0), (0, S - 6), (0, 0), (0, 0)]
    padded = ops.linformer_attention(q, np.pad(k, pad), np.pad(v, pad), e, f, key_lengths=np.array([6, 6]))
    np.testing.assert_allclose(ops.linformer_attention(q, k, v, e, f), padded, atol=1e-12)


def test_padded_keys_cannot_reach_outputs():
    q, k, v = _qkv(dtype=np.float32)
    rng = np.random.default_rng(3)
    e, f = rng.standard_normal((S, 4)), rng.standard_normal((S, 4))
    lengths = np.array([9, 4])
    k2, v2 = k.copy(), v.copy()
    k2[1, 4:], v2[1, 4:] = 30.0, -30.0
    np.testing.assert_allclose(
        ops.linformer_attention(q, k, v, e, f, key_lengths=lengths),
        ops.linformer_attention(q, k2, v2, e, f, key_lengths=lengths),
        atol=1e-6,
    )


def test_too_long_input_and_bad_projection_are_named():
    q, k, v = _qkv(dtype=np.float32)
    with pytest.raises(ValueError, match="9 keys exceed the maximum length 8"):
        ops.linformer_attention(q, k, v, np.ones((8, 2)), np.ones((8, 2)))
    with pytest.raises(ValueError, match="projection e must be"):
        ops.linformer_attention(q, k, v, np.ones((9,)), np.ones((9, 2)))


# --- the "linformer" attention kind --------------------------------------------------------

E = 12
OPTIONS = {"max_length": 10, "projected_length": 4}


def _layer(**options):
    return MultiHeadAttention(
        E, 3, kind="linformer", attention_options={**OPTIONS, **options}, rngs=nnx.Rngs(0)
    )


def test_layer_shapes_gradients_and_padding_under_jit():
    mha = _layer()
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 10, E)).astype(np.float32)
    lengths = np.array([10, 6])
    call = nnx.jit(lambda m, x, lengths: m(x, key_lengths=lengths))
    y = call(mha, x, lengths)
    chex.assert_shape(y, (2, 10, E))
    x2 = x.copy()
    x2[1, 6:] = 9.0
    np.testing.assert_allclose(call(mha, x2, lengths)[1, :6], y[1, :6], atol=1e-5)
    grads = nnx.grad(lambda m: jnp.sum(m(x, key_lengths=lengths) ** 2))(mha)
    chex.assert_tree_all_finite(grads)
    assert float(jnp.abs(grads["core"]["key_projection"][...]).sum()) > 0


def test_share_kv_has_one_projection():
    assert _layer(share_kv=True).core.value_projection is None
    assert _layer().core.value_projection is not None


def test_memory_form_equals_parallel_cross_attention():
    mha = _layer()
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 5, E)).astype(np.float32)
    ctx = rng.standard_normal((2, 8, E)).astype(np.float32)
    lengths = np.array([8, 3])
    parallel = mha(x, ctx, key_lengths=lengths)
    memory = mha.init_memory(ctx, lengths)
    chex.assert_shape(memory.k_BJHD, (2, 4, 3, E // 3))  # J rows whatever the memory length
    stepped = np.stack([mha.attend_memory(memory, x[:, t]) for t in range(5)], 1)
    np.testing.assert_allclose(stepped, parallel, atol=1e-5)


def test_layer_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="no causal form"):
        MultiHeadAttention(E, 3, kind="linformer", causal=True, attention_options=OPTIONS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_length must be an integer >= 1.*required"):
        MultiHeadAttention(E, 3, kind="linformer", rngs=nnx.Rngs(0))
    mha = _layer()
    x = np.zeros((1, 4, E), np.float32)
    with pytest.raises(ValueError, match="arbitrary"):
        mha(x, mask=np.ones((4, 4), bool))
    with pytest.raises(ValueError, match="no recurrent form"):
        mha.init_state(1, max_length=4)
    with pytest.raises(ValueError, match="11 keys exceed the maximum length 10"):
        mha(np.zeros((1, 11, E), np.float32))
    with pytest.raises(ValueError, match="no causal form"):
        from linear_transformers import Decoder

        Decoder(
            TransformerConfig(model_dim=E, num_heads=3, attention="linformer", attention_options=OPTIONS),
            rngs=nnx.Rngs(0),
        )
