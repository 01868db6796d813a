"""The authors' models (pytorch-fast-transformers) converted to ours give their outputs.

Fixtures in tests/fixtures/fast_transformers/ were written by tests/fast_transformers_cases.py
with the authors' library: their weights, inputs and outputs. Every converted module reproduces
them within 1e-5 (float32) in the parallel form and in the recurrent one. When fast_transformers
is importable, the same cases also run live on random sizes.
"""

from __future__ import annotations

import json
import sys

import fast_transformers_cases as cases
import jax.numpy as jnp
import numpy as np
import pytest
from commands import assert_one_line, run_module
from data_files import write_mnist

from linear_transformers import mixture
from linear_transformers.interop import (
    config_from_builder_kwargs,
    decoder_from_fast_transformers,
    encoder_from_fast_transformers,
    generator_config,
    image_generator_from_fast_transformers,
    load_torch_checkpoint,
)
from linear_transformers.transformer import TransformerConfig

# float32 agreement between forms, with float32 matrix products on every platform (TF32's
# tolerances, a GPU's default: tests/ops/test_default_precision.py).
pytestmark = pytest.mark.usefixtures("float32_products")

ATOL = 1e-5
FIXTURE_NAMES = sorted(p.stem for p in cases.FIXTURES.glob("*.npz"))


def _valid_rows(lengths, T):
    return np.arange(T)[None, :] < np.asarray(lengths)[:, None]


def _steps(module, state, x_BTE):
    ys = []
    for t in range(x_BTE.shape[1]):
        state, y = module.step(state, x_BTE[:, t])
        ys.append(y)
    return jnp.stack(ys, 1)


def check_encoder(case: dict):
    meta, state = cases.split_case(case)
    config = cases.case_config(meta)
    encoder = encoder_from_fast_transformers(state, config, causal=meta["causal"])
    x, lengths = jnp.asarray(case["input/x"]), jnp.asarray(case["input/lengths"])
    np.testing.assert_allclose(encoder(x, key_lengths=lengths), case["output/parallel"], atol=ATOL, rtol=0)
    if meta["causal"]:
        B, T, _ = x.shape
        theirs = case["output/recurrent"]
        # Their recurrent encoder reads every token unmasked: our steps and prefill, and our
        # parallel form without lengths, equal it everywhere.
        np.testing.assert_allclose(
            _steps(encoder, encoder.init_state(B, max_length=T), x), theirs, atol=ATOL, rtol=0
        )
        _, y = encoder.prefill(encoder.init_state(B, max_length=T), x)
        np.testing.assert_allclose(y, theirs, atol=ATOL, rtol=0)
        np.testing.assert_allclose(encoder(x), theirs, atol=ATOL, rtol=0)
        # Causality: within each length the masked parallel output is the unmasked one.
        valid = _valid_rows(lengths, T)
        np.testing.assert_allclose(case["output/parallel"][valid], theirs[valid], atol=ATOL)


def check_decoder(case: dict):
    meta, state = cases.split_case(case)
    config = cases.case_config(meta)
    decoder = decoder_from_fast_transformers(state, config)
    x, memory = jnp.asarray(case["input/x"]), jnp.asarray(case["input/memory"])
    lengths = jnp.asarray(case["input/lengths"])
    memory_lengths = jnp.asarray(case["input/memory_lengths"])
    y = decoder(x, memory, memory_lengths=memory_lengths, target_lengths=lengths)
    np.testing.assert_allclose(y, case["output/parallel"], atol=ATOL, rtol=0)
    B, T, _ = x.shape
    decoder_state = decoder.init_state(B, memory=memory, memory_lengths=memory_lengths, max_length=T)
    theirs = case["output/recurrent"]
    np.testing.assert_allclose(_steps(decoder, decoder_state, x), theirs, atol=ATOL, rtol=0)
    _, y = decoder.prefill(decoder_state, x)
    np.testing.assert_allclose(y, theirs, atol=ATOL, rtol=0)
    valid = _valid_rows(lengths, T)
    np.testing.assert_allclose(case["output/parallel"][valid], theirs[valid], atol=ATOL)


