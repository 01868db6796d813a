"""Decode utterances with a trained speech model: text, reference and decoded phonemes, PER.

  python -m experiments.transcribe --workdir workdirs/sp_linear
  python -m experiments.transcribe --workdir workdirs/sp_linear --split validation --num 10 --step 1000

Greedy CTC decoding (the most likely class per frame, repeats merged, blanks dropped), as the
trainer's evaluation does; the last line is the phoneme error rate over the printed utterances.
"""

from absl import app, flags

from experiments.cli import one_line_errors, stop_at_once_on_interrupt
from experiments.tasks.speech_transcripts import transcribe_workdir
from experiments.training import mesh

_WORKDIR = flags.DEFINE_string("workdir", None, "A training workdir of the speech task.", required=True)
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "validation", "test"], "Which utterances.")
_NUM = flags.DEFINE_integer("num", 5, "How many utterances (the split's first).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")


@one_line_errors
def main(argv):
    del argv
    with stop_at_once_on_interrupt():  # nothing to save: Ctrl-C stops at once
        mesh.announce_backend()
        print(transcribe_workdir(_WORKDIR.value, split=_SPLIT.value, num=_NUM.value, step=_STEP.value))


if __name__ == "__main__":
    app.run(main)
