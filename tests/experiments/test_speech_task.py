"""The speech task end to end on the smoke corpus (built here, seconds): training, evaluation
against an independent per-utterance decode, resume after a real SIGTERM mid-step, the
transcribe command, and the config errors."""

import dataclasses
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tf32
from signal_senders import SignalWhileWaiting

from configs import speech as speech_config
from experiments import tasks
from experiments.data.speech import loading
from experiments.tasks.speech import Speech
from experiments.tasks.speech_transcripts import transcribe_workdir
from experiments.training import interrupts
from experiments.training.checkpoints import Checkpointer, CheckpointMismatchError
from experiments.training.metrics import read_metrics
from experiments.training.restore import restore_trainer
from linear_transformers import ctc


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfds")
    loading.prepared_builder("synthetic", data_dir=path, size="smoke")
    return str(path)


# The run most tests share: dropout on (a resumed run must replay its masks), 4 utterances of
# each evaluation split (one batch).
LINEAR = "dropout=0.1,max_eval_examples=4"


def _config(data_dir, extra=""):
    config = speech_config.get_config("smoke" + ("," + extra if extra else ""))
    config.data_dir = data_dir
    return config


@pytest.fixture(scope="module")
def linear_run(data_dir, tmp_path_factory):
    """A finished smoke run of the linear transformer: (workdir, result, per-step losses)."""
    workdir = tmp_path_factory.mktemp("linear") / "run"
    losses = []
    result = tasks.train_and_evaluate(
        _config(data_dir, LINEAR), workdir, step_callback=lambda s, m: losses.append(float(m["loss"]))
    )
    return workdir, result, losses


