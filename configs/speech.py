"""Speech recognition with CTC (the paper's WSJ experiment), on speech synthesised offline.

The corpus (eSpeak NG voices reading standard-library sentences, a few hours) is made under
--config.data_dir the first time it is asked for (about a minute). Models: a non-causal
transformer of any attention kind, or a bidirectional LSTM; CTC over phonemes; phoneme error
rate (PER) on validation and test.

  python -m experiments.train --config configs/speech.py:cpu,linear --workdir workdirs/sp_linear
  python -m experiments.train --config configs/speech.py:cpu,softmax --workdir workdirs/sp_softmax
  python -m experiments.train --config configs/speech.py:cpu,lsh4 --workdir workdirs/sp_lsh4
  python -m experiments.train --config configs/speech.py:cpu,lstm --workdir workdirs/sp_lstm
  python -m experiments.transcribe --workdir workdirs/sp_linear      # decoded test utterances
  python -m experiments.speech_comparison                             # all four, one table

`cpu` is the size that trains in minutes on a laptop CPU (measured: BENCHMARKS.md, "Speech
recognition"); without it, a larger model (6 layers, width 192; bi-LSTM 3 x 320) and 20,000
steps. `smoke` is seconds, for tests. Real corpora from your own copy:
`--config.corpus=librispeech --config.manual_dir=/data` (LibriSpeech/ inside) or
`--config.corpus=wsj` (experiments/data/speech/corpora.py says the layout).

The keys and defaults are the task's (`experiments.tasks.speech.schema`), the variants too
(`experiments.tasks.speech.VARIANTS`); `key=value` overrides a key (`attention=...` the field
of config.model).
"""

import ml_collections

from experiments.tasks import speech
from experiments.training import variants


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    """The task's defaults (`experiments.tasks.speech.schema`), then the variants in `arg`."""
    return variants.apply(speech.schema(), arg, speech.VARIANTS)
