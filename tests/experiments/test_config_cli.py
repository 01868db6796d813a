"""The --config command line: attention options for every config, a resumed run that changes its
model is refused unless allowed, and unknown keys or variants end in one line."""

import json
import os
import pathlib
import subprocess
import sys
import types

import ml_collections
import pytest
from absl import flags

from experiments import tasks
from experiments.config_cli import define_config_flag
from experiments.training import checkpoints, model_change, trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMOKE = "configs/digits.py:smoke,num_steps=4,checkpoint_every=2,eval_every=0,sample_every=0"


def train(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    return result.returncode, lines[-1] if lines else "", result.stderr


def assert_one_line_error(rc, last, stderr, *parts):
    assert rc == 1, stderr[-3000:]
    assert last.startswith("train: error: "), stderr[-3000:]
    for part in parts:
        assert part in last, last
    assert "Traceback" not in stderr, stderr[-3000:]


def parse(argv):
    """The config `python -m experiments.train` gets from `argv`."""
    flag_values = flags.FlagValues()
    define_config_flag("configs/digits.py", flag_values=flag_values, sys_argv=argv)
    flag_values(argv)
    return flag_values.config


@pytest.mark.parametrize("config_file", ["digits.py", "mnist.py", "cifar10.py"])
def test_image_configs_take_attention_options_from_the_command_line(config_file):
    for options in (
        [
            "--config.model.attention_options.feature_map=favor",
            "--config.model.attention_options.num_features=8",
        ],
        ['--config.model.attention_options={"feature_map": "favor", "num_features": 8}'],
    ):
        config = parse(["train", f"--config=configs/{config_file}", *options])
        assert config.model.attention_options.to_dict() == {"feature_map": "favor", "num_features": 8}
        trainer.check_config(config, tasks.task_class(config))
    # After the colon too; an option the kind does not take is refused by name.
    config = parse(["train", f"--config=configs/{config_file}:attention_options.feature_mapp=favor"])
    with pytest.raises(ValueError, match=r"does not accept options \['feature_mapp'\]; its options are"):
        trainer.check_config(config, tasks.task_class(config))


def test_an_attention_option_given_on_the_command_line_is_trained_with(tmp_path):
    rc, _, err = train(
        f"--config={SMOKE},num_steps=1",
        "--config.model.attention_options.feature_map=favor",
        f"--config.data_dir={tmp_path / 'tfds'}",
        f"--workdir={tmp_path / 'w'}",
    )
    assert rc == 0, err[-3000:]
    saved = json.loads((tmp_path / "w" / "config.json").read_text())
    assert saved["model"]["attention_options"] == {"feature_map": "favor"}


def test_an_unknown_key_or_variant_is_one_line_listing_what_exists(tmp_path):
    rc, last, err = train(f"--config={SMOKE}", "--config.foo=1", f"--workdir={tmp_path}")
    assert_one_line_error(rc, last, err, "config keys not understood: ['foo']", "'batch_size', ")
    rc, last, err = train(f"--config={SMOKE}", "--config.mesh.foo.bar=1", f"--workdir={tmp_path}")
    assert_one_line_error(rc, last, err, "config.mesh has no key 'foo'; its keys are ['data', 'sequence']")
    rc, last, err = train("--config=configs/digits.py:nosuch", f"--workdir={tmp_path}")
    assert_one_line_error(rc, last, err, "unknown config variant 'nosuch'; variants: ['smoke']")
    assert not any(tmp_path.iterdir())  # refused before any work


def test_resuming_with_another_model_is_refused_unless_allowed(tmp_path):
    workdir, data = tmp_path / "w", f"--config.data_dir={tmp_path / 'tfds'}"
    rc, _, err = train(f"--config={SMOKE}", data, f"--workdir={workdir}")
    assert rc == 0, err[-3000:]
    saved_config = (workdir / "config.json").read_bytes()
    saved_metrics = (workdir / "metrics.jsonl").read_bytes()

    rc, last, err = train(f"--config={SMOKE},num_steps=6,attention=softmax", data, f"--workdir={workdir}")
    assert_one_line_error(
        rc,
        last,
        err,
        "checkpoint step 4 in ",
        "model.attention: linear -> softmax",
        "allow_model_change=True",
    )
    rc, last, err = train(
        f"--config={SMOKE},num_steps=6",
        "--config.model.attention_options.feature_map=relu",
        data,
        f"--workdir={workdir}",
    )
    assert_one_line_error(rc, last, err, 'model.attention_options: {} -> {"feature_map": "relu"}')
    assert "num_steps" not in last  # only what changes the model is named
    assert (workdir / "config.json").read_bytes() == saved_config
    assert (workdir / "metrics.jsonl").read_bytes() == saved_metrics

    rc, _, err = train(
        f"--config={SMOKE},num_steps=6,attention=softmax",
        "--config.allow_model_change=True",
        data,
        f"--workdir={workdir}",
    )
    assert rc == 0, err[-3000:]
    assert "resuming checkpoint step 4 with a changed model" in err
    assert json.loads((workdir / "config.json").read_text())["model"]["attention"] == "softmax"
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6 and min(steps) <= 4  # resumed, not restarted


def test_what_counts_as_a_model_change():
    saved = {
        "model": {"attention": "linear", "dropout": 0.1, "dtype": "float32", "unroll_layers": 1},
        "num_steps": 4,
    }
    # Dropout only acts in training, unroll_layers only changes how the stack is compiled; a key
    # the saved config lacks is not compared.
    new = {
        "attention": "linear",
        "dropout": 0.3,
        "dtype": "float32",
        "activation": "gelu",
        "unroll_layers": 4,
    }
    assert model_change.model_changes(saved, {"model": new}) == []
    assert model_change.model_changes(
        saved, {"model": {"attention": "softmax", "dropout": 0.1, "dtype": "bfloat16"}, "num_steps": 9}
    ) == ["model.attention: linear -> softmax", "model.dtype: float32 -> bfloat16"]
    # The copy task's architecture and encoder, and the flat layout of older config.json files.
    flat = {"attention": "linear", "model": "decoder", "encoder_attention": "linear"}
    new = {
        "model": {"attention": "linear"},
        "architecture": "encoder_decoder",
        "encoder": {"attention": "lsh"},
    }
    assert model_change.model_changes(flat, new) == [
        "encoder.attention: linear -> lsh",
        "architecture: decoder -> encoder_decoder",
    ]
    # The form and chunk length of a linear kind compute the same function; LSH's chunks do not.
    linear = {"attention": "gla", "attention_options": {"chunk_size": 64, "implementation": "chunked"}}
    other_form = {"attention": "gla", "attention_options": {"chunk_size": 16, "implementation": "scan"}}
    assert model_change.model_changes({"model": linear}, {"model": other_form}) == []
    lsh = {"attention": "reformer", "attention_options": {"chunk_size": 32}}
    assert model_change.model_changes(
        {"model": lsh}, {"model": {**lsh, "attention_options": {"chunk_size": 8}}}
    )


def test_a_checkpoint_of_another_model_is_explained_by_the_model_keys_alone(tmp_path):
    """Resuming with another kind and a new num_steps: the refusal names the kind, not num_steps
    (which may change on a resume)."""
    (tmp_path / "config.json").write_text(json.dumps({"model": {"attention": "linear"}, "num_steps": 20}))
    config = ml_collections.ConfigDict({"model": {"attention": "softmax"}, "num_steps": 30})
    message = checkpoints._config_mismatch(
        types.SimpleNamespace(directory=tmp_path / "c"), 4, tmp_path, config
    )
    assert "model.attention: linear -> softmax" in message and "num_steps" not in message
