"""`prefill`: a block of tokens read in parallel form from a recurrent state equals `step` over
the block and the parallel form, at core, MultiHeadAttention, layer, stack and model level;
streaming in segments; generate / sample_images(prefix) / greedy_decode(prefix) read their
prompts with one prefill and give the tokens of the token-by-token path; what cannot prefill,
and what cannot run sequence-parallel, is refused.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import small_config
from flax import nnx

from linear_transformers import (
    CausalLM,
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderDecoder,
    EncoderLayer,
    MultiHeadAttention,
    TransformerConfig,
    generation,
    greedy_decode,
    sequence_parallel_kinds,
)
from linear_transformers.attention import attention_class, attention_options, make_attention_core
from linear_transformers.image_generator import ImageGenerator, sample_images
from linear_transformers.mixture import mol_sample

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

B, T, E, H, V = 2, 7, 16, 2, 11
D = M = E // H
FAVOR = {"feature_map": "favor", "num_features": 12}
KINDS = {  # name -> (kind, options); chunk_size 2 makes chunks straddle the block boundaries.
    "softmax": ("softmax", {}),
    "linear": ("linear", {}),
    "favor": ("linear", FAVOR),
    "causal-linear": ("causal-linear", {"chunk_size": 2}),
}


def _x(shape, seed=1, dtype=np.float32):
    # NumPy inputs: no per-shape compilation of a random-number kernel.
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _tokens(shape, seed=3, high=V):
    return np.random.default_rng(seed).integers(0, high, shape).astype(np.int32)


def _config(name="linear", **overrides):
    attention, options = KINDS[name]
    attention = overrides.pop("attention", attention)
    return small_config(attention, overrides.pop("attention_options", options), **overrides)


def _args(x):
    return x if isinstance(x, tuple) else (x,)  # cores take (q, k, v), modules one input


def _steps(module, state, xs_BT):
    """The plain RNN: `step` over axis 1 of xs_BT (an array or a (q, k, v) tuple), scanned."""
    xs_TB = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), xs_BT)
    state, ys_TB = jax.lax.scan(lambda s, x: module.step(s, *_args(x)), state, xs_TB)
    return state, jnp.swapaxes(ys_TB, 0, 1)


# How each test builds its initial state and runs the parallel form, from (module, xs, *extra).
def _self_state(m, xs, *extra):
    B, T = jax.tree.leaves(xs)[0].shape[:2]
    return m.init_state(B, max_length=T)


def _core_state(m, qkv):
    B, T = qkv[0].shape[:2]
    return m.init_state(B, max_length=T + 2, dtype=qkv[0].dtype)  # a softmax cache with unused slots


def _self_parallel(m, xs):
    return m(*_args(xs))


def _decoder_state(m, x, memory, lengths):
    return m.init_state(x.shape[0], memory=memory, memory_lengths=lengths, max_length=x.shape[1])


def _decoder_parallel(m, x, memory, lengths):
    return m(x, memory, memory_lengths=lengths)


def _image_state(m, inputs, x):
    return m.init_state(inputs.shape[0])


def _image_parallel(m, inputs, x):
    return m(x)


def _seq2seq_state(m, target, source, lengths):
    memory = m.encode(source, source_lengths=lengths)
    return m.init_state(memory.shape[0], memory=memory, memory_lengths=lengths, max_length=target.shape[1])


def _seq2seq_parallel(m, target, source, lengths):
    return m(source, target, source_lengths=lengths)


@functools.partial(nnx.jit, static_argnames=("cuts", "init", "parallel", "reference"))
def _forms(module, xs_BT, *extra, cuts, init=_self_state, parallel=_self_parallel, reference=True):
    """Every form over xs_BT in one compiled program (compilation dominates these tests' time
    on CPU): the parallel form; from `init`'s state, `step` over the block before cuts[0]
    (none when it is 0) and one `prefill` per later block; with `reference`, `step` over
    everything. -> dict(parallel, y, state, y_steps, state_steps)."""
    state = init(module, xs_BT, *extra)
    out = {"parallel": parallel(module, xs_BT, *extra)}
    if reference:
        out["state_steps"], out["y_steps"] = _steps(module, state, xs_BT)
    bounds = (0,) + tuple(cuts) + (jax.tree.leaves(xs_BT)[0].shape[1],)
    blocks = [jax.tree.map(lambda x: x[:, lo:hi], xs_BT) for lo, hi in zip(bounds, bounds[1:])]
    ys = []
    if cuts[0]:
        state, y = _steps(module, state, blocks[0])
        ys.append(y)
    for block in blocks[1:]:
        state, y = module.prefill(state, *_args(block))
        ys.append(y)
    out["state"], out["y"] = state, jnp.concatenate(ys, axis=1)
    return out


def _check_forms(out, tol, parallel_tol=None):
    """Prefill == parallel, and where computed, steps == parallel and prefill's state == steps'."""
    parallel_tol = parallel_tol or tol
    np.testing.assert_allclose(out["y"], out["parallel"], atol=parallel_tol, rtol=parallel_tol)
    if "y_steps" in out:
        np.testing.assert_allclose(out["y_steps"], out["parallel"], atol=parallel_tol, rtol=parallel_tol)
        np.testing.assert_allclose(out["y"], out["y_steps"], atol=tol, rtol=tol)
        chex.assert_trees_all_close(out["state"], out["state_steps"], atol=tol, rtol=tol)
        chex.assert_trees_all_equal_dtypes(out["state"], out["state_steps"])


# --- core level (float64: the states are compared too) -------------------------------------------


def _core(name, seed=0):
    kind, options = KINDS[name]
    return make_attention_core(
        kind, causal=True, num_heads=H, head_dim=D, value_dim=M, rngs=nnx.Rngs(seed), options=options
    )


@pytest.mark.parametrize("name", list(KINDS))
def test_core_prefill_equals_steps_and_parallel(name, x64):
    core = _core(name)
    qkv = tuple(_x((B, T, H, D), seed=s, dtype=np.float64) for s in (1, 2, 3))
    # Steps over the first 2 tokens, then prefills of 3 and 2 tokens from the nonzero state.
    out = _forms(core, qkv, cuts=(2, 5), init=_core_state)
    # softmax's parallel form (jax.nn.dot_product_attention) is not float64-exact.
    _check_forms(out, 1e-10, parallel_tol=1e-6 if name == "softmax" else 1e-10)
    if name == "softmax":
        assert int(out["state"].length) == T


def test_linear_core_prefill_key_lengths_leave_the_state_after_the_real_tokens(x64):
    core = _core("linear")
    q, k, v = (_x((B, T, H, D), seed=s, dtype=np.float64) for s in (1, 2, 3))

    @nnx.jit
    def run(core, q, k, v, lengths):
        init = core.init_state(B, dtype=q.dtype)
        padded = core.prefill(init, q, k, v, key_lengths=lengths)
        full_state, _ = core.prefill(init, q, k, v)
        short = _steps(core, init, (q[:, :4], k[:, :4], v[:, :4]))
        return padded, full_state, short

    (state, out), full_state, (short_state, short_out) = run(core, q, k, v, jnp.array([T, 4]))
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[0], state), jax.tree.map(lambda x: x[0], full_state), atol=1e-10
    )
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[1], state), jax.tree.map(lambda x: x[1], short_state), atol=1e-10
    )
    np.testing.assert_allclose(out[1, :4], short_out[1], atol=1e-10)
    # The softmax cache keeps one length for the batch: per-example lengths are refused.
    softmax = _core("softmax")
    with pytest.raises(ValueError, match="one length for the whole batch"):
        softmax.prefill(None, q, k, v, key_lengths=jnp.array([T, 4]))


# --- MultiHeadAttention and layers ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_mha_prefill_equals_parallel(name):
    kind, options = KINDS[name]
    mha = MultiHeadAttention(E, H, kind=kind, causal=True, attention_options=options, rngs=nnx.Rngs(0))
    _check_forms(_forms(mha, _x((B, T, E)), cuts=(1, 4)), 1e-5)


@pytest.mark.parametrize(
    "kind, options",
    [("softmax", {}), ("linear", {}), ("linformer", {"max_length": 9, "projected_length": 4})],
)
def test_mha_attend_memory_takes_a_block_of_queries(kind, options):
    mha = MultiHeadAttention(E, H, kind=kind, kv_features=12, attention_options=options, rngs=nnx.Rngs(0))
    x, ctx, lengths = _x((B, T, E)), _x((B, 9, 12), seed=2), jnp.array([9, 3])

    @nnx.jit
    def run(mha, x, ctx, lengths):
        memory = mha.init_memory(ctx, lengths)
        return (
            mha.attend_memory(memory, x),
            mha.attend_memory(memory, x[:, 3]),
            mha(x, ctx, key_lengths=lengths),
        )

    y_block, y_step, y_par = run(mha, x, ctx, lengths)
    np.testing.assert_allclose(y_block, y_par, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(y_step, y_block[:, 3], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\[batch, features\] \(one step\) or"):
        mha.attend_memory(None, x[0, 0])


def test_encoder_and_decoder_layer_prefill_equal_parallel():
    config = _config("softmax")
    x = _x((B, T, E))
    layer = EncoderLayer(config, causal=True, rngs=nnx.Rngs(0))
    _check_forms(_forms(layer, x, cuts=(3,), reference=False), 1e-5)
    layer = DecoderLayer(config, rngs=nnx.Rngs(0))
    memory, lengths = _x((B, 5, E), seed=2), jnp.array([5, 2])
    _check_forms(
        _forms(
            layer,
            x,
            memory,
            lengths,
            cuts=(3,),
            init=_decoder_state,
            parallel=_decoder_parallel,
            reference=False,
        ),
        1e-5,
    )


# --- stacks --------------------------------------------------------------------------------------


def test_causal_encoder_prefill_equals_parallel_and_steps():
    encoder = Encoder(_config("causal-linear", num_layers=2), causal=True, rngs=nnx.Rngs(0))
    encoder.eval()
    _check_forms(_forms(encoder, _x((B, T, E)), cuts=(1, 4)), 1e-5)


def test_decoder_prefill_with_padded_memory_equals_parallel():
    decoder = Decoder(_config("softmax", num_layers=2), rngs=nnx.Rngs(0))
    decoder.eval()
    x, memory = _x((B, T, E)), _x((B, 5, E), seed=2)
    out = _forms(
        decoder,
        x,
        memory,
        jnp.array([5, 2]),
        cuts=(2,),
        init=_decoder_state,
        parallel=_decoder_parallel,
        reference=False,
    )
    _check_forms(out, 1e-5)
    # The memory padding is honoured (the comparison above would notice if it were dropped).
    unpadded = _forms(
        decoder,
        x,
        memory,
        jnp.array([5, 5]),
        cuts=(2,),
        init=_decoder_state,
        parallel=_decoder_parallel,
        reference=False,
    )
    assert not np.allclose(unpadded["y"][1], out["y"][1], atol=1e-3)


# --- models --------------------------------------------------------------------------------------


def _lm(name="linear", seed=0, **overrides):
    overrides.setdefault("num_layers", 1)
    model = CausalLM(_config(name, **overrides), V, rngs=nnx.Rngs(seed))
    model.eval()
    return model


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_lm_steps_then_streamed_segments_equal_one_parallel_pass(name):
    """Steps over the first 3 tokens, then the docstring's streaming recipe over the rest (for
    segment in segments: state, logits = model.prefill(state, segment)), all in one program."""
    out = _forms(_lm(name), _tokens((B, 24), seed=5), cuts=(3, 10))
    _check_forms(out, 1e-4)
    np.testing.assert_array_equal(out["state"].position, 24)


def _image_model(kind="linear", seed=0, length=12):
    config = TransformerConfig(
        num_layers=1, num_heads=H, model_dim=E, feed_forward_dim=32, dropout=0.0, attention=kind
    )
    model = ImageGenerator(config, num_classes=17, num_mixtures=3, max_length=length, rngs=nnx.Rngs(seed))
    model.eval()
    return model


def test_image_generator_prefill_reads_tokens_as_step_does():
    model = _image_model("linear")
    x = _tokens((B, 12), high=17)
    out = _forms(
        model,
        model.shifted_inputs(x),
        x,
        cuts=(3, 8),
        init=_image_state,
        parallel=_image_parallel,
        reference=False,
    )
    _check_forms(out, 2e-5)
    np.testing.assert_array_equal(out["state"].position, 12)


def _seq2seq(kind="linear", seed=0):
    config = TransformerConfig(
        num_layers=1, num_heads=H, model_dim=E, feed_forward_dim=32, dropout=0.0, attention=kind
    )
    model = EncoderDecoder(config, config, V, rngs=nnx.Rngs(seed))
    model.eval()
    return model


def _source(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, V, (3, 9)).astype(np.int32), np.array([9, 5, 2], np.int32)


def test_encoder_decoder_prefill_with_source_padding_equals_parallel():
    source, lengths = _source()  # (the softmax decoder: the stack test above, greedy_decode)
    out = _forms(
        _seq2seq("linear"),
        _tokens((3, 6), seed=4),
        source,
        lengths,
        cuts=(2,),
        init=_seq2seq_state,
        parallel=_seq2seq_parallel,
        reference=False,
    )
    _check_forms(out, 2e-4)
    np.testing.assert_array_equal(out["state"].position, 6)


# --- the samplers read their prompts with one prefill ----------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 4))
def _generate_token_by_token(graphdef, params, prompt_BT, key, num_steps, temperature):
    """`generation.generate` as it was before prefill: the prompt read by a scan of `step`."""
    model = nnx.merge(graphdef, params)
    B, P = prompt_BT.shape
    state = model.init_state(B, max_length=P + num_steps)
    state, _ = jax.lax.scan(model.step, state, prompt_BT[:, :-1].T)

    def sample_step(carry, key_t):
        state, token_B = carry
        state, logits_BV = model.step(state, token_B)
        greedy = jnp.argmax(logits_BV, axis=-1)
        sampled = jax.random.categorical(key_t, logits_BV / jnp.maximum(temperature, 1e-6))
        next_B = jnp.where(temperature > 0, sampled, greedy).astype(prompt_BT.dtype)
        return (state, next_B), next_B

    keys = jax.random.split(key, num_steps)
    _, new_TB = jax.lax.scan(sample_step, (state, prompt_BT[:, -1]), keys)
    return jnp.concatenate([prompt_BT, new_TB.T], axis=1)


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_generate_equals_the_token_by_token_path(name):
    model = _lm(name)
    graphdef, params = nnx.split(model)
    prompt = _tokens((B, 4))
    for temperature in (0.0, 1.0):  # one compilation each way: the temperature is traced
        key = jax.random.key(7)
        out = generation.generate(model, prompt, 3, key=key, temperature=temperature)
        expected = _generate_token_by_token(
            graphdef, params, jnp.asarray(prompt), key, 3, jnp.float32(temperature)
        )
        np.testing.assert_array_equal(out, expected)


@functools.partial(jax.jit, static_argnums=(0, 3, 6))
def _sample_token_by_token(graphdef, params, key, batch, prefix_BT, prefix_length, num_steps):
    """`sample_images` as it was before prefill: every step recurrent, forced where prefixed."""
    model = nnx.merge(graphdef, params)
    state = model.init_state(batch)
    keys = jax.random.split(key, model.max_length)[:num_steps]

    def body(carry, inputs):
        state, token_B = carry
        t, key_t = inputs
        state, params_BP = model.step(state, token_B)
        drawn_B = mol_sample(key_t, params_BP, model.num_classes)
        token_B = jnp.where(t < prefix_length, prefix_BT[:, t], drawn_B)
        return (state, token_B), token_B

    start_B = jnp.full((batch,), model.start_token, jnp.int32)
    _, tokens_TB = jax.lax.scan(body, (state, start_B), (jnp.arange(num_steps), keys))
    return jnp.pad(tokens_TB.T, ((0, 0), (0, model.max_length - num_steps)))


def test_sample_images_with_prefix_equals_the_token_by_token_path():
    # Softmax: the prefill fills the cache the steps then extend. (test_image_generator's
    # sampler tests run the linear kind's prefix through the same path.)
    model = _image_model("softmax", seed=2)
    graphdef, params = nnx.split(model)
    key = jax.random.key(11)
    prefix = _tokens((3, 12), seed=4, high=17)
    for k in (1, 5, 12):  # 12: the whole image given, nothing drawn
        images = sample_images(model, key, 3, prefix=prefix[:, :k])
        padded = jnp.pad(jnp.asarray(prefix[:, :k]), ((0, 0), (0, 12 - k)))
        # The old path traces the prefix length: one compilation for every k.
        expected = _sample_token_by_token(graphdef, params, key, 3, padded, jnp.int32(k), 12)
        np.testing.assert_array_equal(images, expected, err_msg=f"k={k}")
        np.testing.assert_array_equal(images[:, :k], prefix[:, :k])
    # Stopping inside the prefix: the given sub-pixels, zeros after them.
    images = sample_images(model, key, 3, prefix=prefix[:, :5], num_steps=3)
    np.testing.assert_array_equal(images, np.pad(prefix[:, :3], ((0, 0), (0, 9))))


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _greedy_token_by_token(graphdef, params, source_BS, num_steps, start_token, source_lengths, prefix_BT):
    """greedy_decode with a forced prefix, every token (start, prefix) read by `step`."""
    model = nnx.merge(graphdef, params)
    memory_BSE = model.encode(source_BS, source_lengths=source_lengths)
    K = prefix_BT.shape[1]
    state = model.init_state(
        memory_BSE.shape[0], memory=memory_BSE, memory_lengths=source_lengths, max_length=K + num_steps
    )
    start_B1 = jnp.full((source_BS.shape[0], 1), start_token, source_BS.dtype)
    inputs_BK1 = jnp.concatenate([start_B1, prefix_BT], axis=1)
    state, _ = jax.lax.scan(model.step, state, inputs_BK1[:, :K].T)

    def body(carry, _):
        state, token_B = carry
        state, logits_BV = model.step(state, token_B)
        token_B = jnp.argmax(logits_BV, axis=-1).astype(source_BS.dtype)
        return (state, token_B), token_B

    _, tokens_TB = jax.lax.scan(body, (state, inputs_BK1[:, K]), length=num_steps)
    return tokens_TB.T


def test_greedy_decode_with_prefix_equals_the_token_by_token_path():
    model = _seq2seq("softmax", seed=1)
    source, lengths = _source(1)
    prefix = _tokens((3, 3), seed=6)
    tokens = greedy_decode(model, source, 4, start_token=0, source_lengths=lengths, prefix=prefix)
    chex.assert_shape(tokens, (3, 4))
    graphdef, params = nnx.split(model)
    np.testing.assert_array_equal(
        tokens,
        _greedy_token_by_token(
            graphdef, params, jnp.asarray(source), 4, 0, jnp.asarray(lengths), jnp.asarray(prefix)
        ),
    )
    # Teacher forcing start, prefix, decoded tokens reproduces each decoded choice.
    target_in = np.concatenate([np.zeros((3, 1), np.int32), prefix, np.asarray(tokens)[:, :-1]], axis=1)
    logits = nnx.jit(_seq2seq_parallel)(model, target_in, source, lengths)
    np.testing.assert_array_equal(tokens, np.argmax(logits[:, 3:], -1))
    with pytest.raises(ValueError, match=r"prefix must be integer tokens of shape \[batch=3, K\]"):
        greedy_decode(model, source, 4, start_token=0, prefix=prefix[:2])


# --- refusals ------------------------------------------------------------------------------------


def test_prefill_with_dropout_active_raises():
    model = _lm("linear", dropout=0.1)
    state = model.init_state(B, max_length=T)
    model.train()
    with pytest.raises(ValueError, match=r"dropout active: call model.eval\(\)"):
        model.prefill(state, _tokens((B, 3)))
    mha = MultiHeadAttention(E, H, kind="softmax", causal=True, attention_dropout=0.5, rngs=nnx.Rngs(0))
    state = mha.init_state(B, max_length=T)
    with pytest.raises(ValueError, match=r"dropout active: call model.eval\(\)"):
        mha.prefill(state, _x((B, 3, E)))


def test_kinds_without_a_recurrent_form_refuse_prefill():
    reformer = MultiHeadAttention(
        E, H, kind="reformer", causal=True, attention_options={"chunk_size": 4}, rngs=nnx.Rngs(0)
    )
    with pytest.raises(
        ValueError,
        match=r"'reformer' has no recurrent form \(prefill\).*"
        r"Kinds with one",
    ):
        reformer.prefill(None, _x((B, 4, E)))
    encoder = Encoder(_config("linear"), causal=False, rngs=nnx.Rngs(0))
    encoder.eval()
    with pytest.raises(
        ValueError, match="prefill is the recurrent form of causal self-attention.*non-causal"
    ):
        encoder.prefill((None,), _x((B, 4, E)))


SP_KINDS = str(
    ["causal-linear", "deltanet", "gated-deltanet", "gla", "kda"]
    + ["linear", "retention", "simple-gla", "softmax"]
)


def test_sequence_axis_needs_a_kind_with_a_sequence_parallel_form():
    assert sequence_parallel_kinds() == [
        "causal-linear",
        "deltanet",
        "gated-deltanet",
        "gla",
        "kda",
        "linear",
        "retention",
        "simple-gla",
        "softmax",
    ]
    assert attention_class("softmax").has_sequence_parallel_form
    assert not attention_class("reformer").has_sequence_parallel_form
    assert not attention_class("linformer").has_sequence_parallel_form
    assert "sequence_axis" not in attention_options("linear")
    match = (
        r"'{}' has no sequence-parallel form, so it cannot run with sequence_axis='seq'; "
        r"kinds with one: " + SP_KINDS.replace("[", r"\[").replace("]", r"\]")
    )
    with pytest.raises(ValueError, match="TransformerConfig: attention kind " + match.format("reformer")):
        _config(attention="reformer", attention_options={}, sequence_axis="seq")
    with pytest.raises(ValueError, match=match.format("linformer")):
        _config(attention="linformer", attention_options={"max_length": 8}, sequence_axis="seq")
    with pytest.raises(ValueError, match=match.format("linformer")):
        _config(
            "linear",
            cross_attention="linformer",
            cross_attention_options={"max_length": 8},
            sequence_axis="seq",
        )
    with pytest.raises(ValueError, match=match.format("linformer")):
        MultiHeadAttention(
            E, H, kind="linformer", attention_options={"max_length": 8}, sequence_axis="seq", rngs=nnx.Rngs(0)
        )
    with pytest.raises(ValueError, match=match.format("reformer")):
        attention_class("reformer")(
            causal=True, num_heads=H, head_dim=D, value_dim=M, rngs=nnx.Rngs(0), sequence_axis="seq"
        )
    with pytest.raises(
        ValueError,
        match=r"sequence_axis must be a mesh axis name \(str\) or "
        r"None, got 3",
    ):
        _config(sequence_axis=3)
    with pytest.raises(ValueError, match="sow_weights records the whole"):
        MultiHeadAttention(
            E,
            H,
            kind="softmax",
            attention_options={"sow_weights": True},
            sequence_axis="seq",
            rngs=nnx.Rngs(0),
        )


def test_sequence_axis_reaches_every_attention_core():
    config = _config("softmax", num_layers=2, attention_dropout=0.1, sequence_axis="seq")
    model = EncoderDecoder(config, config, V, rngs=nnx.Rngs(0))
    cores = [m for _, m in nnx.iter_graph(model) if hasattr(m, "has_sequence_parallel_form")]
    assert len(cores) == 1 + 2  # one stacked layer per stack: self-attention; self- and cross-attention
    assert all(core.sequence_axis == "seq" for core in cores)
    # Attention dropout needs the whole probability matrix: refused while it is active.
    with pytest.raises(ValueError, match="attention dropout .* sequence_axis='seq'"):
        model(*_source()[:1], _tokens((3, 6)))
    lm = _lm("causal-linear", sequence_axis="seq")
    assert lm.transformer.layers.attention.core.sequence_axis == "seq"


def test_sequence_parallel_model_generates_without_a_mesh():
    """The recurrent forms need no mesh: prompts of any length, the plain model's tokens (linear
    prefill would split time over a mesh axis if one were set; softmax prefill never does)."""
    plain = _lm("linear")
    parallel = _lm("linear", sequence_axis="seq")
    prompt = _tokens((B, 4))  # the shapes of the generate test: its compiled plain model
    np.testing.assert_array_equal(
        generation.generate(parallel, prompt, 3, key=jax.random.key(0), temperature=0.0),
        generation.generate(plain, prompt, 3, key=jax.random.key(0), temperature=0.0),
    )
    # The parallel form does need a mesh with the axis, and says so.
    for model in (parallel, _lm("softmax", sequence_axis="seq")):
        with pytest.raises(
            ValueError,
            match=r"sequence_axis='seq' is not an axis of the "
            r"current mesh.*jax.set_mesh",
        ):
            model(prompt)
