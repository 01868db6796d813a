"""Speech recognition with CTC (the paper's third experiment, WSJ in the paper): `Speech`.

A non-causal model reads log-mel filterbank frames and a CTC loss aligns its per-frame outputs
to the utterance's phonemes; evaluation decodes greedily (best path) and reports the phoneme
error rate (edit distance / reference phonemes) on the validation and test splits. Models: a
transformer encoder of any attention kind (`FrameEncoder`: softmax, linear, reformer LSH, the
family's kinds) or a bidirectional LSTM (`BiLSTMEncoder`), both with a linear CTC head.

The corpus (experiments/data/speech): eSpeak NG speech of standard-library sentences made
offline (`synthetic`), or the user's LibriSpeech / WSJ. Batches hold utterances of similar
lengths (batching.BucketedBatches), padded at the end; the model masks the padded frames
(`key_lengths`; the LSTM's `seq_lengths`) and the loss the padded labels, so padding changes
nothing. The batch of a step is a function of (seed, step): a resumed run is exact.

Legend: B batch, T frames (after stacking), F features per frame, L phonemes, C classes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from experiments.data.speech import batching, loading  # loading imports no TFDS until it loads
from experiments.data.speech.features import NUM_MELS
from experiments.data.speech.phonemes import PHONEMES
from experiments.training import schemas
from experiments.training.config_checks import check_sizes, model_config
from experiments.training.trainer import Task, Trainer
from linear_transformers import ctc
from linear_transformers.acoustic import BiLSTMEncoder, FrameEncoder

ARCHITECTURES = ("transformer", "lstm")
EVAL_SPLITS = ("validation", "test")


def schema() -> ml_collections.ConfigDict:
    """Every key of a speech config, with its default."""
    c = ml_collections.ConfigDict()
    c.task = "speech"
    c.seed = 0

    # Data: the corpus (experiments/data/speech/loading.py), where it is prepared and where a
    # real corpus's files are; frames stacked `stack_frames` to one (100 Hz / stack).
    c.corpus = "synthetic"  # synthetic | librispeech | wsj
    c.corpus_size = "default"  # the synthetic corpus: default (hours) | smoke (seconds)
    c.data_dir = "~/tensorflow_datasets"
    c.manual_dir = ""  # librispeech / wsj files; "" = <data_dir>/downloads/manual
    c.stack_frames = 3
    c.bucket_frames = 32  # batches' time padded to a multiple of this (few compiled shapes)
    c.max_train_frames = 0  # > 0: leave out longer training utterances (stacked frames)
    c.max_train_examples = 0  # > 0: the first N training utterances only
    c.max_eval_examples = 0  # > 0: the first N of each evaluation split

    # Model: "transformer" (config.model, non-causal) or "lstm" (config.lstm).
    c.architecture = "transformer"
    c.model = schemas.model(
        attention="linear",
        num_layers=6,
        num_heads=6,
        model_dim=192,
        feed_forward_dim=768,
        dropout=0.1,
        dtype="float32",  # computation: float32 | bfloat16 (parameters stay float32)
    )
    c.lstm = ml_collections.ConfigDict({"hidden_size": 320, "num_layers": 3, "dropout": 0.1})

    schemas.optimisation(c)
    c.learning_rate = 3e-4
    c.warmup_steps = 500
    c.batch_size = 16
    c.num_steps = 20_000
    schemas.bookkeeping(c)
    c.log_every = 100
    c.eval_every = 2000
    c.checkpoint_every = 1000
    c.eval_batch_size = 32
    schemas.devices(c)
    return c


# Named variants (`configs/speech.py:name`), applied left to right.


def _attention(kind: str, doc: str, **options):
    def apply(c: ml_collections.ConfigDict) -> None:
        c.architecture = "transformer"
        c.model.attention = kind
        c.model.attention_options = ml_collections.ConfigDict(options)

    apply.__doc__ = doc
    return apply


def lstm(c: ml_collections.ConfigDict) -> None:
    """The bidirectional LSTM baseline (config.lstm)."""
    c.architecture = "lstm"


def cpu(c: ml_collections.ConfigDict) -> None:
    """Minutes on a laptop CPU: 4 layers, 4 heads, width 128 (bi-LSTM: 2 x 128), batch 16,
    frames stacked 4 to one, 2000 steps at 1e-3."""
    c.stack_frames = 4
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.model_dim = 128
    c.model.feed_forward_dim = 512
    c.lstm.hidden_size = 128
    c.lstm.num_layers = 2
    c.learning_rate = 1e-3
    c.warmup_steps = 200
    c.schedule = "cosine"
    c.num_steps = 2000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 500


def smoke(c: ml_collections.ConfigDict) -> None:
    """Seconds: the smoke corpus, a tiny model, 6 steps; for tests."""
    c.corpus_size = "smoke"
    c.stack_frames = 4
    # Every smoke utterance is under 160 stacked frames: one padded length, one compiled step.
    c.bucket_frames = 160
    c.model.num_layers = 1
    c.model.num_heads = 2
    c.model.model_dim = 32
    c.model.feed_forward_dim = 64
    c.model.dropout = 0.0
    c.lstm.hidden_size = 16
    c.lstm.num_layers = 1
    c.lstm.dropout = 0.0
    c.learning_rate = 1e-3
    c.warmup_steps = 0
    c.batch_size = 4
    c.num_steps = 6
    c.log_every = 2
    c.eval_every = 3
    c.checkpoint_every = 3
    c.eval_batch_size = 8
    c.progress_bar = False


VARIANTS = {
    "softmax": _attention("softmax", "Softmax attention."),
    "linear": _attention("linear", "Linear attention, elu(x) + 1 features (the paper's)."),
    # LSH buckets need the time axis in whole chunks: bucket_frames is a multiple of 32.
    "lsh4": _attention(
        "reformer",
        "Reformer LSH attention, 4 hashing rounds, 8 buckets, chunks of 32 frames.",
        num_rounds=4,
        num_buckets=8,
        chunk_size=32,
    ),
    "lstm": lstm,
    "cpu": cpu,
    "smoke": smoke,
}


def utterance_batch(utterances, rows, *, time_multiple: int) -> batching.SpeechBatch:
    """The utterances `rows` of a split, padded (labels to a multiple of 8)."""
    return batching.pad_batch(
        [utterances.features[i] for i in rows],
        [utterances.phonemes[i] for i in rows],
        time_multiple=time_multiple,
        label_multiple=8,
    )


def loss_sums(model, batch: batching.SpeechBatch):
    """(CTC loss summed over the batch, logits [B, T, C] float32)."""
    logits_BTC = model(batch.features_BTF, frame_lengths_B=batch.frame_lengths_B)
    loss_B = ctc.ctc_loss(logits_BTC, batch.frame_lengths_B, batch.labels_BL, batch.label_lengths_B)
    return jnp.sum(loss_B), logits_BTC


def _loss(model, batch):
    total, _ = loss_sums(model, batch)
    phonemes = jnp.sum(batch.label_lengths_B)
    return total / jnp.maximum(phonemes, 1), {"phonemes": phonemes}


@nnx.jit
def decode_batch(model, batch: batching.SpeechBatch):
    """(loss sum, tokens [B, T] (-1 past lengths), lengths [B]) of greedy CTC decoding."""
    total, logits_BTC = loss_sums(model, batch)
    tokens_BT, lengths_B = ctc.greedy_decode(logits_BTC, batch.frame_lengths_B)
    return total, tokens_BT, lengths_B


class Speech(Task):
    """Frames to phonemes with CTC; phoneme error rate on validation and test."""

    name = "speech"
    schema = staticmethod(schema)

    def __init__(self, config):
        super().__init__(config)
        self.splits = {}  # split name -> loading.Utterances
        self._batches = None

    def check(self) -> None:
        c = self.config
        if c.corpus not in loading.CORPORA:
            raise ValueError(f"config.corpus {c.corpus!r} is not one of {sorted(loading.CORPORA)}.")
        if c.corpus_size not in loading.SYNTHETIC_SIZES:
            raise ValueError(f"config.corpus_size {c.corpus_size!r} is not one of {loading.SYNTHETIC_SIZES}.")
        if c.architecture not in ARCHITECTURES:
            raise ValueError(f"config.architecture {c.architecture!r} is not one of {ARCHITECTURES}.")
        check_sizes(c, positive=("stack_frames", "bucket_frames", "eval_batch_size"))
        check_sizes(c, non_negative=("max_train_frames", "max_train_examples", "max_eval_examples"))
        check_sizes(c.lstm, positive=("hidden_size", "num_layers"))
        if not 0.0 <= c.lstm.dropout < 1.0:
            raise ValueError(f"config.lstm.dropout must be in [0, 1), got {c.lstm.dropout!r}.")
        if c.mesh.sequence != 1:
            raise ValueError(
                f"config.mesh.sequence={c.mesh.sequence}: the speech task splits batches over devices "
                "(mesh.data) only; set mesh.sequence=1."
            )
        options = dict(c.model.attention_options or {})
        default = schema().model
        if c.architecture == "lstm" and (c.model.attention, options) != (default.attention, {}):
            raise ValueError(
                f"config.model.attention={c.model.attention!r} (options {options}) configures the "
                "transformer and does nothing with config.architecture='lstm', which reads config.lstm; "
                "leave config.model.attention as it is, or drop the 'lstm' variant."
            )
        if c.architecture == "transformer" and "chunk_size" in options:
            if c.bucket_frames % options["chunk_size"]:
                raise ValueError(
                    f"config.bucket_frames={c.bucket_frames} must be a multiple of "
                    f"config.model.attention_options.chunk_size={options['chunk_size']} (LSH attends "
                    "within whole chunks of the padded time axis)."
                )
        if c.model.model_dim % 2:
            raise ValueError(
                f"config.model.model_dim must be even (sine/cosine positions), got {c.model.model_dim}."
            )
        model_config(c.model)
        nnx.eval_shape(self.build_model)  # a kind the encoder cannot take (causal-only) fails here
        # A missing corpus fails here, before the workdir is made.
        loading.check_available(c.corpus, data_dir=c.data_dir, manual_dir=c.manual_dir, size=c.corpus_size)

    def attention_kinds(self) -> dict[str, str]:
        if self.config.architecture == "lstm":
            return {}
        return {"model.attention": self.config.model.attention}

    def input_dim(self) -> int:
        return NUM_MELS * self.config.stack_frames

    def num_classes(self) -> int:
        return len(PHONEMES)

    def load_split(self, split: str):
        """Split `split` in memory (loading.Utterances), read once."""
        if split not in self.splits:
            c = self.config
            train = split == "train"
            self.splits[split] = loading.load_utterances(
                c.corpus,
                split,
                data_dir=c.data_dir,
                manual_dir=c.manual_dir or None,
                size=c.corpus_size,
                stack=c.stack_frames,
                max_examples=c.max_train_examples if train else c.max_eval_examples,
                max_frames=c.max_train_frames if train else 0,
            )
        return self.splits[split]

    def load_data(self) -> None:
        c = self.config
        train = self.load_split("train")
        for split in EVAL_SPLITS:
            self.load_split(split)
        if c.batch_size > len(train):
            raise ValueError(
                f"config.batch_size={c.batch_size} is more than the {len(train)} training utterances of "
                f"{c.corpus} ({c.corpus_size})."
            )
        self._batches = batching.BucketedBatches(train.frame_counts, c.batch_size, seed=c.seed)

    @property
    def steps_per_epoch(self) -> int:
        return self._batches.steps_per_epoch

    def build_model(self, *, sequence_axis=None) -> nnx.Module:
        c = self.config
        rngs = nnx.Rngs(params=c.seed, dropout=c.seed + 1)
        if c.architecture == "lstm":
            return BiLSTMEncoder(
                input_dim=self.input_dim(),
                hidden_size=c.lstm.hidden_size,
                num_layers=c.lstm.num_layers,
                num_classes=self.num_classes(),
                dropout=c.lstm.dropout,
                rngs=rngs,
            )
        return FrameEncoder(
            model_config(c.model, sequence_axis=sequence_axis),
            input_dim=self.input_dim(),
            num_classes=self.num_classes(),
            rngs=rngs,
        )

    def batch(self, step: int) -> batching.SpeechBatch:
        rows = self._batches.rows(step)
        return utterance_batch(self.splits["train"], rows, time_multiple=self.config.bucket_frames)

    def loss(self, model, batch):
        return _loss(model, batch)

    def train_scalars(self, loss, sums) -> dict:
        return {"train_phonemes": sums["phonemes"]}

    def eval_sums(self, model, batch) -> dict:
        total, _ = loss_sums(model, batch)
        return {"loss_sum": total, "phonemes": jnp.sum(batch.label_lengths_B)}

    def transcribe(self, model, split: str, rows=None):
        """(order, references, hypotheses, loss sum): the utterances `rows` of `split` (default:
        all) decoded greedily in length-sorted batches; `order` says which utterance each
        reference and hypothesis (phoneme id lists) is of."""
        utterances = self.load_split(split)
        if rows is None:
            rows = np.arange(len(utterances))
        rows = np.asarray(rows)
        order, references, hypotheses, total = [], [], [], 0.0
        for part in batching.evaluation_batches(utterances.frame_counts[rows], self.config.eval_batch_size):
            order += rows[part].tolist()
            batch = utterance_batch(utterances, rows[part], time_multiple=self.config.bucket_frames)
            loss_sum, tokens_BT, lengths_B = jax.device_get(decode_batch(model, batch))
            total += float(loss_sum)
            for i, n in enumerate(lengths_B):
                hypotheses.append(tokens_BT[i, :n].tolist())
                references.append(batch.labels_BL[i, : batch.label_lengths_B[i]].tolist())
        return order, references, hypotheses, total

    def evaluate(self, trainer: Trainer) -> dict:
        """Per split: loss per phoneme and phoneme error rate (greedy CTC decoding)."""
        model = trainer.eval_model()
        result = {}
        for split in EVAL_SPLITS:
            _, references, hypotheses, total = self.transcribe(model, split)
            errors, length = ctc.error_counts(references, hypotheses)
            result[f"{split}_loss"] = total / max(length, 1)
            result[f"{split}_per"] = errors / max(length, 1)
        return result

    def progress(self, scalars) -> dict:
        return {"loss": f"{scalars['loss']:.3f}"}
