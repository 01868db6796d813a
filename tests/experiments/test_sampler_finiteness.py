"""Sampling never hides a broken model: NaN or inf parameters or outputs are an error, never
black pixels (a NaN cast to a class is 0)."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import digits
from experiments import tasks
from experiments.tasks.image_generation import ImageGeneration
from experiments.training import mesh as mesh_lib
from experiments.training.checkpoints import Checkpointer
from experiments.training.trainer import Trainer
from linear_transformers import (
    ImageGenerator,
    TransformerConfig,
    mol_sample,
    sample_images,
    sample_images_full_recompute,
)
from linear_transformers.finite import nonfinite_parameters

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLERS = [sample_images, sample_images_full_recompute]


def _model(kind="linear"):
    config = TransformerConfig(num_layers=1, num_heads=2, model_dim=8, attention=kind, dropout=0.0)
    model = ImageGenerator(config, num_classes=4, num_mixtures=2, max_length=6, rngs=nnx.Rngs(0))
    model.eval()
    return model


def test_mol_sample_refuses_nonfinite_params_eagerly_and_marks_them_under_jit():
    params = jnp.zeros((3, 6)).at[1, 2].set(jnp.nan).at[2, 0].set(jnp.inf)
    with pytest.raises(
        FloatingPointError, match=r"mol_sample: the mixture parameters are not finite at 2 of 3"
    ):
        mol_sample(jax.random.key(0), params, 4)
    drawn = jax.jit(lambda p: mol_sample(jax.random.key(0), p, 4))(params)
    assert drawn[0] >= 0 and drawn[1] == -1 and drawn[2] == -1  # no class drawn from NaN or inf


def test_every_nonfinite_parameter_array_is_named_and_integer_ones_are_skipped():
    model = _model()
    assert nonfinite_parameters(model) == []
    model.head.kernel[...] = model.head.kernel[...].at[1, 0].set(jnp.inf)
    model.embed.embedding[...] = model.embed.embedding[...].at[0, 0].set(jnp.nan)
    model.counts = nnx.Param(jnp.arange(3))  # no NaN or inf to hold
    assert nonfinite_parameters(model) == ["embed/embedding", "head/kernel"]


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_nan_parameters_are_an_error_not_black_images(sampler, kind):
    model = _model(kind)
    assert np.asarray(sampler(model, jax.random.key(0), 2)).min() >= 0
    model.head.kernel[...] = model.head.kernel[...].at[0, 0].set(jnp.nan)
    with pytest.raises(
        FloatingPointError, match=r"the model's parameters are not finite: 1 arrays .*head/kernel"
    ):
        sampler(model, jax.random.key(0), 2)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_outputs_that_overflow_are_an_error(sampler):
    model = _model()
    # Finite parameters whose products overflow float32: the head's outputs are inf or NaN.
    model.head.kernel[...] = jnp.full_like(model.head.kernel[...], 3e38)
    with pytest.raises(
        FloatingPointError, match=r"the model's outputs are not finite \(its parameters are\)"
    ):
        sampler(model, jax.random.key(0), 2, prefix=jnp.zeros((2, 1), jnp.int32))


def test_sample_command_on_a_checkpoint_with_nan_parameters(tmp_path):
    config = digits.get_config("smoke,num_steps=2,eval_every=0,sample_every=0")
    config.data_dir = str(tmp_path / "tfds")
    workdir = tmp_path / "w"
    tasks.train_and_evaluate(config, workdir)
    # Step 3: the trained state with one parameter array made NaN, written by the trainer's
    # own checkpoint code.
    trainer = Trainer(config, ImageGeneration(config), mesh_lib.mesh_from_shape((1, 1), jax.devices()[:1]))
    checkpointer = Checkpointer(workdir / "checkpoints")
    try:
        state = checkpointer.restore(trainer.state, checkpointer.latest_step())
        leaves, treedef = jax.tree.flatten(state["params"])
        leaves[0] = jnp.full_like(leaves[0], jnp.nan)
        checkpointer.save(3, {**state, "params": jax.tree.unflatten(treedef, leaves)})
    finally:
        checkpointer.close()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "experiments.sample", f"--workdir={workdir}", "--num_images=2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    assert lines[-1].startswith("sample: error: the model's parameters are not finite (step 3)"), lines[-1]
    assert "Traceback" not in result.stderr
    assert not list(workdir.glob("samples/*step3*"))  # no grid of black images written
    # An earlier step is still sampled.
    result = subprocess.run(
        [sys.executable, "-m", "experiments.sample", f"--workdir={workdir}", "--num_images=2", "--step=2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _causal_lm():
    from linear_transformers import CausalLM

    config = TransformerConfig(num_layers=1, num_heads=2, model_dim=8, attention="linear", dropout=0.0)
    model = CausalLM(config, 5, rngs=nnx.Rngs(0))
    model.eval()
    return model


def test_generate_refuses_nan_parameters_and_nan_logits():
    from linear_transformers import generate

    model = _causal_lm()
    prompt = jnp.asarray([[1, 2], [3, 4]])
    assert generate(model, prompt, 3, key=jax.random.key(0)).shape == (2, 5)
    model.head.kernel[...] = model.head.kernel[...].at[0, 0].set(jnp.nan)
    with pytest.raises(
        FloatingPointError, match=r"generate: the model's parameters are not finite.*head/kernel"
    ):
        generate(model, prompt, 3, key=jax.random.key(0))
    # Finite parameters whose logits overflow: argmax would return token 0 without a word.
    model = _causal_lm()
    model.head.kernel[...] = jnp.full_like(model.head.kernel[...], 3e38)
    for temperature in (0.0, 1.0):
        with pytest.raises(
            FloatingPointError, match=r"generate: the model's outputs are not finite .* 2 of 2"
        ):
            generate(model, prompt, 3, key=jax.random.key(0), temperature=temperature)


def test_greedy_decode_refuses_nan_parameters_and_nan_logits():
    from linear_transformers import EncoderDecoder, greedy_decode

    config = TransformerConfig(num_layers=1, num_heads=2, model_dim=8, attention="linear", dropout=0.0)
    model = EncoderDecoder(config, config, 5, rngs=nnx.Rngs(0))
    model.eval()
    source = jnp.asarray([[1, 2, 3]])
    assert greedy_decode(model, source, 2, start_token=0).shape == (1, 2)
    kernel = model.head.kernel[...]
    model.head.kernel[...] = jnp.full_like(kernel, 3e38)  # finite, but the logits overflow
    with pytest.raises(FloatingPointError, match=r"greedy_decode: the model's outputs are not finite"):
        greedy_decode(model, source, 2, start_token=0)
    model.head.kernel[...] = kernel.at[0, 0].set(jnp.nan)
    with pytest.raises(FloatingPointError, match=r"greedy_decode: the model's parameters are not finite"):
        greedy_decode(model, source, 2, start_token=0)
