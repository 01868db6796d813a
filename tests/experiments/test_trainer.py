"""The one trainer and its config shape: config.model is exactly TransformerConfig's fields in
every config, unset fields are typed placeholders, the non-finite check reads a step's flag
late but never lets a bad state reach the disk, old config.json files still load, and a Task
written outside the project trains with it."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from configs import cifar10, demo, digits, mnist
from configs import copy as copy_config
from experiments import tasks
from experiments.tasks import copy as copy_task
from experiments.training import schemas, trainer
from experiments.training.checkpoints import Checkpointer
from experiments.training.config_checks import model_config
from experiments.training.metrics import read_metrics
from linear_transformers.transformer import TransformerConfig

CONFIGS = {
    "digits": lambda: digits.get_config(),
    "mnist": lambda: mnist.get_config(),
    "cifar10": lambda: cifar10.get_config(),
    "demo": lambda: demo.get_config(),
    # (linformer is an encoder's: it is checked with encoder_decoder below.)
    **{f"copy:{v}": (lambda v=v: copy_config.get_config(v)) for v in copy_task.VARIANTS if v != "linformer"},
    "copy:encoder_decoder,linformer": lambda: copy_config.get_config("encoder_decoder,linformer"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_model_is_exactly_the_fields_of_transformer_config(name):
    config = CONFIGS[name]()
    fields = {f.name for f in dataclasses.fields(TransformerConfig)} - {"sequence_axis"}
    assert set(config.model) == fields
    built = TransformerConfig(**config.model.to_dict())
    assert built == model_config(config.model)
    for field in ("softmax_temp", "query_dim", "cross_attention"):  # unset: the library's default
        assert getattr(built, field) is None
    trainer.check_config(config, tasks.task_class(config))


def test_the_shared_checks_know_only_the_shared_groups_keys():
    # A task's own keys are checked in its Task.check(); config_checks knows none of them.
    from experiments.training import config_checks

    shared = ml_collections.ConfigDict({"model": schemas.model()})
    for group in (schemas.optimisation, schemas.bookkeeping, schemas.devices):
        group(shared)
    assert set(config_checks._POSITIVE + config_checks._NON_NEGATIVE) <= set(shared)


def _parse_config(argv):
    """The config an entry point gets from `argv` (absl flags and ml_collections overrides)."""
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


def test_unset_model_fields_are_typed_placeholders_set_from_the_command_line():
    config = _parse_config(
        [
            "prog",
            "--config=configs/digits.py",
            "--config.model.softmax_temp=0.5",
            "--config.model.query_dim=8",
            "--config.model.attention=softmax",
        ]
    )
    assert config.model.softmax_temp == 0.5 and config.model.query_dim == 8
    assert model_config(config.model).softmax_temp == 0.5
    assert _parse_config(["prog", "--config=configs/digits.py"]).model.softmax_temp is None
    with pytest.raises(Exception, match="softmax_temp"):
        _parse_config(["prog", "--config=configs/digits.py", "--config.model.softmax_temp=hot"])
    # After the colon a model field may be named alone, parsed as its type.
    assert digits.get_config("softmax_temp=0.25").model.softmax_temp == 0.25
    with pytest.raises(ValueError, match="softmax_temp needs float, got 'hot'"):
        digits.get_config("softmax_temp=hot")


def test_unknown_or_trainer_set_model_fields_are_refused(tmp_path):
    config = digits.get_config("smoke")
    config.model.num_layer = 2
    with pytest.raises(ValueError, match=r"config.model keys not understood: \['num_layer'\]"):
        tasks.train_and_evaluate(config, tmp_path)
    config = digits.get_config("smoke")
    config.model.sequence_axis = "sequence"
    with pytest.raises(ValueError, match=r"config.model keys not understood: \['sequence_axis'\]"):
        tasks.train_and_evaluate(config, tmp_path)
    with pytest.raises(ValueError, match=r"not TransformerConfig fields: \['layers'\]"):
        schemas.model(layers=2)


def test_a_non_finite_step_found_late_still_leaves_no_bad_checkpoint(tmp_path):
    # Nothing logged, evaluated or saved between steps: the bad step is found while the next
    # one runs, the run stops naming it, and nothing is written.
    config = copy_config.get_config(
        "smoke,num_steps=30,learning_rate=1e30,grad_clip=0.0,log_every=0,eval_every=0,checkpoint_every=0"
    )
    with pytest.raises(trainer.NonFiniteLossError, match=r"at step \d+ .* latest checkpoint \(None\)"):
        tasks.train_and_evaluate(config, tmp_path)
    assert Checkpointer(tmp_path / "checkpoints").all_steps() == []


def test_an_abrupt_stop_right_after_a_non_finite_step_saves_nothing_new(tmp_path):
    config = copy_config.get_config(
        "smoke,num_steps=30,learning_rate=1e30,grad_clip=0.0,log_every=0,eval_every=0,checkpoint_every=1"
    )
    seen = []

    def stop_at_the_first_bad_step(step, metrics):
        seen.append(step)
        if not bool(metrics["finite"]):
            raise KeyboardInterrupt  # a second Ctrl-C: the state in hand would be saved

    with pytest.raises(KeyboardInterrupt):
        tasks.train_and_evaluate(config, tmp_path, step_callback=stop_at_the_first_bad_step)
    bad = seen[-1]
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    assert checkpointer.latest_step() == bad - 1  # the last good step, nothing after it
    state = checkpointer.restore(
        trainer.Trainer(config, tasks.task_class(config)(config), _one_device()).state
    )
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(state))


def _one_device():
    from experiments.training import mesh as mesh_lib

    return mesh_lib.mesh_from_shape((1, 1), jax.devices()[:1])


def _flat(config: ml_collections.ConfigDict) -> dict:
    """`config` as the flat layout wrote it: model keys at the top, 0.0 / "" for unset."""
    saved = json.loads(config.to_json_best_effort())
    model, encoder = saved.pop("model"), saved.pop("encoder", None)
    for key in ("num_layers", "num_heads", "model_dim", "feed_forward_dim", "dropout", "attention_dropout"):
        saved[key] = model[key]
    saved.update(attention=model["attention"], attention_options=model["attention_options"])
    saved.update(softmax_temp=model["softmax_temp"] or 0.0, dtype=model["dtype"])
    if encoder is not None:
        saved["model"] = saved.pop("architecture")
        saved.update(cross_attention=model["cross_attention"] or "")
        saved.update(encoder_attention=encoder["attention"] or "")
        saved.update(encoder_attention_options=encoder["attention_options"])
    return saved


def test_a_workdir_written_with_the_flat_config_layout_still_samples(tmp_path):
    from experiments.tasks.image_sampling import sample_from_workdir

    config = digits.get_config("smoke,num_steps=2,eval_every=0,sample_every=0")
    config.data_dir = str(tmp_path / "tfds")
    tasks.train_and_evaluate(config, tmp_path / "run")
    before = sample_from_workdir(tmp_path / "run", num_images=2, seed=3)
    (tmp_path / "run" / "config.json").write_text(json.dumps(_flat(config)))
    after = sample_from_workdir(tmp_path / "run", num_images=2, seed=3)
    np.testing.assert_array_equal(after["images"], before["images"])


@pytest.mark.parametrize("variant", ["smoke", "encoder_decoder,linformer,smoke"])
def test_the_flat_layout_upgrades_to_the_current_one(variant):
    config = copy_config.get_config(variant)
    upgraded = schemas.upgrade_saved_config(_flat(config))
    current = json.loads(config.to_json_best_effort())
    # The flat layout had only some of the fields: those it had land where they belong now.
    for group in ("model", "encoder"):
        current[group] = {k: v for k, v in current[group].items() if k in upgraded[group]}
    assert upgraded == current
    assert schemas.upgrade_saved_config(current) is current  # the current layout is left alone


class _Regression(trainer.Task):
    """A task written outside the project: fit y = 3x - 1 with a linear layer."""

    name = "regression"

    @staticmethod
    def schema():
        c = ml_collections.ConfigDict({"task": "regression", "seed": 0, "model": schemas.model()})
        schemas.optimisation(c)
        schemas.bookkeeping(c)
        schemas.devices(c)
        c.update(optimizer="adamw", learning_rate=0.1, weight_decay=0.0, num_steps=60, progress_bar=False)
        return c

    def build_model(self, *, sequence_axis=None):
        return nnx.Linear(1, 1, rngs=nnx.Rngs(self.config.seed))

    def batch(self, step):
        x = np.random.default_rng(step).normal(size=(self.config.batch_size, 1)).astype(np.float32)
        return x, 3 * x - 1

    def loss(self, model, batch):
        x, y = batch
        return jnp.mean((model(x) - y) ** 2), {}

    def eval_sums(self, model, batch):
        x, y = batch
        return {"squared_error": jnp.sum((model(x) - y) ** 2)}

    def evaluate(self, run):
        return {"eval_mse": run.eval_sums(self.batch(10**6))["squared_error"] / self.config.batch_size}


def test_a_task_written_elsewhere_trains_resumes_and_evaluates(tmp_path):
    config = _Regression.schema()
    first = trainer.train_and_evaluate(config, tmp_path, _Regression)
    assert first["step"] == 60 and first["eval_mse"] < 0.05, first
    assert trainer.train_and_evaluate(config, tmp_path, _Regression)["eval_mse"] == first["eval_mse"]
    config.lr = 1.0
    with pytest.raises(ValueError, match=r"config keys not understood: \['lr'\]"):
        trainer.train_and_evaluate(config, tmp_path, _Regression)


def test_sampling_a_workdir_of_another_task_is_a_clear_error(tmp_path):
    from experiments.tasks.image_sampling import sample_from_workdir

    tasks.train_and_evaluate(demo.get_config("num_steps=1,progress_bar=false,eval_batch_size=8"), tmp_path)
    with pytest.raises(ValueError, match="trained the task 'progressions'; sampling generates images"):
        sample_from_workdir(tmp_path)


def test_a_long_logging_window_averages_every_step(tmp_path):
    # log_every=0: one window of 300 steps, read in groups as it grows; its loss is the mean
    # of the 300 per-step losses.
    config = _Regression.schema()
    config.update(num_steps=300, log_every=0, eval_every=0, checkpoint_every=0)
    losses = []
    result = trainer.train_and_evaluate(
        config, tmp_path, _Regression, step_callback=lambda s, m: losses.append(float(m["loss"]))
    )
    assert len(losses) == 300
    assert result["loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [300]