def test_loading_normalises_stacks_and_keeps_phonemes(data_dir):
    raw = loading.prepared_builder("synthetic", data_dir=data_dir, size="smoke").as_data_source("test")
    utterances = loading.load_utterances("synthetic", "test", data_dir=data_dir, size="smoke", stack=3)
    assert len(utterances) == len(raw)
    f_TF, example = utterances.features[0], raw[0]
    T = len(example["features"])
    assert f_TF.shape == (-(-T // 3), 240) and f_TF.dtype == np.float32
    unstacked = f_TF.reshape(-1, 80)[:T]  # frame 0's 80 bins, then frame 1's, ...
    np.testing.assert_allclose(unstacked.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(unstacked.std(0), 1, atol=1e-3)
    np.testing.assert_array_equal(utterances.phonemes[0], example["phonemes"])
    assert utterances.texts[0] == example["text"].decode()


def test_utterances_ctc_cannot_align_are_left_out_with_a_warning(data_dir, caplog):
    # Stacked 16 to one (6 frames a second), most utterances have fewer frames than phonemes.
    full = loading.load_utterances("synthetic", "train", data_dir=data_dir, size="smoke", stack=1)
    ratio = min(len(f) / len(y) for f, y in zip(full.features, full.phonemes))
    stack = int(np.ceil(max(len(f) / len(y) for f, y in zip(full.features, full.phonemes)))) + 1
    assert ratio > 1
    with pytest.raises(ValueError, match="no utterance left"):
        loading.load_utterances("synthetic", "train", data_dir=data_dir, size="smoke", stack=stack)
    kept = loading.load_utterances("synthetic", "train", data_dir=data_dir, size="smoke", stack=8)
    assert all(len(f) >= len(y) for f, y in zip(kept.features, kept.phonemes))
    if len(kept) < len(full):
        assert "fewer frames" in caplog.text


def test_a_smoke_run_trains_and_evaluates_per_on_both_splits(linear_run):
    workdir, result, losses = linear_run
    assert len(losses) == 6 and all(np.isfinite(losses))
    evals = [r for r in read_metrics(workdir) if "test_per" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for split in ("validation", "test"):
        assert 0 <= result[f"{split}_per"] and np.isfinite(result[f"{split}_loss"])


def test_the_evaluation_equals_decoding_each_utterance_alone(data_dir, linear_run):
    """Bucketed, padded evaluation batches (`Speech.transcribe`, what the evaluation's PER and
    loss are made of) decode every utterance as it is decoded on its own, unpadded, at float32
    products: an identity between two paths, which TF32 products would blur by 1e-4 in the loss."""
    workdir, result, _ = linear_run
    config = _config(data_dir, LINEAR)
    task = Speech(config)
    trainer, _ = restore_trainer(workdir, config, task)
    model = trainer.eval_model()
    utterances = task.load_split("test")
    alone, total = [], 0.0
    with jax.default_matmul_precision("highest"):
        order, references, batched, batched_total = task.transcribe(model, "test")
        for f_TF, y_L in zip(utterances.features, utterances.phonemes):
            logits_1TC = model(jnp.asarray(f_TF[None]), frame_lengths_B=jnp.array([len(f_TF)]))
            total += float(
                ctc.ctc_loss(
                    logits_1TC, jnp.array([len(f_TF)]), jnp.asarray(y_L[None]), jnp.array([len(y_L)])
                )[0]
            )
            tokens, lengths = ctc.greedy_decode(logits_1TC, jnp.array([len(f_TF)]))
            alone.append(np.asarray(tokens[0, : int(lengths[0])]).tolist())
    assert sorted(order) == list(range(len(utterances)))
    assert batched == [alone[i] for i in order]
    assert references == [utterances.phonemes[i].tolist() for i in order]
    assert batched_total == pytest.approx(total, rel=1e-4)
    # The evaluation's loss is that sum per phoneme (at this run's products).
    _, length = ctc.error_counts(references, batched)
    rounding = 2e-3 if tf32.rounds_float32_products() else 1e-4
    assert result["test_loss"] == pytest.approx(batched_total / length, rel=rounding)


def test_the_bilstm_trains_and_evaluates(data_dir, tmp_path):
    result = tasks.train_and_evaluate(_config(data_dir, "lstm,num_steps=3,eval_every=0"), tmp_path / "run")
    assert np.isfinite(result["loss"]) and 0 <= result["test_per"]


def test_a_sigterm_mid_step_resumes_exactly(data_dir, linear_run, tmp_path):
    _, straight_result, straight = linear_run
    config = _config(data_dir, LINEAR)
    losses = []
    sender = SignalWhileWaiting((signal.SIGTERM,), 2, losses)
    sender.start()
    try:
        with pytest.raises(interrupts.Interrupted, match="SIGTERM received"):
            # The loss array, not its value: reading it here would wait on the step in flight.
            tasks.train_and_evaluate(
                config, tmp_path / "run", step_callback=lambda s, m: losses.append(m["loss"])
            )
    finally:
        sender.stop = True
    assert sender.sent_at_step is not None
    saved = Checkpointer(tmp_path / "run" / "checkpoints").latest_step()
    assert 2 <= saved < 6
    resumed = []
    result = tasks.train_and_evaluate(
        config, tmp_path / "run", step_callback=lambda s, m: resumed.append(float(m["loss"]))
    )
    assert [float(x) for x in losses[:saved]] + resumed == straight
    for key in ("validation_per", "test_per", "validation_loss", "test_loss"):
        assert result[key] == straight_result[key], key


def test_resuming_with_other_stacked_frames_is_refused_by_name(data_dir, linear_run):
    workdir, _, _ = linear_run
    with pytest.raises(CheckpointMismatchError, match="stack_frames: 4 -> 3"):
        tasks.train_and_evaluate(_config(data_dir, LINEAR + ",stack_frames=3,num_steps=8"), workdir)


def test_transcribe_prints_text_reference_decoded_and_per(data_dir, linear_run):
    workdir, result, _ = linear_run
    text = transcribe_workdir(workdir, split="test", num=3)
    lines = text.splitlines()
    assert lines[0].endswith("step 6, test: 3 utterances")
    assert sum(line.startswith("text:") for line in lines) == 3
    assert sum(line.startswith("decoded:") for line in lines) == 3
    task = Speech(_config(data_dir))
    texts = task.load_split("test").texts[:3]
    assert sorted(line[len("text:") :].strip() for line in lines if line.startswith("text:")) == sorted(texts)
    assert lines[-1].startswith("PER over these 3:")
    # All of the split: the evaluation's PER.
    everything = transcribe_workdir(workdir, split="test", num=1000).splitlines()[-1]
    assert f"{result['test_per']:.4f}" in everything


def test_the_transcribe_command_names_a_workdir_of_another_task(tmp_path):
    (tmp_path / "config.json").write_text('{"task": "copy"}')
    out = subprocess.run(
        [sys.executable, "-m", "experiments.transcribe", f"--workdir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "trained the task 'copy'; transcribing needs a workdir of the task 'speech'" in out.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        ("mesh.sequence=2", "splits batches over devices"),
        ("attention=gla", "causal by definition"),
        ("corpus=timit", "config.corpus 'timit' is not one of"),
        ("corpus_size=huge", "config.corpus_size 'huge' is not one of"),
        ("lsh4,bucket_frames=48", "bucket_frames=48 must be a multiple of"),
        ("architecture=gru", "config.architecture 'gru' is not one of"),
        ("stack_frames=0", "config.stack_frames must be >= 1"),
    ],
)
def test_config_mistakes_are_named_before_any_work(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        tasks.train_and_evaluate(_config(str(tmp_path / "no_data"), extra), tmp_path / "run")
    assert not (tmp_path / "no_data").exists()


def test_the_speech_comparison_writes_its_table_at_the_smoke_size(data_dir, tmp_path):
    from experiments.benchmarking import speech_bench

    options = speech_bench.SpeechComparisonOptions(
        runs=("linear", "bi-lstm"),
        size="smoke",
        overrides=f"data_dir={data_dir},num_steps=2,eval_every=0,max_eval_examples=4,bucket_frames=32",
        out_dir=str(tmp_path),
        memory_gib=0,
        timed_steps=2,
        rounds=1,
    )
    rows = speech_bench.run_and_report(options, log=lambda *a: None)
    assert [r["run"] for r in rows] == ["linear", "bi-lstm"]
    for row in rows:
        assert row["seconds_per_epoch"] > 0 and row["parameters"] > 0 and 0 <= row["test_per"]
        assert row["paper_per"] == speech_bench.PAPER[row["run"]][0] / 100
    assert (tmp_path / "speech_results.csv").read_text().startswith("run,")
    # Timings and memory alone: no training, no workdir.
    timing_only = dataclasses.replace(
        options, runs=("linear",), train=False, out_dir=str(tmp_path / "t"), memory_gib=0.02, max_frames=64
    )
    timed = speech_bench.run_and_report(timing_only, log=lambda *a: None)
    assert timed[0]["seconds_per_epoch"] > 0 and "test_per" not in timed[0]
    for key in ("longest_frames", "longest_frames_ctc"):
        assert timed[0][key] in (32, 64) or np.isnan(timed[0][key])
    assert not (tmp_path / "t" / "linear").exists()
    task = Speech(speech_bench.run_config("softmax", options))
    model_only = [speech_bench.planned_bytes(task, n, ctc=False) for n in (64, 256)]
    with_ctc = speech_bench.planned_bytes(task, 256)
    assert model_only[1] > model_only[0] and with_ctc > model_only[1]
