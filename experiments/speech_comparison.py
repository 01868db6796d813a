"""Speech recognition (CTC) for softmax, linear, LSH-4 and the bi-LSTM: table and PER curves,
beside the paper's WSJ figures.

  python -m experiments.speech_comparison                      # the four runs, `cpu` size
  python -m experiments.speech_comparison --runs=linear,softmax --overrides=num_steps=500 \
      --out_dir=benchmark_results/speech_quick
  python -m experiments.speech_comparison --notrain --overrides=stack_frames=1 \
      --out_dir=benchmark_results/speech_stack1      # timings and memory only, 100 frames/s

Writes speech_results.csv/.json and speech_per.png to --out_dir and prints a markdown table.
Finished runs in --out_dir are resumed (a no-op), not retrained. The corpus is made under the
config's data_dir first if it is not there (minutes).
"""

from absl import app, flags, logging

from experiments.benchmarking.speech_bench import RUNS, SpeechComparisonOptions, run_and_report
from experiments.cli import one_line_errors

_RUNS = flags.DEFINE_list("runs", list(RUNS), f"Runs, from: {', '.join(RUNS)}.")
_SIZE = flags.DEFINE_string(
    "size", "cpu", "Speech-task variants setting the scale (as in configs/speech.py:)."
)
_OVERRIDES = flags.DEFINE_string("overrides", "", "key=value,... applied to every run last.")
_OUT = flags.DEFINE_string("out_dir", "benchmark_results/speech", "Where runs and reports go.")
_MEMORY = flags.DEFINE_float("memory_gib", 16.0, "Budget for the longest utterance that fits; 0 = skip.")
_TRAIN = flags.DEFINE_bool("train", True, "False: time and size the models only (no training, no PER).")


@one_line_errors
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    run_and_report(
        SpeechComparisonOptions(
            runs=tuple(_RUNS.value),
            size=_SIZE.value,
            overrides=_OVERRIDES.value,
            out_dir=_OUT.value,
            memory_gib=_MEMORY.value,
            train=_TRAIN.value,
        )
    )


if __name__ == "__main__":
    app.run(main)
