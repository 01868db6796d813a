"""Checkpoints written before a module was renamed (`checkpoints.RENAMED_KEYS`) still restore.

CausalLM's and ImageGenerator's causal stack was `.decoder` and is now `.transformer`: a training
workdir's checkpoints from before hold those arrays (parameters, Adam's moments) under
"decoder". Here such checkpoints are real ones: a real trainer's state with "transformer" named
back to "decoder", written with the project's Checkpointer, then restored into today's trainer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import copy as copy_config
from configs import digits
from experiments import tasks
from experiments.tasks.copy import Copy
from experiments.tasks.image_generation import ImageGeneration
from experiments.training import mesh as mesh_lib
from experiments.training.checkpoints import (
    DAMAGED_DIR,
    Checkpointer,
    CheckpointError,
    CheckpointMismatchError,
    DamagedCheckpointError,
    restore_newest_intact,
)
from experiments.training.trainer import Trainer


def _image_trainer(extra=""):
    config = digits.get_config("smoke" + extra)
    return config, Trainer(config, ImageGeneration(config), mesh_lib.make_mesh(config))


def _lm_trainer(extra=""):
    config = copy_config.get_config("smoke" + extra)
    assert config.architecture == "decoder"  # a CausalLM
    return config, Trainer(config, Copy(config), mesh_lib.make_mesh(config))


TRAINERS = {"ImageGenerator": _image_trainer, "CausalLM": _lm_trainer}


def _renamed(state, new="decoder", old="transformer"):
    """`state` with every nnx.State's key `old` named `new` (params, Adam's mu and nu)."""

    def rename(node):
        if isinstance(node, nnx.State):
            return nnx.State({(new if key == old else key): value for key, value in node.items()})
        return node

    return jax.tree.map(rename, state, is_leaf=lambda node: isinstance(node, nnx.State))


def _distinct(state):
    """`state` with each array shifted by its own index: a restore that put an array at the
    wrong path, or left it at its initial value, cannot pass for right."""
    leaves, treedef = jax.tree.flatten(state)
    return treedef.unflatten([leaf + jnp.asarray(i + 1, leaf.dtype) for i, leaf in enumerate(leaves)])


def _paths(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _assert_same(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for path, a, b in zip(_paths(expected), jax.tree.leaves(restored), jax.tree.leaves(expected)):
        assert a.shape == b.shape and a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)


@pytest.mark.parametrize("make", TRAINERS.values(), ids=TRAINERS.keys())
def test_a_checkpoint_from_before_the_rename_restores_into_the_renamed_model(make, tmp_path):
    config, trainer = make()
    state = _distinct(trainer.state)
    assert "transformer" in state["params"] and "decoder" not in state["params"]
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(3, _renamed(state))
    saved = checkpointer.metadata(3)
    assert "decoder" in saved["params"] and "transformer" not in saved["params"]
    assert "decoder" in saved["opt_state"][1]["mu"]  # Adam's moments: the same paths

    restored = checkpointer.restore(trainer.state, 3)
    _assert_same(restored, state)
    # The way a resumed run meets it: the newest checkpoint, not set aside as damaged.
    resumed, step = restore_newest_intact(checkpointer, trainer.state, tmp_path, config)
    assert step == 3
    _assert_same(resumed, state)
    assert not (tmp_path / DAMAGED_DIR).exists()
    # The model built from it holds the saved arrays in its `.transformer`.
    model = nnx.merge(trainer.graphdef, restored["params"], trainer.rng_state, restored["rest"])
    _assert_same(nnx.state(model.transformer, nnx.Param), state["params"]["transformer"])
    checkpointer.close()


def test_a_run_resumes_training_from_a_checkpoint_from_before_the_rename(tmp_path):
    config, trainer = _lm_trainer(",num_steps=5,eval_every=0,log_every=1")
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(3, _renamed({**trainer.state, "step": jnp.int32(3)}))
    checkpointer.close()
    steps = []
    result = tasks.train_and_evaluate(config, tmp_path, step_callback=lambda s, m: steps.append(s))
    assert result["step"] == 5 and steps == [4, 5]
    assert not (tmp_path / DAMAGED_DIR).exists()


def test_a_checkpoint_with_the_new_names_restores_as_before(tmp_path):
    _, trainer = _image_trainer()
    state = _distinct(trainer.state)
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(1, state)
    assert "transformer" in checkpointer.metadata(1)["params"]
    _assert_same(checkpointer.restore(trainer.state, 1), state)
    checkpointer.close()


def test_a_key_is_read_under_its_old_name_only_where_the_checkpoint_has_that_name(tmp_path):
    w, v = jnp.arange(6.0).reshape(2, 3), -jnp.arange(6.0).reshape(2, 3)
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    # A "transformer" the checkpoint already has keeps its name; the nested one was "decoder".
    checkpointer.save(1, {"a": {"decoder": w}, "transformer": v})
    restored = checkpointer.restore(
        {"a": {"transformer": jnp.zeros((2, 3))}, "transformer": jnp.zeros((2, 3))}, 1
    )
    _assert_same(restored, {"a": {"transformer": w}, "transformer": v})
    # Old and new name side by side in the target: "decoder" is the target's own key, so the
    # saved "decoder" cannot stand for "transformer" as well.
    with pytest.raises(CheckpointMismatchError):
        checkpointer.restore({"a": {"decoder": w, "transformer": w}, "transformer": v}, 1)
    # The rename goes one way only: a target with the old name does not read the new one.
    checkpointer.save(2, {"a": {"transformer": w}, "transformer": v})
    with pytest.raises(CheckpointMismatchError):
        checkpointer.restore({"a": {"decoder": w}, "transformer": v}, 2)
    checkpointer.close()


def test_a_checkpoint_that_differs_otherwise_is_still_a_mismatch(tmp_path):
    config, trainer = _image_trainer()
    checkpointer = Checkpointer(tmp_path / "checkpoints", max_to_keep=5)
    # A name that is no rename the table knows (same arrays, same shapes).
    checkpointer.save(1, _renamed(trainer.state, new="body"))
    with pytest.raises(CheckpointMismatchError, match="checkpoint step 1 .* different config"):
        checkpointer.restore(trainer.state, 1)
    # The old name, but arrays of another shape: another model, renamed or not.
    _, wider = _image_trainer(",model_dim=32")
    checkpointer.save(2, _renamed(wider.state))
    with pytest.raises(CheckpointMismatchError, match="checkpoint step 2 .* different config"):
        checkpointer.restore(trainer.state, 2)
    # Resuming does not set them aside as damaged: they are intact, just not this model's.
    with pytest.raises(CheckpointMismatchError):
        restore_newest_intact(checkpointer, trainer.state, tmp_path, config)
    assert checkpointer.all_steps() == [1, 2] and not (tmp_path / DAMAGED_DIR).exists()
    checkpointer.close()


def test_a_damaged_checkpoint_from_before_the_rename_is_still_caught(tmp_path):
    _, trainer = _image_trainer()
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    checkpointer.save(1, _renamed(_distinct(trainer.state)))
    data = max(
        (p for p in (tmp_path / "checkpoints" / "1").rglob("d/*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x01
    data.write_bytes(bytes(content))
    with pytest.raises(DamagedCheckpointError, match="files whose bytes changed"):
        checkpointer.restore(trainer.state, 1)
    assert issubclass(DamagedCheckpointError, CheckpointError)
    checkpointer.close()
