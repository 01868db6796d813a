"""Mixed precision: `dtype` (computation) and `param_dtype` (storage) from the ops to the trainer.

Tolerances, stated once: bfloat16 keeps 8 significant bits (relative rounding 2^-8 ~ 0.4%).
Outputs of unit scale are compared with float32 twins (the same float32 parameters) at
OP_TOLERANCE for one attention op, LAYER_TOLERANCE after one layer and MODEL_TOLERANCE for the
logits of a 2-layer model (measured: 0.02 to 0.03 for logits of std ~1). The recurrent form of a
bf16 model is compared with its own parallel form at MODEL_TOLERANCE too (the KV cache holds
bf16 keys where the parallel form's softmax read them from the same bf16 projections). The gated
kinds are bounded relative to their own sensitivity at T=1024 (see SENSITIVITY_FACTOR).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import small_config
from flax import nnx

from linear_transformers import ops
from linear_transformers.image_generator import ImageGenerator, sample_images
from linear_transformers.lm import CausalLM
from linear_transformers.seq2seq import EncoderDecoder, greedy_decode
from linear_transformers.transformer import EncoderLayer, TransformerConfig

OP_TOLERANCE = 0.03
LAYER_TOLERANCE = 0.05
MODEL_TOLERANCE = 0.1

B, T, E, V = 2, 32, 32, 13
KINDS = [
    ("softmax", {}),
    ("linear", {}),
    ("causal-linear", {"implementation": "chunked"}),
    ("linear", {"feature_map": "favor"}),
]
KIND_IDS = ["softmax", "linear", "causal-linear-chunked", "favor"]


def _config(dtype, attention="linear", options=None, **kwargs):
    return small_config(
        attention,
        options or {},
        num_layers=2,
        num_heads=4,
        model_dim=E,
        feed_forward_dim=None,
        dtype=dtype,
        **kwargs,
    )


def _tokens(shape, seed=1, high=V):
    return jax.random.randint(jax.random.key(seed), shape, 0, high)


def _max_error(got, want):
    return float(jnp.max(jnp.abs(jnp.asarray(got, jnp.float32) - jnp.asarray(want, jnp.float32))))


def _param_dtypes(model):
    return {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize(
    "value, expected",
    [("bfloat16", jnp.bfloat16), (jnp.bfloat16, jnp.bfloat16), ("float32", jnp.float32), (None, None)],
)
def test_config_dtype_accepts_names_and_dtypes(value, expected):
    config = TransformerConfig(dtype=value)
    assert config.dtype == (None if expected is None else jnp.dtype(expected))
    assert config.param_dtype == jnp.float32


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "bf16"),
        ("dtype", "int32"),
        ("dtype", jnp.int8),
        ("param_dtype", None),
        ("param_dtype", "complex64"),
    ],
)
def test_config_dtype_rejects_what_is_not_a_float_dtype(field, value):
    with pytest.raises(ValueError, match=rf"TransformerConfig\.{field} must be one of .*bfloat16"):
        TransformerConfig(**{field: value})


@pytest.mark.parametrize("op", ["softmax", "linear", "causal-chunked", "causal-scan"])
def test_ops_in_bfloat16_are_close_to_float32(op):
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (B, 64, 4, 16)) for key in keys)
    fn = {
        "softmax": lambda q, k, v: ops.softmax_attention(q, k, v, causal=True),
        "linear": lambda q, k, v: ops.linear_attention(q, k, v),
        "causal-chunked": lambda q, k, v: ops.causal_linear_attention(q, k, v, implementation="chunked"),
        "causal-scan": lambda q, k, v: ops.causal_linear_attention(q, k, v, implementation="scan"),
    }[op]
    want = fn(q, k, v)
    got = fn(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    assert got.dtype == jnp.bfloat16
    assert _max_error(got, want) < OP_TOLERANCE * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("kind, options", KINDS, ids=KIND_IDS)
def test_a_bfloat16_layer_computes_in_bfloat16_from_float32_parameters(kind, options):
    layers = {
        dt: EncoderLayer(_config(dt, kind, options), causal=True, rngs=nnx.Rngs(0))
        for dt in ("float32", "bfloat16")
    }
    assert _param_dtypes(layers["bfloat16"]) == {jnp.dtype(jnp.float32)}
    x_BTE = jax.random.normal(jax.random.key(2), (B, T, E))
    got = layers["bfloat16"](x_BTE)
    assert got.dtype == jnp.bfloat16  # float32 input, bfloat16 computation
    assert _max_error(got, layers["float32"](x_BTE)) < LAYER_TOLERANCE


def test_param_dtype_sets_the_storage_of_every_parameter_a_core_included():
    config = _config("bfloat16", "softmax", param_dtype="bfloat16")
    encoder = _config(
        "bfloat16", "linformer", {"max_length": T, "projected_length": 8}, param_dtype="bfloat16"
    )
    model = EncoderDecoder(encoder, config, V, rngs=nnx.Rngs(0))
    assert _param_dtypes(model) == {jnp.dtype(jnp.bfloat16)}
    model32 = EncoderDecoder(
        _config("bfloat16", "linformer", {"max_length": T, "projected_length": 8}),
        _config("bfloat16", "softmax"),
        V,
        rngs=nnx.Rngs(0),
    )
    assert _param_dtypes(model32) == {jnp.dtype(jnp.float32)}
    chex.assert_tree_all_finite(model(_tokens((B, T)), _tokens((B, 8))))


@pytest.mark.parametrize("kind, options", KINDS, ids=KIND_IDS)
def test_a_bfloat16_causal_lm_matches_float32_and_its_recurrent_form(kind, options):
    models = {dt: CausalLM(_config(dt, kind, options), V, rngs=nnx.Rngs(0)) for dt in ("float32", "bfloat16")}
    model = models["bfloat16"]
    model.eval()
    tokens_BT = _tokens((B, T))
    logits_BTV = model(tokens_BT)
    assert logits_BTV.dtype == jnp.float32  # the head computes in float32
    assert _max_error(logits_BTV, models["float32"](tokens_BT)) < MODEL_TOLERANCE

    state = model.init_state(B, max_length=T)
    for leaf in jax.tree.leaves(state.layers):
        # Linear states and normalisers accumulate in float32; a KV cache holds bf16 keys.
        assert leaf.dtype in (jnp.float32, jnp.int32) or (kind == "softmax" and leaf.dtype == jnp.bfloat16)
    state, prefix_logits = model.prefill(state, tokens_BT[:, : T // 2])
    steps = []
    step = nnx.jit(lambda model, state, token_B: model.step(state, token_B))  # one compile, 16 calls
    for t in range(T // 2, T):
        state, logits_BV = step(model, state, tokens_BT[:, t])
        steps.append(logits_BV)
    recurrent = jnp.concatenate([prefix_logits, jnp.stack(steps, axis=1)], axis=1)
    assert _max_error(recurrent, logits_BTV) < MODEL_TOLERANCE


# Max logit error at T <= 1024 (3 seeds, logits of std ~1), measured on a CPU by
# `python -m experiments.benchmark_precision` (BENCHMARKS.md): bf16 against float32 is 0.02-0.03
# for linear and softmax; 0.04-0.41 for the gated kinds. A float32 run of the same model with its
# parameters rounded to bf16 (the model's sensitivity to a relative change of 2^-9 in its
# weights, with no bf16 arithmetic) already moves the gated kinds' logits by 0.04-0.30 (linear
# 0.008-0.016): an unnormalised decayed sum of signed terms, rescaled by the head norm,
# amplifies where it cancels. bf16 arithmetic adds a factor of 1.0-4.1 over that for the gated
# kinds, 1.6-2.4 for linear and softmax, in the parallel and the recurrent form.
SENSITIVITY_FACTOR = 4.0  # At seed 0: 1.2-1.8.
GATED_MODEL_TOLERANCE = 0.5


@pytest.mark.parametrize("kind", ["causal-linear", "retention", "simple-gla", "gla"])
def test_bfloat16_error_at_long_lengths_is_within_the_models_own_sensitivity(kind):
    """Parallel and recurrent bf16 forms against float32 at T=1024, within SENSITIVITY_FACTOR of
    what rounding the parameters alone does. Catches, e.g., a recurrent state kept in bf16."""
    from experiments.benchmarking import precision_bench

    opts = precision_bench.PrecisionBenchOptions(kinds=(kind,), lengths=(1024,), seeds=(0,), batch=1)
    row = precision_bench.measure_case(opts, kind, 1024, seed=0)
    tolerance = MODEL_TOLERANCE if kind == "causal-linear" else GATED_MODEL_TOLERANCE
    assert max(row["bf16_error"], row["recurrent_error"]) < tolerance, row
    assert row["over_sensitivity"] < SENSITIVITY_FACTOR, row


def test_bfloat16_gradients_are_float32_finite_and_point_the_same_way():
    def loss(model, tokens):
        logits = model(tokens[:, :-1])
        return optax_free_cross_entropy(logits, tokens[:, 1:])

    tokens = _tokens((B, T + 1))
    grads = {}
    for dt in ("float32", "bfloat16"):
        model = CausalLM(_config(dt, "causal-linear", {"implementation": "chunked"}), V, rngs=nnx.Rngs(0))
        grads[dt] = nnx.grad(loss)(model, tokens)
    leaves16 = jax.tree.leaves(grads["bfloat16"])
    assert {g.dtype for g in leaves16} == {jnp.dtype(jnp.float32)}
    chex.assert_tree_all_finite(grads["bfloat16"])
    flat16 = jnp.concatenate([g.ravel() for g in leaves16])
    flat32 = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads["float32"])])
    cosine = jnp.dot(flat16, flat32) / (jnp.linalg.norm(flat16) * jnp.linalg.norm(flat32))
    assert cosine > 0.99, float(cosine)


def optax_free_cross_entropy(logits_BTV, targets_BT):
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets_BT[..., None], axis=-1))


def test_a_bfloat16_image_generator_scores_and_samples():
    models = {
        dt: ImageGenerator(_config(dt), num_classes=17, num_mixtures=3, max_length=T, rngs=nnx.Rngs(0))
        for dt in ("float32", "bfloat16")
    }
    model = models["bfloat16"]
    model.eval()
    x_BT = _tokens((B, T), high=17)
    nll = model.nll(x_BT)
    assert nll.dtype == jnp.float32
    # Mean nats per sub-pixel of an untrained model (~2.8): bf16 moves it by well under 1%.
    assert abs(float(nll) - float(models["float32"].nll(x_BT))) < 0.02
    images = sample_images(model, jax.random.key(3), B, prefix=x_BT[:, :4])
    assert images.dtype == jnp.int32 and images.shape == (B, T)
    assert int(images.min()) >= 0 and int(images.max()) < 17
    np.testing.assert_array_equal(images[:, :4], x_BT[:, :4])


def test_a_bfloat16_encoder_decoder_decodes_greedily_as_its_parallel_form():
    model = EncoderDecoder(_config("bfloat16"), _config("bfloat16", "causal-linear"), V, rngs=nnx.Rngs(0))
    model.eval()
    source_BS = _tokens((B, 12))
    decoded_BT = greedy_decode(model, source_BS, 6, start_token=0)
    # Re-run the parallel model on the decoded prefix: its argmax gives the same tokens.
    target_in = jnp.concatenate([jnp.zeros((B, 1), decoded_BT.dtype), decoded_BT[:, :-1]], 1)
    logits_BTV = model(source_BS, target_in)
    assert logits_BTV.dtype == jnp.float32
    top2 = jnp.sort(logits_BTV, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > MODEL_TOLERANCE  # ties within rounding may differ
    np.testing.assert_array_equal(
        np.where(clear, jnp.argmax(logits_BTV, -1), -1), np.where(clear, decoded_BT, -1)
    )


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """The digits smoke model trained 40 steps in float32 and in bfloat16, and in bfloat16 again
    stopped at step 20 and resumed to 40: {name: (workdir, result)}."""
    from configs import digits
    from experiments import tasks

    data_dir = str(tmp_path_factory.mktemp("tfds"))
    runs = {}

    def run(name, dtype, num_steps):
        config = digits.get_config(
            f"smoke,num_steps={num_steps},log_every=1,eval_every=40,"
            f"sample_every=40,checkpoint_every=20,learning_rate=0.003,"
            f"schedule=constant,dtype={dtype}"
        )
        config.data_dir = data_dir
        workdir = runs[name][0] if name in runs else tmp_path_factory.mktemp(name)
        runs[name] = (workdir, tasks.train_and_evaluate(config, workdir))

    run("float32", "float32", 40)
    run("bfloat16", "bfloat16", 40)
    run("bfloat16_resumed", "bfloat16", 20)
    run("bfloat16_resumed", "bfloat16", 40)
    return runs


def test_a_bfloat16_training_run_reaches_the_float32_loss(digits_runs):
    from experiments.training.metrics import read_metrics

    losses = {
        name: [r["loss"] for r in read_metrics(workdir) if "loss" in r]
        for name, (workdir, _) in digits_runs.items()
    }
    assert len(losses["bfloat16"]) == 40 and all(np.isfinite(losses["bfloat16"]))
    head, tail = slice(0, 5), slice(-5, None)
    assert np.mean(losses["bfloat16"][tail]) < np.mean(losses["bfloat16"][head]) - 0.1
    # The margin: 0.02 nats per sub-pixel over the last 5 steps (measured: under 0.001, while
    # the runs fall by ~0.15), and 0.02 bits/dim on the test set.
    assert abs(np.mean(losses["bfloat16"][tail]) - np.mean(losses["float32"][tail])) < 0.02
    test_bpd = {name: result["test_bits_per_dim"] for name, (_, result) in digits_runs.items()}
    assert abs(test_bpd["bfloat16"] - test_bpd["float32"]) < 0.02, test_bpd
    # Resumed from a bf16 run's checkpoint: the same losses as the run that went straight on.
    assert losses["bfloat16_resumed"] == losses["bfloat16"]


def test_a_bfloat16_run_checkpoints_float32_parameters(digits_runs):
    from experiments.training.checkpoints import Checkpointer

    checkpointer = Checkpointer(digits_runs["bfloat16"][0] / "checkpoints")
    try:
        dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(checkpointer.metadata(40)["params"])}
    finally:
        checkpointer.close()
    assert dtypes == {"float32"}


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_contractions_accumulate_in_float32_on_every_backend(backend, monkeypatch):
    """ops/precision.einsum_in: bf16 operands, float32 result equal to the float32 einsum of
    the same (bf16-rounded) values, whether it upcasts (CPU) or asks for a float32 accumulator
    (elsewhere; checked here on the CPU with a layout its runtime supports)."""
    from linear_transformers.ops import precision

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    keys = jax.random.split(jax.random.key(4))
    q, k = (jax.random.normal(key, (B, 64, 4, 16)).astype(jnp.bfloat16) for key in keys)
    got = jax.jit(lambda q, k: precision.einsum_in(jnp.float32, "bthd,bshd->bhts", q, k))(q, k)
    assert got.dtype == jnp.float32
    want = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
