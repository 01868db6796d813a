"""A stack's layers as one stacked layer run by a scan (`layer_stack`): the same function as the
layers one after another, one compiled layer whatever the depth, and the checkpoints written
before the layers were stacked still restore.

Legend: B batch, T time, E model width, L layers.
"""

import json
import pathlib
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from cases import small_config
from flax import nnx

from configs import digits
from experiments import tasks
from experiments.tasks.image_generation import ImageGeneration
from experiments.training import mesh as mesh_lib
from experiments.training.checkpoints import Checkpointer, restore_newest_intact
from experiments.training.trainer import Trainer
from linear_transformers import Encoder, layer_stack
from linear_transformers.transformer import EncoderLayer

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

B, T, E = 2, 9, 16
FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "per_layer_checkpoint"


def _config(**overrides):
    fields = dict(num_layers=3, model_dim=E, feed_forward_dim=None, dropout=0.2)
    return small_config(overrides.pop("attention", "causal-linear"), **{**fields, **overrides})


def _layers(config, causal=True):
    rngs = nnx.Rngs(params=0, dropout=1)
    return [EncoderLayer(config, causal=causal, rngs=rngs) for _ in range(config.num_layers)]


def _x(dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(0).standard_normal((B, T, E)), dtype)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_the_scan_computes_the_layers_one_after_another(train):
    """Dropout included: each layer keeps its own RNG stream, stacked."""
    config = _config()
    layers, copies = _layers(config), _layers(config)
    stacked = layer_stack.stack(copies)
    for module in layers + [stacked]:
        module.train() if train else module.eval()
    for _ in range(2):  # the second call: the streams advanced alike
        expected = _x()
        for layer in layers:
            expected = layer(expected)
        got = layer_stack.run(stacked, _x(), lambda layer, x: layer(x))
        # Two programs (the layers called eagerly, one layer under a scan) fuse and round
        # differently: some float32 ulps of the O(1) activations (1.05e-6 seen on one).
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    if train:  # dropout was on: the two calls differ
        assert not np.allclose(got, layer_stack.run(stacked, _x(), lambda layer, x: layer(x)))


def test_the_stacked_variables_are_the_layers():
    layers = _layers(_config())
    stacked = layer_stack.stack(layers)
    for i, layer in enumerate(layers):
        chex.assert_trees_all_equal(nnx.state(layer_stack.layer(stacked, i)), nnx.state(layer))
    kernel = stacked.feed_forward.linear1.kernel.get_value()
    assert kernel.shape == (3, E, 4 * E)


def test_the_recurrent_form_carries_one_state_per_layer():
    config = _config(dropout=0.0)
    layers = _layers(config)
    stacked = layer_stack.stack(_layers(config))
    stacked.eval()
    states = layer_stack.init(stacked, lambda layer: layer.init_state(B))
    assert jax.tree.leaves(states)[0].shape[0] == 3
    x = _x()
    expected, per_layer = [], [layer.init_state(B) for layer in layers]
    for t in range(T):
        y = x[:, t]
        for i, layer in enumerate(layers):
            per_layer[i], y = layer.step(per_layer[i], y)
        expected.append(y)
        states, got = layer_stack.run_with_state(
            stacked, states, x[:, t], lambda layer, state, y: layer.step(state, y)
        )
        np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(
        states, jax.tree.map(lambda *s: jnp.stack(s), *per_layer), rtol=1e-5, atol=1e-5
    )


def test_a_carry_whose_dtype_the_layers_change_is_carried_in_theirs():
    """bfloat16 inputs to float32 layers (dtype None): every layer but the first gets float32,
    as in a loop."""
    layers = _layers(_config(dropout=0.0))
    stacked = layer_stack.stack(_layers(_config(dropout=0.0)))
    expected = _x(jnp.bfloat16)
    for layer in layers:
        expected = layer(expected)
    got = layer_stack.run(stacked, _x(jnp.bfloat16), lambda layer, x: layer(x))
    assert got.dtype == expected.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_stack_traces_its_layer_once_where_the_carry_keeps_its_dtype():
    """A trace of the layer is most of a step's tracing: a float32 carry is traced once; a
    bfloat16 one whose dtype the layers change twice (its first trace ends at the layer's
    output)."""
    stacked = layer_stack.stack(_layers(_config(dropout=0.0)))
    for dtype, traces in ((jnp.float32, 1), (jnp.bfloat16, 2)):
        calls = []

        def call(layer, x):
            calls.append(x.dtype)
            return layer(x)

        out = jax.eval_shape(lambda x: layer_stack.run(stacked, x, call), _x(dtype))
        assert out.dtype == jnp.float32
        assert calls == [dtype, jnp.float32][:traces], calls


