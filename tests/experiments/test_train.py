"""The image-generation trainer on the smoke variant of the digits config (real data, tiny model)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import experiments
from configs import digits
from experiments import tasks
from experiments.tasks.image_generation import ImageGeneration
from experiments.tasks.image_sampling import sample_from_workdir
from experiments.training import mesh as mesh_lib
from experiments.training.metrics import read_metrics
from experiments.training.trainer import NonFiniteLossError, Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # Prepared once for the module (the digits ship with scikit-learn: no download).
    return str(tmp_path_factory.mktemp("tfds"))


def _smoke(data_dir, extra=""):
    config = digits.get_config("smoke" + ("," + extra if extra else ""))
    config.data_dir = data_dir
    return config


def _losses(workdir):
    return [r["loss"] for r in read_metrics(workdir) if "loss" in r]


def test_smoke_run_trains_evaluates_samples_and_checkpoints(data_dir, tmp_path):
    config = _smoke(
        data_dir,
        "num_steps=40,log_every=10,eval_every=40,sample_every=40,checkpoint_every=20,learning_rate=0.003",
    )
    result = tasks.train_and_evaluate(config, tmp_path)
    assert result["step"] == 40
    losses = _losses(tmp_path)
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1, losses
    assert np.isfinite(result["test_bits_per_dim"]) and 0 < result["test_bits_per_dim"] < 8
    assert (tmp_path / "samples" / "step_0000040.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["20", "40"]
    assert json.loads((tmp_path / "config.json").read_text())["num_steps"] == 40


def test_non_finite_loss_stops_with_intact_checkpoint(data_dir, tmp_path):
    config = _smoke(
        data_dir,
        "num_steps=30,learning_rate=1e30,grad_clip=0.0,checkpoint_every=1,"
        "eval_every=0,sample_every=0,log_every=1",
    )
    with pytest.raises(NonFiniteLossError, match="non-finite loss .* at step") as error:
        tasks.train_and_evaluate(config, tmp_path)
    bad_step = int(str(error.value).split("at step ")[1].split()[0])
    latest = int(str(error.value).split("latest checkpoint (")[1].split(")")[0])
    assert latest == bad_step  # the last finished (finite) step was saved; nothing after it
    # The last good checkpoint restores and holds finite parameters.
    import jax

    from experiments.training.checkpoints import Checkpointer

    trainer = Trainer(config, ImageGeneration(config), mesh_lib.make_mesh(config))
    restored = Checkpointer(tmp_path / "checkpoints").restore(trainer.state)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(restored))


@pytest.mark.parametrize(
    "override, message",
    [
        ("learning_rate=-1.0", "learning_rate must be > 0"),
        ("attention=quadratic", "registered attention kind"),
        ("num_heads=0", "num_heads must be >= 1"),
        ("schedule=linear", "schedule must be one of"),
        ("model_dim=18", "model_dim must be a multiple of 4"),
        ("train_split=validation", "is not one of"),
        ("dtype=float16", r"config.model.dtype must be one of \('float32', 'bfloat16'\).*got 'float16'"),
        # The task's own keys, checked by ImageGeneration.check().
        ("num_mixtures=0", r"^config.num_mixtures must be >= 1, got 0.$"),
        ("sample_every=-1", r"^config.sample_every must be >= 0, got -1.$"),
        ("max_train_examples=-5", r"^config.max_train_examples must be >= 0, got -5.$"),
    ],
)
def test_bad_config_values_rejected(data_dir, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        tasks.train_and_evaluate(_smoke(data_dir, override), tmp_path)


def test_split_slices_train_on_part_of_a_split(data_dir, tmp_path):
    config = _smoke(
        data_dir,
        "train_split=test[:200],eval_split=test[200:],num_steps=2,max_eval_examples=0,sample_every=0",
    )
    task = ImageGeneration(config)
    task.load_data()
    assert task.train_images.shape == (200, 64) and task.test_images.shape == (97, 64)
    assert np.isfinite(tasks.train_and_evaluate(config, tmp_path)["test_bits_per_dim"])


def test_unknown_config_key_rejected(data_dir, tmp_path):
    config = _smoke(data_dir)
    config.learning_rat = 0.1
    with pytest.raises(ValueError, match=r"not understood: \['learning_rat'\]"):
        tasks.train_and_evaluate(config, tmp_path)
    with pytest.raises(ValueError, match="unknown key 'learnin_rate'"):
        digits.get_config("learnin_rate=3")
    with pytest.raises(ValueError, match="unknown config variant 'smok'"):
        digits.get_config("smok")


def test_sampling_from_a_workdir_recurrent_equals_recompute(data_dir, tmp_path):
    tasks.train_and_evaluate(_smoke(data_dir), tmp_path)
    rec = sample_from_workdir(tmp_path, num_images=3, method="recurrent", seed=1)
    full = sample_from_workdir(tmp_path, num_images=3, method="recompute", seed=1)
    np.testing.assert_array_equal(rec["images"], full["images"])
    assert rec["images"].shape == (3, 64) and rec["images"].max() <= 16
    assert pathlib.Path(rec["path"]).stat().st_size > 0
    completed = sample_from_workdir(tmp_path, num_images=3, prefix_pixels=20, seed=1)
    from experiments.data import pipeline

    test = pipeline.flatten_images(pipeline.load_images("digits", "test", data_dir=data_dir))
    np.testing.assert_array_equal(completed["images"][:, :20], test[:3, :20])


@pytest.mark.usefixtures("float32_products")  # an identity; the child's precision is pinned below
def test_four_devices_give_the_same_losses_as_one(data_dir, tmp_path):
    one = tmp_path / "one"
    tasks.train_and_evaluate(_smoke(data_dir, "num_steps=4,log_every=1,sample_every=0"), one)
    script = (
        "import sys, jax; from configs import digits; from experiments import tasks\n"
        "assert jax.device_count() == 4, jax.devices()\n"
        "c = digits.get_config('smoke,num_steps=4,log_every=1,sample_every=0')\n"
        f"c.data_dir = {data_dir!r}\n"
        f"tasks.train_and_evaluate(c, {str(tmp_path / 'four')!r})\n"
    )
    env = dict(
        os.environ,
        XLA_FLAGS=experiments.with_host_devices(4),
        JAX_PLATFORMS="cpu",
        JAX_DEFAULT_MATMUL_PRECISION="highest",
        PYTHONPATH=str(ROOT),
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, env=env, timeout=600)
    np.testing.assert_allclose(_losses(tmp_path / "four"), _losses(one), rtol=1e-5)


# ---- config.mesh: the ("data", "sequence") device mesh (experiments/training/mesh.py) ----


@pytest.mark.parametrize(
    "override, message",
    [
        ("mesh.data=0", r"config.mesh.data must be a positive int, or -1"),
        ("mesh.data=-2", r"config.mesh.data must be a positive int, or -1"),
        ("mesh.sequence=0", r"config.mesh.sequence must be a positive int"),
        (
            "mesh.sequence=2,attention=reformer",
            r"config.model.attention='reformer' has no "
            r"sequence-parallel form; use one of \[.*'linear'",
        ),
        ("mesh.sequence=3", r"config.mesh.sequence=3 must divide the sequence length 64"),
    ],
)
def test_bad_mesh_values_rejected(data_dir, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        tasks.train_and_evaluate(_smoke(data_dir, override), tmp_path)


def test_mesh_that_does_not_fit_the_devices_rejected(data_dir, tmp_path):
    import jax

    n = jax.device_count()
    with pytest.raises(
        ValueError,
        match=rf"config.mesh data={n + 1} x sequence=1 = {n + 1} "
        rf"devices, but there are {n}",
    ):
        tasks.train_and_evaluate(_smoke(data_dir, f"mesh.data={n + 1}"), tmp_path)
    with pytest.raises(
        ValueError,
        match=rf"config.mesh.sequence={2 * n} does not divide the {n} "
        rf"devices",
    ):
        tasks.train_and_evaluate(_smoke(data_dir, f"mesh.sequence={2 * n}"), tmp_path)
    config = _smoke(data_dir)
    config.mesh.tensor = 2
    with pytest.raises(ValueError, match=r"config.mesh keys not understood: \['tensor'\]"):
        tasks.train_and_evaluate(config, tmp_path)
    with pytest.raises(ValueError, match="unknown key 'mesh.seq'"):
        digits.get_config("mesh.seq=2")


def test_mesh_shape_resolves_the_rest_of_the_devices():
    from experiments.training import mesh as mesh_lib

    assert mesh_lib.mesh_shape({"data": -1, "sequence": 4}, 8) == (2, 4)
    assert mesh_lib.mesh_shape({"data": 8, "sequence": 1}, 8) == (8, 1)
    assert mesh_lib.mesh_shape({"data": -1, "sequence": 1}, 3) == (3, 1)
    with pytest.raises(ValueError, match=r"data=3 x sequence=4 = 12 devices, but there are 8"):
        mesh_lib.mesh_shape({"data": 3, "sequence": 4}, 8)
    with pytest.raises(ValueError, match=r"mesh.sequence=3 does not divide the 8 devices"):
        mesh_lib.mesh_shape({"data": -1, "sequence": 3}, 8)
    with pytest.raises(ValueError, match=r"mesh.sequence must be a positive int.*got True"):
        mesh_lib.mesh_shape({"data": -1, "sequence": True}, 8)
    config = digits.get_config("mesh.sequence=4,mesh.data=2")
    assert (config.mesh.data, config.mesh.sequence) == (2, 4)


def test_the_digest_that_processes_compare_sees_every_value_dtype_shape_and_name():
    # With several processes, `mesh.replicate` compares this digest where `jax.device_put`
    # would gather every leaf; one process can check what the digest tells apart.
    import jax.numpy as jnp

    def state(**changes):
        tree = {"step": jnp.int32(3), "w": np.arange(6, dtype=np.float32), "b": jnp.ones(2, jnp.bfloat16)}
        return {**tree, **changes}

    same = mesh_lib.digest(state())
    assert same.dtype == np.uint32 and same.shape == (8,)
    np.testing.assert_array_equal(mesh_lib.digest(state()), same)
    w = np.arange(6, dtype=np.float32)
    one_ulp = w.copy()
    one_ulp[5] = np.nextafter(w[5], np.float32(7))
    changed = [
        state(w=one_ulp),
        state(w=w.view(np.int32)),  # the same bytes as another dtype
        state(w=w.reshape(2, 3)),
        {"step": jnp.int32(3), "v": w, "b": jnp.ones(2, jnp.bfloat16)},  # a leaf renamed
    ]
    for tree in changed:
        assert not np.array_equal(mesh_lib.digest(tree), same)


def test_mesh_sequence_one_builds_the_model_without_sequence_parallelism(data_dir):
    from flax import nnx

    config = _smoke(data_dir, "mesh.sequence=1")
    task = ImageGeneration(config)
    trainer = Trainer(config, task, mesh_lib.make_mesh(config))
    assert trainer.graphdef == nnx.split(task.build_model(), nnx.Param, nnx.RngState, ...)[0]
    assert trainer.plain_graphdef is trainer.eval_graphdef
    assert dict(trainer.mesh.shape) == {"data": len(trainer.mesh.devices.flat), "sequence": 1}
    split = nnx.split(task.build_model(sequence_axis="sequence"), nnx.Param, nnx.RngState, ...)[0]
    assert split != trainer.graphdef  # the axis is in the graph, not in the parameters


def test_a_run_that_fails_before_training_leaves_config_json_as_it_was(data_dir, tmp_path):
    (tmp_path / "config.json").write_text('{"from": "an earlier run"}')
    with pytest.raises(ValueError, match="config.mesh.sequence=3 must divide"):
        tasks.train_and_evaluate(_smoke(data_dir, "mesh.sequence=3"), tmp_path)
    with pytest.raises(ValueError, match="batch_size=9999 exceeds"):
        tasks.train_and_evaluate(_smoke(data_dir, "batch_size=9999"), tmp_path)
    assert (tmp_path / "config.json").read_text() == '{"from": "an earlier run"}'
