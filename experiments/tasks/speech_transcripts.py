"""Transcripts of a trained speech workdir, as text: `transcribe_workdir`."""

from __future__ import annotations

from experiments.data.speech import phonemes
from experiments.tasks.speech import Speech
from experiments.training.restore import load_config, restore_trainer
from linear_transformers import ctc


def _phonemes(ids) -> str:
    return " ".join(phonemes.decode(ids))


def transcribe_workdir(workdir, *, split: str = "test", num: int = 5, step: int | None = None) -> str:
    """For the first `num` utterances of `split`: text, reference and decoded phonemes and the
    utterance's PER, then the PER over all of them (greedy CTC decoding, checkpoint `step`,
    default the latest)."""
    if num < 1:
        raise ValueError(f"num must be >= 1 utterance, got {num}.")
    config = load_config(workdir)
    if config.get("task") != Speech.name:
        raise ValueError(
            f"workdir {workdir} trained the task {config.get('task')!r}; transcribing needs a workdir of "
            f"the task {Speech.name!r} (configs/speech.py)."
        )
    task = Speech(config)
    utterances = task.load_split(split)
    rows = list(range(min(num, len(utterances))))
    trainer, step = restore_trainer(workdir, config, task, step=step)
    order, references, hypotheses, _ = task.transcribe(trainer.eval_model(), split, rows)
    lines = [f"{workdir}, step {step}, {split}: {len(rows)} utterances"]
    for i, reference, hypothesis in zip(order, references, hypotheses):
        errors, length = ctc.error_counts([reference], [hypothesis])
        lines += [
            f"text:      {utterances.texts[i]}",
            f"reference: {_phonemes(reference)}",
            f"decoded:   {_phonemes(hypothesis)}",
            f"PER:       {errors / max(length, 1):.3f} ({errors} errors / {length} phonemes)",
            "",
        ]
    errors, length = ctc.error_counts(references, hypotheses)
    lines.append(f"PER over these {len(rows)}: {errors / max(length, 1):.4f} ({errors} / {length})")
    return "\n".join(lines)