def check_generator(case: dict):
    meta, state = cases.split_case(case)
    kwargs = meta["generator_kwargs"]
    config = generator_config(state, attention_type=kwargs["attention_type"], n_heads=kwargs["n_heads"])
    model = image_generator_from_fast_transformers(state, config)
    images = jnp.asarray(case["input/images"])
    B, L = images.shape
    assert model.max_length == L and model.num_classes == 256
    np.testing.assert_allclose(model(images), case["output/parallel"], atol=ATOL, rtol=0)
    # Recurrent: position i reads x_i (no START token) and gives the params of x_{i+1}.
    model_state = model.init_state(B)
    steps = []
    for i in range(L - 1):
        model_state, params = model.step(model_state, images[:, i])
        steps.append(params)
    np.testing.assert_allclose(jnp.stack(steps, 1), case["output/recurrent"], atol=ATOL, rtol=0)
    _, params = model.prefill(model.init_state(B), images[:, :-1])
    np.testing.assert_allclose(params, case["output/recurrent"], atol=ATOL, rtol=0)
    # Their PixelCNN++ likelihood of x[1:] (x_0 is never scored) and every class's probability
    # at every position: the conditional distribution the samples are drawn from.
    np.testing.assert_allclose(model.log_prob(images), case["output/log_prob"], atol=1e-4, rtol=1e-5)
    probs = mixture.mol_probs(model(images), model.num_classes)
    np.testing.assert_allclose(probs, case["output/probs"], atol=ATOL, rtol=0)


CHECKS = {"encoder": check_encoder, "decoder": check_decoder, "generator": check_generator}


def _check(case: dict):
    CHECKS[json.loads(str(case["meta"]))["model"]](case)


def test_every_fixture_kind_is_present():
    assert {json.loads(str(cases.load_case(n)["meta"]))["model"] for n in FIXTURE_NAMES} == set(CHECKS)
    assert len(FIXTURE_NAMES) == len(cases.CASES)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_converted_models_reproduce_the_authors_outputs(name):
    _check(cases.load_case(name))


def test_a_wrong_weight_changes_the_output():
    # The comparison can fail: one converted weight off by 1e-3 is seen.
    case = cases.load_case("encoder_causal_linear")
    case["state/layers.1.linear2.bias"] = case["state/layers.1.linear2.bias"].copy()
    case["state/layers.1.linear2.bias"][0] += 1e-3
    with pytest.raises(AssertionError):
        check_encoder(case)


# --- errors --------------------------------------------------------------------------------------


def test_a_missing_key_is_named_with_its_shape():
    case = cases.load_case("encoder_linear")
    meta, state = cases.split_case(case)
    del state["layers.1.attention.key_projection.weight"]
    with pytest.raises(
        ValueError,
        match=r"no 'layers.1.attention.key_projection.weight' "
        r"\(expected shape \(15, 12\)\)",
    ):
        encoder_from_fast_transformers(state, cases.case_config(meta))


def test_a_shape_that_does_not_fit_the_config_is_named():
    meta, state = cases.split_case(cases.load_case("encoder_linear"))
    config = config_from_builder_kwargs(**dict(meta["builder_kwargs"], query_dimensions=6))
    with pytest.raises(
        ValueError,
        match=r"'layers.0.attention.query_projection.weight' has shape "
        r"\(15, 12\); this config expects \(18, 12\)",
    ):
        encoder_from_fast_transformers(state, config)


def test_unexpected_keys_and_layer_counts_are_named():
    meta, state = cases.split_case(cases.load_case("encoder_linear"))
    with pytest.raises(ValueError, match=r"unexpected keys in the state dict: \['extra.weight'\]"):
        encoder_from_fast_transformers({**state, "extra.weight": np.zeros(3)}, cases.case_config(meta))
    config = config_from_builder_kwargs(**dict(meta["builder_kwargs"], n_layers=3))
    with pytest.raises(ValueError, match=r"2 layers under 'layers.'; the config has num_layers=3"):
        encoder_from_fast_transformers(state, config)
    # A decoder's weights are not an encoder's.
    _, decoder_state = cases.split_case(cases.load_case("decoder_full"))
    with pytest.raises(ValueError, match=r"no 'layers.0.attention.query_projection.weight'"):
        encoder_from_fast_transformers(decoder_state, cases.case_config(meta))