@pytest.mark.parametrize("unroll", [2, 3])
def test_unrolled_layers_compute_the_same(unroll):
    """`TransformerConfig.unroll_layers`: layers per scan iteration, the same function (3
    layers: an unroll that divides them and one that unrolls them all)."""
    config = _config(dropout=0.0)
    encoder = Encoder(config, causal=True, rngs=nnx.Rngs(0))
    unrolled = Encoder(_config(dropout=0.0, unroll_layers=unroll), causal=True, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(unrolled(_x()), encoder(_x()), rtol=1e-6, atol=1e-6)
    for model in (encoder, unrolled):
        model.eval()
    state, y = unrolled.step(unrolled.init_state(B), _x()[:, 0])
    np.testing.assert_allclose(y, encoder.step(encoder.init_state(B), _x()[:, 0])[1], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"unroll_layers must be in \[1, num_layers=3\].*got 4"):
        _config(unroll_layers=4)


def test_layers_of_different_configs_do_not_stack():
    one = EncoderLayer(_config(), causal=True, rngs=nnx.Rngs(0))
    other = EncoderLayer(_config(activation="gelu"), causal=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layers differ"):
        layer_stack.stack([one, other])


def test_the_traced_step_does_not_grow_with_the_depth():
    """One layer is traced and compiled whatever L: the training loss's program has as many
    operations at 8 layers as at 2."""

    def operations(num_layers):
        encoder = Encoder(_config(num_layers=num_layers, dropout=0.0), causal=True, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(encoder, nnx.Param, ...)

        def loss(params, x):
            return jnp.sum(nnx.merge(graphdef, params, rest)(x))

        jaxpr = jax.make_jaxpr(jax.grad(loss))(params, _x())
        return len(str(jaxpr).splitlines())

    assert operations(8) == operations(2)


# --- checkpoints written before the layers were stacked --------------------------------------


def _per_layer(state):
    """`state` as a checkpoint written before stacking held it: every stacked array under
    `layers` split into `layers/0`, `layers/1`, ..."""

    def split(node):
        if isinstance(node, nnx.State) and "layers" in node:
            stacked = node["layers"]
            n = jax.tree.leaves(stacked)[0].shape[0]
            layers = {i: jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)}
            return nnx.State({**{k: v for k, v in node.items() if k != "layers"}, "layers": layers})
        return node

    def walk(node):
        node = split(node)
        if isinstance(node, nnx.State):
            return nnx.State({k: walk(v) for k, v in node.items()})
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
            return type(node)(walk(v) for v in node)
        if hasattr(node, "_fields"):
            return type(node)(*(walk(v) for v in node))
        return node

    return walk(state)


def _trainer(extra=",model.num_layers=3"):
    config = digits.get_config("smoke" + extra)
    return config, Trainer(config, ImageGeneration(config), mesh_lib.make_mesh(config))


def test_a_per_layer_checkpoint_restores_stacked(tmp_path):
    _, trainer = _trainer()
    leaves, treedef = jax.tree.flatten(trainer.state)
    state = treedef.unflatten([x + jnp.asarray(i + 1, x.dtype) for i, x in enumerate(leaves)])
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(3, _per_layer(state))
    saved = checkpointer.metadata(3)
    assert set(saved["params"]["transformer"]["layers"]) == {"0", "1", "2"}
    assert "0" in saved["opt_state"][1]["mu"]["transformer"]["layers"]  # Adam's moments too
    restored = checkpointer.restore(trainer.state, 3)
    chex.assert_trees_all_equal(restored, state)
    checkpointer.close()


def test_a_checkpoint_written_before_stacking_restores_and_resumes(tmp_path):
    """Real bytes: a workdir the project wrote before its layers were stacked (2 layers, 3
    steps of configs/digits.py:smoke). Its arrays restore stacked, layer i at index i, and the
    run trains on from step 3."""
    workdir = tmp_path / "run"
    shutil.copytree(FIXTURE, workdir)
    saved_config = json.loads((workdir / "config.json").read_text())
    config = digits.get_config("smoke,model.num_layers=2,num_steps=4,eval_every=0,sample_every=0")
    config.seed = saved_config["seed"]
    trainer = Trainer(config, ImageGeneration(config), mesh_lib.make_mesh(config))
    checkpointer = Checkpointer(workdir / "checkpoints")
    raw = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / "3" / "default")  # as saved
    state, step = restore_newest_intact(checkpointer, trainer.state, workdir, config)
    checkpointer.close()
    assert step == 3
    stacked = state["params"]["transformer"]["layers"]
    for i in range(2):
        layer = raw["params"]["transformer"]["layers"][str(i)]
        np.testing.assert_array_equal(
            stacked["feed_forward"]["linear1"]["kernel"].get_value()[i],
            layer["feed_forward"]["linear1"]["kernel"]["value"],
        )
    result = tasks.train_and_evaluate(config, workdir)
    assert result["step"] == 4 and np.isfinite(result["loss"])
