"""The README's examples run as written and their claims hold (y_t == y_parallel[:, t], ...):
to float32 rounding at float32 products, to TF32's where the run's products round to it, as the
README says (`tf32.assert_close`)."""

import pathlib
import re

import numpy as np
import tf32
from fast_transformers_cases import mnist_sized_state

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_encoder_decoder_example_runs_and_recurrent_equals_parallel():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    example = blocks[0]
    namespace = {}
    exec(compile(example, str(README), "exec"), namespace)
    y_parallel, y_t = namespace["y_parallel"], namespace["y_t"]
    # After the loop, y_t is the last step's output.
    tf32.assert_close(y_t, y_parallel[:, -1], atol=1e-5, rtol=1e-5)


def test_readme_prefill_example_runs_and_streaming_equals_one_pass():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (example,) = [b for b in blocks if "streaming" in b]
    namespace = {}
    exec(compile(example, str(README), "exec"), namespace)
    model, prompt, tokens, logits = (namespace[k] for k in ("model", "prompt", "tokens", "logits"))
    assert tokens.shape == (2, 320)
    np.testing.assert_array_equal(tokens[:, :300], prompt)
    # The claim under the example: the streamed segments give the one parallel pass's logits.
    tf32.assert_close(logits[:, -1], model(prompt)[:, -1], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(namespace["state"].position, 300)


def test_readme_fast_transformers_example_runs(tmp_path):
    # The example loads the demo's "linear.pth"; here the same arrays in a .npz of 28 x 28 images
    # (torch is not needed to read those).

    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (example,) = [b for b in blocks if "image_generator_from_fast_transformers" in b]
    path = mnist_sized_state(tmp_path / "linear.npz")
    namespace = {}
    exec(
        compile(
            example.replace('"linear.pth"', repr(str(path))).replace("n_heads=8", "n_heads=2"),
            str(README),
            "exec",
        ),
        namespace,
    )
    images = np.asarray(namespace["images"])
    assert images.shape == (16, 784)
    np.testing.assert_array_equal(images[:, 0], 0)
    assert images.min() >= 0 and images.max() < 256 and len(np.unique(images)) > 1


def _documented_training_commands():
    """Every `python -m experiments.train|demo ...` command in the README and the configs'
    docstrings, continuation lines joined."""
    root = README.parent
    texts = [README.read_text()] + [p.read_text() for p in sorted((root / "configs").glob("*.py"))]
    commands = []
    for text in texts:
        joined = re.sub(r"\\\\?\n\s*", " ", text)  # "\" or "\\" line continuations
        commands += re.findall(r"python -m experiments\.(?:train|demo)\b[^\n#`]*", joined)
    return sorted(set(c.strip() for c in commands))


def test_every_documented_training_command_gives_a_config_the_trainer_accepts():
    import shlex

    from absl import flags
    from ml_collections import config_flags

    from experiments import tasks
    from experiments.training import trainer

    commands = _documented_training_commands()
    assert len(commands) >= 10, commands
    for command in commands:
        words = shlex.split(command)
        default = "configs/demo.py" if words[2] == "experiments.demo" else "configs/digits.py"
        config_args = []
        for i, word in enumerate(words):
            if word == "--config":
                config_args.append(f"--config={words[i + 1]}")
            elif word.startswith("--config"):
                config_args.append(word)
        if not any(arg.startswith("--config=") for arg in config_args):
            config_args.insert(0, f"--config={default}")
        argv = ["prog", *config_args]
        flag_values = flags.FlagValues()
        config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
        flag_values(argv)
        config = flag_values.config
        try:
            trainer.check_config(config, tasks.task_class(config))
        except Exception as e:
            raise AssertionError(f"{command!r}: {e}") from e


def test_readme_family_examples_run_and_their_claims_hold():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (op_example,) = [b for b in blocks if "gated_linear_attention" in b]
    namespace = {}
    exec(compile(op_example, str(README), "exec"), namespace)
    tf32.assert_close(namespace["out"], namespace["out_scan"], atol=2e-4, rtol=2e-4)
    tf32.assert_close(namespace["out"], namespace["out_kernel"], atol=2e-4, rtol=2e-4)
    (model_example,) = [b for b in blocks if "pack_sequences" in b]
    exec(compile(model_example, str(README), "exec"), namespace)
    model, tokens, ids = namespace["model"], namespace["tokens"], namespace["segment_ids"]
    assert tokens.shape == (2, 32)
    # The last document of the first row, alone, then the decoded token: what the prefill and
    # the step gave.
    row = np.asarray(ids[0])
    last = tokens[0][row == row.max()]
    alone = model(np.concatenate([last, [13]])[None])
    tf32.assert_close(namespace["next_logits"][0], alone[0, -1], atol=2e-4, rtol=2e-4)