def test_kinds_without_the_authors_weights_layout_are_refused():
    meta, state = cases.split_case(cases.load_case("encoder_linear"))
    config = TransformerConfig(
        num_layers=2, num_heads=3, model_dim=12, query_dim=5, value_dim=4, attention="reformer"
    )
    with pytest.raises(ValueError, match=r"kind 'reformer' cannot be converted"):
        encoder_from_fast_transformers(state, config)
    config = config_from_builder_kwargs(**dict(meta["builder_kwargs"], feature_map="favor"))
    with pytest.raises(ValueError, match=r"only the authors' default feature map"):
        encoder_from_fast_transformers(state, config)


def test_generator_config_reads_the_architecture_from_the_weights():
    meta, state = cases.split_case(cases.load_case("generator_full"))
    config = generator_config(state, attention_type="full", n_heads=2)
    assert (config.num_layers, config.num_heads, config.model_dim) == (2, 2, 16)
    assert (config.head_query_dim, config.hidden_dim, config.attention) == (8, 64, "softmax")
    assert config.dropout == 0.1 and config.attention_options["attention_dropout"] == 0.1
    assert config.layer_norm_epsilon == 1e-5
    with pytest.raises(ValueError, match=r"n_heads=3 does not divide"):
        generator_config(state, attention_type="full", n_heads=3)
    with pytest.raises(ValueError, match=r"no 'transformer.layers.0.attention"):
        _, encoder_state = cases.split_case(cases.load_case("encoder_full"))
        generator_config(encoder_state, attention_type="full", n_heads=2)


def test_a_position_table_that_is_not_the_colabs_is_refused():
    meta, state = cases.split_case(cases.load_case("generator_causal_linear"))
    config = generator_config(state, attention_type="causal-linear", n_heads=2)
    state["pos_embedding.pe"] = state["pos_embedding.pe"][..., ::-1].copy()  # cos, sin
    with pytest.raises(ValueError, match=r"'pos_embedding.pe' is not the interleaved"):
        image_generator_from_fast_transformers(state, config)


def test_load_torch_checkpoint_without_torch_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ImportError, match=r"pip install \"linear-transformers\[torch\]\""):
        load_torch_checkpoint(tmp_path / "model.pth")


# --- live, with the authors' library -------------------------------------------------------------


def _live():
    return pytest.importorskip(
        "fast_transformers",
        reason="pytorch-fast-transformers not installed: the fixtures above cover the comparison",
    )


@pytest.mark.parametrize("seed", range(3))
def test_live_random_sizes_match_the_authors_library(seed):
    _live()
    rng = np.random.default_rng(seed)
    n_heads, d_query, d_value = (int(v) for v in rng.integers(1, 5, 3) + (0, 1, 1))
    builder = dict(
        n_layers=int(rng.integers(1, 4)),
        n_heads=n_heads,
        query_dimensions=d_query,
        value_dimensions=d_value,
        feed_forward_dimensions=int(rng.integers(4, 33)),
        activation=str(rng.choice(["relu", "gelu"])),
        final_normalization=bool(rng.integers(2)),
    )
    length, batch = int(rng.integers(2, 12)), int(rng.integers(1, 4))
    for kind, causal in (("full", False), ("full", True), ("linear", False), ("causal-linear", True)):
        check_encoder(
            cases.encoder_case(
                dict(builder, attention_type=kind), causal=causal, batch=batch, length=length, seed=seed
            )
        )
    for self_kind, cross_kind in (("full", "full"), ("causal-linear", "linear"), ("causal-linear", "full")):
        check_decoder(
            cases.decoder_case(
                dict(builder, self_attention_type=self_kind, cross_attention_type=cross_kind),
                batch=batch,
                length=length,
                memory_length=int(rng.integers(1, 9)),
                seed=seed,
            )
        )
    for kind in ("causal-linear", "full"):
        check_generator(
            cases.generator_case(
                kind,
                d_model=4 * int(rng.integers(1, 5)) * 2,
                n_heads=2,
                n_layers=int(rng.integers(1, 3)),
                mixtures=int(rng.integers(1, 5)),
                image_length=length + 1,
                batch=batch,
                seed=seed,
            )
        )


def test_live_load_torch_checkpoint_reads_a_saved_state_dict(tmp_path):
    _live()
    import torch

    case = cases.generator_case("causal-linear", seed=3)
    _, state = cases.split_case(case)
    path = tmp_path / "model.pth"
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    loaded = load_torch_checkpoint(path)
    assert sorted(loaded) == sorted(state)
    assert all(np.array_equal(loaded[k], state[k]) for k in state)
    torch.save({"epoch": 3, "state_dict": {k: torch.from_numpy(v) for k, v in state.items()}}, path)
    assert sorted(load_torch_checkpoint(path)) == sorted(state)
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match=r"holds no state dict"):
        load_torch_checkpoint(path)


