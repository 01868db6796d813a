"""Encoder / Decoder / CausalLM: parallel and recurrent forms agree, padding, generation,
inference-mode checks, bf16, gradients, and the authors' config names.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import small_config
from flax import nnx

from linear_transformers import CausalLM, Decoder, Encoder, TransformerConfig, generation, interop
from linear_transformers.transformer import ACTIVATIONS

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

E, H, B, T, S, V = 16, 2, 2, 7, 5, 11


def _x(shape, seed=1, scale=1.0):
    # NumPy inputs: no per-shape compilation of a random-number kernel.
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# Compiled once per module structure and reused across tests (eager dispatch is slow on CPU).
_call = nnx.jit(lambda m, *args, **kwargs: m(*args, **kwargs))
_step = nnx.jit(lambda m, state, x: m.step(state, x))


def _step_loop(model, state, xs_BT):
    """The plain RNN loop: one `step` call per time step (each compiled, not a scan)."""
    ys = []
    for t in range(xs_BT.shape[1]):
        state, y = _step(model, state, xs_BT[:, t])
        ys.append(y)
    return state, np.stack(ys, axis=1)


# --- Encoder ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["softmax", "linear", "favor", "relu"])
def test_encoder_shapes_and_key_lengths_honoured_at_valid_positions(name):
    encoder = Encoder(small_config(name, num_layers=2), rngs=nnx.Rngs(0))
    assert encoder.num_layers == 2
    assert jax.tree.leaves(nnx.state(encoder.layers, nnx.Param))[0].shape[0] == 2  # stacked
    x = _x((B, T, E))
    lengths = jnp.array([T, 3])
    valid = (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[..., None]
    x_changed = np.where(valid, x, _x(x.shape, seed=5, scale=10.0))
    y = _call(encoder, x, key_lengths=lengths)
    chex.assert_shape(y, (B, T, E))
    chex.assert_tree_all_finite(y)
    # Final LayerNorm: zero mean per position.
    np.testing.assert_allclose(np.mean(y, -1), 0.0, atol=1e-4)
    y_changed = _call(encoder, x_changed, key_lengths=lengths)
    np.testing.assert_allclose(np.where(valid, y, 0), np.where(valid, y_changed, 0), atol=1e-5, rtol=1e-5)
    # Padding equals truncation: element 1 encoded alone at its true length.
    np.testing.assert_allclose(y[1, :3], _call(encoder, x[1:, :3])[0], atol=1e-5, rtol=1e-5)
    # Without padding the changed rows leak into valid positions (the check above can fail).
    y_full = _call(encoder, x_changed, key_lengths=jnp.array([T, T]))
    assert not np.allclose(y_full[1, :3], y[1, :3], atol=1e-3)


def test_encoder_without_final_normalization_has_no_final_norm():
    encoder = Encoder(small_config(final_normalization=False), rngs=nnx.Rngs(0))
    assert encoder.final_norm is None
    y = _call(encoder, _x((B, T, E)))
    chex.assert_shape(y, (B, T, E))
    # The last op is the layer's own post-norm residual LayerNorm, nothing after it.
    np.testing.assert_allclose(np.mean(y, -1), 0.0, atol=1e-4)


@pytest.mark.parametrize("name", ["softmax", "linear", "causal-linear", "favor", "relu"])
def test_causal_encoder_recurrent_matches_parallel(name):
    encoder = Encoder(small_config(name), causal=True, rngs=nnx.Rngs(0))
    encoder.eval()
    x = _x((B, T, E))
    y_par = _call(encoder, x)
    _, y_loop = _step_loop(encoder, encoder.init_state(B, max_length=T), x)
    _, y_scan = generation.scan_steps(encoder, encoder.init_state(B, max_length=T), x)
    chex.assert_shape((y_loop, y_scan), (B, T, E))
    np.testing.assert_allclose(y_loop, y_par, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(y_scan, y_par, atol=1e-5, rtol=1e-5)


def test_causal_encoder_state_stacks_the_layers_states():
    encoder = Encoder(small_config("linear", num_layers=2), causal=True, rngs=nnx.Rngs(0))
    state = encoder.init_state(B)
    # Linear attention: constant-size (S, z) state, [B, H, F, M] and [B, H, F], per layer.
    chex.assert_shape(state.s_BHFM, (2, B, H, E // H, E // H))
    chex.assert_shape(state.z_BHF, (2, B, H, E // H))
    state2, _ = generation.scan_steps(encoder, state, _x((B, T, E)))
    chex.assert_trees_all_equal_shapes(state, state2)


# --- Decoder ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, num_layers", [("softmax", 2), ("linear", 1), ("causal-linear", 1)])
def test_decoder_recurrent_matches_parallel(name, num_layers):
    decoder = Decoder(small_config(name, num_layers=num_layers), rngs=nnx.Rngs(0))
    decoder.eval()
    x, memory = _x((B, T, E)), _x((B, S, E), seed=2)
    lengths = jnp.array([S, 2])
    y_par = _call(decoder, x, memory, memory_lengths=lengths)
    chex.assert_shape(y_par, (B, T, E))
    state = decoder.init_state(B, memory=memory, memory_lengths=lengths, max_length=T)
    if name == "softmax":  # The plain loop once; scan_steps runs the same `step` for every kind.
        _, y_loop = _step_loop(decoder, state, x)
        np.testing.assert_allclose(y_loop, y_par, atol=1e-5, rtol=1e-5)
    _, y_scan = generation.scan_steps(decoder, state, x)
    np.testing.assert_allclose(y_scan, y_par, atol=1e-5, rtol=1e-5)
    # memory_lengths is honoured (the comparison above would notice if it were dropped).
    y_full = _call(decoder, x, memory, memory_lengths=jnp.array([S, S]))
    assert not np.allclose(y_full[1], y_par[1], atol=1e-3)
    np.testing.assert_allclose(y_full[0], y_par[0], atol=1e-6)


def test_decoder_causal_linear_cross_attention_defaults_to_linear():
    config = small_config("causal-linear")
    assert config.cross_kind == "linear"
    decoder = Decoder(config, rngs=nnx.Rngs(0))
    assert decoder.layers.cross_attention.core.kind == "linear"
    assert not decoder.layers.cross_attention.causal
    assert decoder.layers.self_attention.core.kind == "causal-linear"


# --- CausalLM -----------------------------------------------------------------------------------


def _lm(name="linear", seed=0, **overrides):
    overrides.setdefault("num_layers", 2)
    return CausalLM(small_config(name, **overrides), V, rngs=nnx.Rngs(seed))


def _tokens(shape, seed=3):
    return np.random.default_rng(seed).integers(0, V, shape).astype(np.int32)


@pytest.mark.parametrize("name", ["softmax", "linear", "favor"])
def test_lm_scan_steps_matches_parallel(name):
    model = _lm(name)
    model.eval()
    tokens = _tokens((B, T))
    logits = _call(model, tokens)
    chex.assert_shape(logits, (B, T, V))
    state, logits_rec = generation.scan_steps(model, model.init_state(B, max_length=T), tokens)
    chex.assert_shape(logits_rec, (B, T, V))
    np.testing.assert_allclose(logits_rec, logits, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(state.position, T)


@pytest.mark.parametrize("name, P", [("softmax", 3), ("linear", 1)])
def test_generate_greedy_matches_parallel_argmax(name, P):
    model = _lm(name)
    model.eval()
    N = T - P
    prompt = _tokens((B, P))
    out = generation.generate(model, prompt, N, key=jax.random.key(0), temperature=0.0)
    chex.assert_shape(out, (B, P + N))
    np.testing.assert_array_equal(out[:, :P], prompt)
    # Greedy: token i is the argmax of the parallel model's logits at position i - 1.
    logits = _call(model, out)
    np.testing.assert_array_equal(out[:, P:], np.argmax(logits[:, P - 1 : -1], axis=-1))
    # Greedy decoding ignores the key.
    np.testing.assert_array_equal(
        generation.generate(model, prompt, N, key=jax.random.key(9), temperature=0.0), out
    )
    # Sampling (same compiled loop): valid tokens, prompt kept, reproducible for a key.
    sampled = generation.generate(model, prompt, N, key=jax.random.key(0), temperature=1.0)
    chex.assert_shape(sampled, (B, P + N))
    np.testing.assert_array_equal(sampled[:, :P], prompt)
    assert np.all((np.asarray(sampled) >= 0) & (np.asarray(sampled) < V))
    np.testing.assert_array_equal(
        generation.generate(model, prompt, N, key=jax.random.key(0), temperature=1.0), sampled
    )


# --- inference mode -----------------------------------------------------------------------------


def test_recurrent_inference_in_train_mode_with_dropout_raises():
    model = _lm("linear", dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match=r"eval\(\)"):
        model.init_state(B, max_length=T)
    model.eval()
    state = model.init_state(B, max_length=T)
    model.train()
    with pytest.raises(ValueError, match=r"eval\(\)"):
        model.step(state, _tokens((B,)))
    with pytest.raises(ValueError, match=r"eval\(\)"):
        generation.generate(model, _tokens((B, 2)), 3, key=jax.random.key(0))
    model.eval()
    model.init_state(B, max_length=T)  # eval() lifts the refusal


def test_decoder_recurrent_inference_in_train_mode_with_dropout_raises():
    decoder = Decoder(small_config("softmax", dropout=0.1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"eval\(\)"):
        decoder.init_state(B, memory=_x((B, S, E)), max_length=T)


# --- precision and gradients --------------------------------------------------------------------


def test_causal_encoder_bf16_inputs_finite():
    encoder = Encoder(small_config("linear"), causal=True, rngs=nnx.Rngs(0))
    encoder.eval()
    x32 = _x((B, T, E), scale=4.0)
    y_ref = _call(encoder, x32)
    y = _call(encoder, x32.astype(jnp.bfloat16))
    chex.assert_shape(y, (B, T, E))
    chex.assert_tree_all_finite(y)
    np.testing.assert_allclose(np.asarray(y).astype(np.float32), y_ref, atol=0.1, rtol=0.1)

    # All parameters in bf16 too: the whole computation in bfloat16.
    nnx.update(encoder, jax.tree.map(lambda p: p.astype(jnp.bfloat16), nnx.state(encoder, nnx.Param)))
    y16 = _call(encoder, x32.astype(jnp.bfloat16))
    chex.assert_tree_all_finite(y16)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16).astype(np.float32), y_ref, atol=0.25, rtol=0.1)
    _, y_rec = generation.scan_steps(
        encoder, encoder.init_state(B, max_length=T, dtype=jnp.bfloat16), x32.astype(jnp.bfloat16)
    )
    chex.assert_tree_all_finite(y_rec)


@pytest.mark.parametrize("name", ["linear", "favor"])
def test_lm_loss_gradients_finite(name):
    model = _lm(name, num_layers=1)
    tokens = _tokens((B, T + 1))

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, tokens)
    assert np.isfinite(float(loss))
    chex.assert_tree_all_finite(grads)
    flat = jax.tree.leaves(grads)
    assert flat and all(np.any(np.asarray(g) != 0) for g in flat), "every parameter has a gradient"
    chex.assert_trees_all_equal_shapes(grads, nnx.state(model, nnx.Param))


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_lm_causal_impls_agree_on_logits_and_parameter_gradients():
    """Model level: the same parameters under every causal linear impl give the same loss and
    the same gradient for every parameter (chunk_size 3 does not divide T = 7)."""
    tokens = _tokens((B, T + 1))
    results = {}
    for impl in ("reference", "associative_scan", "chunked", "scan"):
        options = {"implementation": impl, "chunk_size": 3} if impl == "chunked" else {"implementation": impl}
        model = _lm("linear", num_layers=2, attention_options=options)
        assert model.transformer.layers.attention.core.options.implementation == impl
        results[impl] = nnx.jit(nnx.value_and_grad(_lm_loss))(model, tokens)
    loss_ref, grads_ref = results.pop("reference")
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads_ref))
    for impl, (loss, grads) in results.items():
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-5, err_msg=impl)
        chex.assert_trees_all_close(grads, grads_ref, atol=1e-5, rtol=1e-4)


# --- authors' config names ------------------------------------------------------------------------


def test_config_from_builder_kwargs_authors_names():
    config = interop.config_from_builder_kwargs(
        n_layers=2,
        n_heads=4,
        query_dimensions=8,
        value_dimensions=6,
        feed_forward_dimensions=32,
        attention_type="causal-linear",
        feature_map="elu",
        dropout=0.0,
    )
    assert config.model_dim == 4 * 6
    assert config.num_layers == 2 and config.num_heads == 4
    assert config.query_dim == 8 and config.value_dim == 6
    assert config.feed_forward_dim == 32 and config.hidden_dim == 32
    assert config.attention == "causal-linear"
    assert dict(config.attention_options) == {"feature_map": "elu"}
    # Built and run abstractly (traced, not compiled): shapes are what is checked here.
    encoder = nnx.eval_shape(lambda: Encoder(config, causal=True, rngs=nnx.Rngs(0)))
    attn = encoder.layers.attention
    assert (attn.query_dim, attn.value_dim) == (8, 6)
    chex.assert_shape(attn.query.kernel, (2, 24, 4 * 8))  # [L, in, out]: the layers stacked
    chex.assert_shape(attn.value.kernel, (2, 24, 4 * 6))
    chex.assert_shape(encoder.layers.feed_forward.linear1.kernel, (2, 24, 32))
    assert attn.core.kind == "causal-linear" and attn.core.options.feature_map == "elu"
    y = jax.eval_shape(
        lambda x: Encoder(config, causal=True, rngs=nnx.Rngs(0))(x),
        jax.ShapeDtypeStruct((B, T, config.model_dim), jnp.float32),
    )
    chex.assert_shape(y, (B, T, 24))


def test_config_from_builder_kwargs_full_is_softmax():
    config = interop.config_from_builder_kwargs(
        n_heads=2, value_dimensions=8, query_dimensions=8, attention_type="full"
    )
    assert config.attention == "softmax"
    assert config.model_dim == 16


def test_layer_norm_epsilon_is_the_one_every_norm_uses():
    # A small input: its variance (~1e-6) is of epsilon's order, so epsilon decides the output.
    x = 1e-3 * jax.random.normal(jax.random.key(0), (1, 3, 8))

    def normed(eps):
        config = TransformerConfig(
            num_layers=1, num_heads=2, model_dim=8, dropout=0.0, layer_norm_epsilon=eps
        )
        norm = Encoder(config, rngs=nnx.Rngs(0)).final_norm
        return norm(x)

    centered = x - x.mean(-1, keepdims=True)
    for eps in (1e-6, 1e-2):
        expected = centered / jnp.sqrt((centered**2).mean(-1, keepdims=True) + eps)
        np.testing.assert_allclose(normed(eps), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"layer_norm_epsilon must be > 0, got 0"):
        TransformerConfig(layer_norm_epsilon=0)


def test_gelu_is_exact_and_gelu_tanh_the_approximation():
    x = jnp.linspace(-3, 3, 13)
    exact = 0.5 * x * (1 + jax.scipy.special.erf(x / jnp.sqrt(2.0)))
    np.testing.assert_allclose(ACTIVATIONS["gelu"](x), exact, atol=1e-6)
    np.testing.assert_allclose(ACTIVATIONS["gelu_tanh"](x), jax.nn.gelu(x, approximate=True), atol=1e-7)
    assert float(jnp.max(jnp.abs(ACTIVATIONS["gelu"](x) - ACTIVATIONS["gelu_tanh"](x)))) > 1e-4


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_layers", 0, r"num_layers must be >= 1, got 0"),
        ("query_dim", 0, r"query_dim must be None \(derived\) or >= 1, got 0"),
        ("value_dim", -2, r"value_dim must be None \(derived\) or >= 1, got -2"),
        ("feed_forward_dim", 0, r"feed_forward_dim must be None \(derived\) or >= 1, got 0"),
        ("softmax_temp", 0.0, r"softmax_temp must be None \(1/sqrt\(query_dim\)\) or > 0, got 0.0"),
        ("dropout", 1.0, r"dropout must be in \[0, 1\), got 1.0"),
        ("activation", "swish", r"activation 'swish' is unknown; expected one of"),
    ],
)
def test_a_transformer_config_names_a_bad_field(field, value, match):
    with pytest.raises(ValueError, match=f"TransformerConfig.{match}"):
        TransformerConfig(**{field: value})
