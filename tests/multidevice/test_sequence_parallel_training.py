"""Training with the time axis split over devices (config.mesh.sequence > 1) on 8 host devices.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/test_multidevice.py does):
a tiny copy run on the meshes data=1 x sequence=8 and data=2 x sequence=4 gives the loss
trajectory of data=8 x sequence=1 (data parallel only); an interrupted sequence-parallel run
resumes to exactly the uninterrupted one; the image trainer split over time matches too; and
(marked slow) so does the encoder-decoder copy model (padded time, greedy decoding).

Each run compiles its train and eval steps for 8 devices (~10-15 s each on the 2-core CPU
machine), which is what these tests spend their time on.
"""

import jax
import numpy as np
import pytest

from configs import copy as copy_config
from configs import digits
from experiments import tasks
from experiments.training.metrics import read_metrics

NUM_DEVICES = 8

# max_length 65: the decoder reads 64 tokens, a multiple of every sequence size here, so no
# padding and the dropout masks (a function of the array shape) are those of the reference.
COPY = (
    "smoke,max_length=65,num_layers=1,num_heads=2,model_dim=32,feed_forward_dim=64,"
    "num_steps=4,log_every=1,eval_every=0,eval_batches=1,checkpoint_every=0,dropout=0.1"
)


def _losses(workdir):
    return [r["loss"] for r in read_metrics(workdir) if "loss" in r]


def _copy(mesh, extra=""):
    return copy_config.get_config(COPY + "," + mesh + ("," + extra if extra else ""))


@pytest.fixture(scope="module")
def copy_runs(tmp_path_factory):
    """{mesh: (workdir, result)} of the decoder-only copy run: data parallel only, time split
    over all 8 devices, and data=2 x sequence=4."""
    runs = {}
    # A module fixture is set up before conftest's (function-scoped) device check: skip here too.
    if jax.device_count() < NUM_DEVICES:
        pytest.skip(f"needs {NUM_DEVICES} devices, found {jax.device_count()}")
    for mesh in (
        "mesh.data=8,mesh.sequence=1",
        "mesh.data=-1,mesh.sequence=8",
        "mesh.data=2,mesh.sequence=4",
    ):
        workdir = tmp_path_factory.mktemp("copy")
        runs[mesh] = workdir, tasks.train_and_evaluate(_copy(mesh), workdir)
    return runs


def test_sequence_parallel_copy_matches_data_parallel(copy_runs):
    (ref_dir, ref), *others = copy_runs.values()
    assert len(_losses(ref_dir)) == 4
    for workdir, result in others:
        np.testing.assert_allclose(_losses(workdir), _losses(ref_dir), rtol=1e-4)
        for key in ("eval_loss", "token_accuracy"):
            assert result[key] == pytest.approx(ref[key], rel=1e-4), key


def test_interrupted_sequence_parallel_run_resumes_exactly(copy_runs, tmp_path):
    straight_dir, straight = copy_runs["mesh.data=-1,mesh.sequence=8"]
    config = _copy("mesh.data=-1,mesh.sequence=8")

    def interrupt(step, _):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tasks.train_and_evaluate(config, tmp_path, step_callback=interrupt)
    assert (tmp_path / "checkpoints" / "2").is_dir()
    resumed = tasks.train_and_evaluate(config, tmp_path)
    # Same mesh, same compiled steps, state restored onto the same (replicated) shardings.
    # The interrupted run logged step 1; step 2 was interrupted before its log line, which the
    # resumed run writes first (its window is in the checkpoint), then steps 3 and 4.
    by_step = lambda d: {r["step"]: r["loss"] for r in read_metrics(d) if "loss" in r}  # noqa
    assert by_step(tmp_path) == by_step(straight_dir)
    assert resumed["eval_loss"] == straight["eval_loss"]


@pytest.mark.slow  # ~55 s on the 2-core CPU machine: two encoder-decoder compilations
def test_sequence_parallel_encoder_decoder_with_greedy_decoding(tmp_path):
    # Sources of width 30 (max_length 64), padded to 32 for the 4 devices of the sequence axis:
    # exact, as padded keys are masked and the decoder is causal (without dropout: padding
    # changes the shape the dropout masks are drawn in).
    arg = (
        "encoder_decoder," + COPY + ",num_steps=2,model_dim=32,feed_forward_dim=64,max_length=64,dropout=0.0"
    )
    ref = tasks.train_and_evaluate(copy_config.get_config(arg), tmp_path / "ref")
    split = tasks.train_and_evaluate(
        copy_config.get_config(arg + ",mesh.data=2,mesh.sequence=4"), tmp_path / "split"
    )
    np.testing.assert_allclose(_losses(tmp_path / "split"), _losses(tmp_path / "ref"), rtol=1e-4)
    for key in ("eval_loss", "greedy_token_accuracy"):
        assert split[key] == pytest.approx(ref[key], rel=1e-4), key


def test_image_trainer_sequence_parallel_matches(tmp_path):
    def config(mesh):
        c = digits.get_config(
            "smoke,num_steps=3,log_every=1,eval_every=0,checkpoint_every=0,num_samples=2," + mesh
        )
        c.data_dir = str(tmp_path / "tfds")
        return c

    ref = tasks.train_and_evaluate(config("mesh.sequence=1"), tmp_path / "ref")
    split = tasks.train_and_evaluate(config("mesh.data=2,mesh.sequence=4"), tmp_path / "split")
    np.testing.assert_allclose(_losses(tmp_path / "split"), _losses(tmp_path / "ref"), rtol=1e-4)
    assert split["test_bits_per_dim"] == pytest.approx(ref["test_bits_per_dim"], rel=1e-4)
    assert (tmp_path / "split" / "samples" / "step_0000003.png").stat().st_size > 0


def test_demo_task_sequence_parallel_matches(tmp_path):
    from configs import demo

    def config(mesh):
        # 24 input tokens: a multiple of mesh.sequence.
        return demo.get_config(
            "seq_len=25,num_steps=3,log_every=1,eval_batch_size=16,progress_bar=false," + mesh
        )

    ref = tasks.train_and_evaluate(config("mesh.sequence=1"), tmp_path / "ref")
    split = tasks.train_and_evaluate(config("mesh.data=2,mesh.sequence=4"), tmp_path / "split")
    np.testing.assert_allclose(_losses(tmp_path / "split"), _losses(tmp_path / "ref"), rtol=1e-4)
    assert split["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-4)
    assert split["continuation_accuracy"] == ref["continuation_accuracy"]
