"""The README's module example runs as written and its claim (y_t == y_parallel[:, t]) holds."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_encoder_decoder_example_runs_and_recurrent_equals_parallel():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 14
    namespace = {}
    exec(compile(example, str(README), "exec"), namespace)
    y_parallel, y_t = namespace["y_parallel"], namespace["y_t"]
    # After the loop, y_t is the last step's output.
    np.testing.assert_allclose(y_t, y_parallel[:, -1], atol=1e-5, rtol=1e-5)


def test_readme_prefill_example_runs_and_streaming_equals_one_pass():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (example,) = [b for b in blocks if "prefill" in b]
    namespace = {}
    exec(compile(example, str(README), "exec"), namespace)
    model, prompt, tokens, logits = (namespace[k] for k in ("model", "prompt", "tokens", "logits"))
    assert tokens.shape == (2, 320)
    np.testing.assert_array_equal(tokens[:, :300], prompt)
    # The claim under the example: the streamed segments give the one parallel pass's logits.
    np.testing.assert_allclose(logits[:, -1], model(prompt)[:, -1], atol=1e-4, rtol=1e-4)
    assert int(namespace["state"].position) == 300