def test_model_probabilities_sum_to_one_under_the_authors_parametrisation():
    # Their PixelCNN++ probabilities (the fixture) sum to 1 over the 256 classes, as ours do.
    case = cases.load_case("generator_full")
    np.testing.assert_allclose(case["output/probs"].sum(-1), 1.0, atol=1e-4)


# --- sampling the authors' demo models ------------------------------------------------------------


def test_sampling_an_authors_checkpoint_completes_test_images(tmp_path):

    from experiments.tasks.image_sampling import sample_from_fast_transformers

    test_images = write_mnist(tmp_path / "raw", splits=("test",))["test"][0]
    checkpoint = cases.mnist_sized_state(tmp_path / "generator.npz")
    common = dict(
        attention_type="causal-linear",
        n_heads=2,
        num_images=3,
        prefix_pixels=770,
        data_dir=tmp_path / "tfds",
        manual_dir=tmp_path / "raw",
    )
    results = {
        method: sample_from_fast_transformers(
            checkpoint, method=method, out=tmp_path / f"{method}.png", **common
        )
        for method in ("recurrent", "recompute")
    }
    images = results["recurrent"]["images"]
    assert images.shape == (3, 784) and (tmp_path / "recurrent.png").is_file()
    np.testing.assert_array_equal(images[:, :770], test_images[:3].reshape(3, -1)[:, :770])
    assert images.min() >= 0 and images.max() < 256
    # The recurrent form and the full recompute draw the same images from the same key.
    np.testing.assert_array_equal(images, results["recompute"]["images"])
    assert results["recurrent"]["images_per_sec"] > 0
    with pytest.raises(ValueError, match=r"prefix_pixels must be in \[1, 784\).*first sub-pixel"):
        sample_from_fast_transformers(checkpoint, **dict(common, prefix_pixels=0))
    with pytest.raises(ValueError, match=r"n_heads=3 does not divide"):
        sample_from_fast_transformers(checkpoint, **dict(common, n_heads=3))


def test_the_sample_command_runs_an_authors_checkpoint(tmp_path):

    write_mnist(tmp_path / "raw", splits=("test",))
    checkpoint = cases.mnist_sized_state(tmp_path / "generator.npz")
    args = (
        f"--fast_transformers_checkpoint={checkpoint}",
        "--attention_type=causal-linear",
        "--n_heads=2",
        "--num_images=2",
        f"--data_dir={tmp_path / 'tfds'}",
        f"--manual_dir={tmp_path / 'raw'}",
    )
    rc, last, err = run_module(
        "experiments.sample", *args, "--prefix_pixels=760", f"--out={tmp_path / 'out.png'}"
    )
    assert rc == 0, err[-3000:]
    assert (tmp_path / "out.png").is_file()
    rc, last, err = run_module("experiments.sample", *args, f"--workdir={tmp_path}")
    assert_one_line(rc, last, err, "sample: error: give exactly one of --workdir")
    torch_missing = {"PYTHONPATH": str(tmp_path / "no_torch")}
    (tmp_path / "no_torch").mkdir()
    (tmp_path / "no_torch" / "torch.py").write_text("raise ImportError('no torch here')\n")
    (tmp_path / "model.pth").write_bytes(b"not read")
    rc, last, err = run_module(
        "experiments.sample",
        f"--fast_transformers_checkpoint={tmp_path / 'model.pth'}",
        env_extra=torch_missing,
    )
    assert_one_line(rc, last, err, 'pip install "linear-transformers[torch]"')


def test_live_torch_tensors_are_read_as_they_are_bfloat16_included():
    _live()
    import torch

    from linear_transformers.interop import as_numpy_state_dict

    weights = torch.randn(3, 4)
    arrays = as_numpy_state_dict(
        {"w": weights, "h": weights.to(torch.bfloat16), "g": weights.requires_grad_(True)}
    )
    np.testing.assert_array_equal(arrays["g"], weights.detach().numpy())
    assert arrays["h"].dtype == np.float32
    np.testing.assert_array_equal(arrays["h"], weights.detach().to(torch.bfloat16).float().numpy())
