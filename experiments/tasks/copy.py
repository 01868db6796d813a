"""The copy task (paper section 4.1): `Copy`.

Two architectures: the paper's decoder-only transformer (`CausalLM` over [0, s, 0, s]) and the
replication's encoder-decoder (`EncoderDecoder`, source s, target s). Both train with
cross-entropy on the copied symbols only and report, on a fixed held-out set of batches:

  token_accuracy      teacher-forced argmax equals the target, over copied symbols
  sequence_accuracy   every copied symbol right; for a model whose causal outputs depend on
                      earlier positions only, this is also the rate of exact copies under
                      greedy decoding (by induction over the positions)
  greedy_*            the same two accuracies under greedy decoding: for encoder-decoder
                      models whose decoder has a recurrent form, of `greedy_decode` (one
                      compiled loop, memory encoded once); for decoders without one (LSH, whose
                      buckets depend on later positions, so teacher forcing is not greedy
                      decoding), of `greedy_recompute` (the parallel model re-run on the
                      generated prefix for every token)

The config's keys and defaults are `schema()` (the paper's setting); `VARIANTS` are its named
variants (the replication's encoder-decoder, the attention baselines, the `cpu`, `smoke` and
`long` sizes, `variable_length`), for configs/copy.py and the copy comparison alike.

Variable-length, packed (`variable_length`; decoder-only): examples of min_symbols and more
symbols, several per row (`copy_task.PackedBatch`: segment ids and positions per example, the
model called with them, so each example is computed as if it were alone); the accuracies stay
per example (`sequence_accuracy` counts exact copies per packed segment, `sequences` the
segments). `packed=false` lays the same examples out one per row, for comparison.

With mesh.sequence > 1 time is padded up to a multiple of it (`pad_time`): padding sits after
every real token with loss weight 0, the decoder is causal and the encoder masks keys past
`source_lengths`, so the loss and accuracies are those of the unpadded batch.

Legend: B batch, T (target) time, S source time, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from experiments.data import copy_task
from experiments.tasks import greedy_recompute
from experiments.training import mesh as mesh_lib
from experiments.training import schemas
from experiments.training.config_checks import check_sizes, model_config
from experiments.training.trainer import Task, Trainer
from linear_transformers.attention import attention_class, kinds_with
from linear_transformers.lm import CausalLM
from linear_transformers.seq2seq import EncoderDecoder, greedy_decode
from linear_transformers.transformer import TransformerConfig

EVAL_SEED_OFFSET = 1_000_003  # held-out batches come from another stream than training's


def schema() -> ml_collections.ConfigDict:
    """Every key of a copy-task config, with its default: the paper's setting."""
    c = ml_collections.ConfigDict()
    c.task = "copy"
    c.seed = 0

    # Data: n symbols, n uniform in [min_symbols, (max_length - 1) // 2); min_symbols 0 = the
    # paper's max_length // 4, 1 = the widest range.
    c.max_length = 128
    c.num_symbols = 10
    c.min_symbols = 0
    # Decoder-only: examples drawn per step (0 = batch_size); the step trains on those that
    # first-fit packs into batch_size rows of max_length - 1 tokens, up to the first that fits
    # in none (experiments/data/copy_task.py). packed: they fill batch_size rows, told apart by
    # segment ids; else each has a row of its own (examples_per_step rows, those of candidates
    # that did not fit left empty): the same examples and loss, only the padding differs.
    c.examples_per_step = 0
    c.packed = False

    # Model: "decoder" (the paper's) or "encoder_decoder" (the replication's). config.model is
    # the decoder (TransformerConfig(**config.model)); config.encoder holds where the encoder
    # differs from it (unset = the same; encoder_decoder only).
    c.architecture = "decoder"
    c.model = schemas.model(
        attention="linear",
        num_layers=4,
        num_heads=8,
        model_dim=256,
        feed_forward_dim=1024,
        dropout=0.0,
        dtype="float32",  # computation: float32 | bfloat16 (parameters stay float32)
    )
    c.encoder = schemas.model_overrides()

    schemas.optimisation(c)
    c.learning_rate = 1e-3
    c.schedule = "step"
    c.decay_steps = 3000
    c.weight_decay = 0.0
    c.batch_size = 64
    c.num_steps = 10_000

    schemas.bookkeeping(c)
    c.log_every = 100
    c.eval_every = 1000
    c.checkpoint_every = 1000
    c.eval_batches = 4  # held-out batches of batch_size for the accuracies
    schemas.devices(c)
    return c


# Named variants of the schema (`configs/copy.py:name`, the copy comparison's runs and sizes),
# applied left to right by experiments.training.variants.apply.


def encoder_decoder(c: ml_collections.ConfigDict) -> None:
    """The replication: 4 + 4 layers, 8 heads, width 512, constant learning rate 1e-3."""
    c.architecture = "encoder_decoder"
    c.model.model_dim = 512
    c.model.feed_forward_dim = 2048
    c.schedule = "constant"


def linformer(c: ml_collections.ConfigDict) -> None:
    """Linformer encoder (its max_length defaults to the longest source)."""
    c.encoder.attention = "linformer"
    c.encoder.attention_options = ml_collections.ConfigDict({"projected_length": max(4, c.max_length // 8)})


def performer(c: ml_collections.ConfigDict) -> None:
    """Linear attention with FAVOR+ positive orthogonal random features (Performer)."""
    c.model.attention = "linear"
    c.model.attention_options = ml_collections.ConfigDict({"feature_map": "favor"})


def _lsh(rounds: int):
    def apply(c: ml_collections.ConfigDict) -> None:
        c.model.attention = "reformer"
        c.model.attention_options = ml_collections.ConfigDict(
            {"num_rounds": rounds, "num_buckets": 8, "chunk_size": max(4, c.max_length // 8)}
        )

    apply.__doc__ = f"Reformer LSH attention, {rounds} hashing round(s), 8 buckets, chunks of max_length / 8."
    return apply


def cpu(c: ml_collections.ConfigDict) -> None:
    """Minutes on a laptop CPU: sequences of 64, 2 layers, 4 heads, width 128, 3000 steps."""
    c.max_length = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.model_dim = 128
    c.model.feed_forward_dim = 256
    c.batch_size = 32
    c.num_steps = 3000
    c.learning_rate = 3e-3  # 1e-3 learns too slowly for 3000 steps at this size
    c.decay_steps = 2000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 1000


def smoke(c: ml_collections.ConfigDict) -> None:
    """Seconds: short sequences, a tiny model; for tests."""
    c.max_length = 16
    c.num_symbols = 4
    c.model.num_layers = 2
    c.model.num_heads = 2
    c.model.model_dim = 64
    c.model.feed_forward_dim = 128
    c.batch_size = 32
    c.num_steps = 10
    c.learning_rate = 3e-3
    c.schedule = "constant"
    c.log_every = 5
    c.eval_every = 10
    c.eval_batches = 2
    c.checkpoint_every = 5
    c.progress_bar = False


def long(c: ml_collections.ConfigDict) -> None:
    """Sequences of 32768 tokens split over 8 devices (sequence parallelism, LASP-2): the
    decoder-only copy task (copies of 8192..16382 symbols), causal linear attention, 2 layers,
    4 heads, width 64, batch 1 (= the data-parallel replicas: mesh.data = 8 / 8 = 1), 20 steps
    at 3e-3, on an 8-device mesh (data=1 x sequence=8; the 32767 input tokens are padded to
    32768, 4096 per device). Fakes 8 devices on one CPU:

      XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.train \\
          --config configs/copy.py:long --workdir workdirs/copy_long

    Twenty steps show that it trains at this length, not that it learns to copy (measured:
    BENCHMARKS.md, section 6). Re-running the command resumes from the checkpoint (step 20:
    evaluates only).
    """
    c.max_length = 32768
    c.model.attention = "linear"
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.model_dim = 64
    c.model.feed_forward_dim = 128
    c.batch_size = 1
    c.num_steps = 20
    c.learning_rate = 3e-3
    c.schedule = "constant"
    c.log_every = 5
    c.eval_every = 0  # once, at the end
    c.eval_batches = 1
    c.checkpoint_every = 0  # once, at the end
    c.mesh.sequence = 8


def variable_length(c: ml_collections.ConfigDict) -> None:
    """Copies of 1 to (max_length - 1) // 2 - 1 symbols, packed several to a row: as many
    examples per step as fill ~85% of the batch_size rows (examples_per_step; ~2% of the
    candidates then do not fit and are left out). Put it after the size, which it reads;
    `variable_length,packed=false` trains on the same examples, one per row."""
    c.min_symbols = 1
    c.packed = True
    low, high = copy_task.length_range(c.max_length, c.min_symbols)
    mean_tokens = low + high  # 2 * mean n + 1, n uniform in [low, high)
    c.examples_per_step = int(0.85 * c.batch_size * (c.max_length - 1) / mean_tokens)


# A size named after it would leave examples_per_step at the earlier size's: refused, by name.
variable_length.reads = ("batch_size", "max_length")


VARIANTS = {
    "encoder_decoder": encoder_decoder,
    "linformer": linformer,
    "performer": performer,
    "lsh1": _lsh(1),
    "lsh4": _lsh(4),
    "lsh8": _lsh(8),
    "cpu": cpu,
    "smoke": smoke,
    "long": long,
    "variable_length": variable_length,
}


def pad_time(batch, multiple: int):
    """`batch` (either layout) with its time axis zero-padded to a multiple of `multiple`.

    Exact for the loss and accuracies: the padding comes after every real token and has loss
    weight 0, a causal decoder never looks ahead at it, and the encoder masks source keys past
    `source_lengths`. The per-example lengths are unchanged.
    """

    def pad(x):
        if x.ndim < 2 or x.shape[1] % multiple == 0:
            return x
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, -x.shape[1] % multiple)
        return np.pad(x, widths)

    return type(batch)(*(pad(np.asarray(x)) for x in batch))


def _forward(model, batch):
    """(logits [B, T, V], targets [B, T], mask [B, T]) for any layout."""
    if isinstance(batch, copy_task.LanguageModelBatch):
        return model(batch.inputs_BT), batch.targets_BT, batch.mask_BT
    if isinstance(batch, copy_task.PackedBatch):
        logits = model(batch.inputs_BT, segment_ids=batch.segment_ids_BT, positions=batch.positions_BT)
        return logits, batch.targets_BT, batch.mask_BT
    logits = model(batch.source_BS, batch.target_in_BT, source_lengths=batch.source_lengths_B)
    return logits, batch.target_out_BT, batch.mask_BT


def loss_and_counts(model, batch):
    """Masked mean cross-entropy, and sums for the accuracies."""
    logits_BTV, targets_BT, mask_BT = _forward(model, batch)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    loss = jnp.sum(ce_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)
    segment_ids_BT = batch.segment_ids_BT if isinstance(batch, copy_task.PackedBatch) else None
    return loss, accuracy_counts(jnp.argmax(logits_BTV, -1), targets_BT, mask_BT, segment_ids_BT)


def accuracy_counts(predicted_BT, targets_BT, mask_BT, segment_ids_BT=None) -> dict:
    """Sums over a batch: correct copied symbols, copied symbols, exact sequences, sequences.

    A sequence is a row holding copied symbols or, with `segment_ids_BT` (packed rows), a
    segment holding them: each example counts once, exact when all its copied symbols are.
    """
    correct_BT = (predicted_BT == targets_BT) & (mask_BT > 0)
    wrong_BT = (mask_BT > 0) & ~correct_BT
    if segment_ids_BT is None:
        present_S = jnp.any(mask_BT > 0, axis=-1)  # rows (a padded layout's empty rows: none)
        wrong_S = jnp.any(wrong_BT, axis=-1)
    else:  # one slot per (row, segment id); id 0 (padding) never holds copied symbols
        B, T = segment_ids_BT.shape
        slot_BT = segment_ids_BT + (T + 1) * jnp.arange(B)[:, None]
        count = functools.partial(jax.ops.segment_sum, segment_ids=slot_BT.ravel(), num_segments=B * (T + 1))
        present_S = count((mask_BT > 0).ravel().astype(jnp.int32)) > 0
        wrong_S = count(wrong_BT.ravel().astype(jnp.int32)) > 0
    return {
        "correct": jnp.sum(correct_BT),
        "symbols": jnp.sum(mask_BT > 0),
        "exact": jnp.sum(present_S & ~wrong_S),
        "sequences": jnp.sum(present_S),
    }


def _greedy_by_recompute(model, batch):
    """(greedy predictions, targets, mask) of a batch, the parallel model re-run on the
    generated prefix for every token (greedy_recompute)."""
    if isinstance(batch, copy_task.LanguageModelBatch):
        predicted_BT = greedy_recompute.decoder_only(model, batch.inputs_BT, batch.mask_BT > 0)
        return predicted_BT, batch.targets_BT, batch.mask_BT
    predicted_BT = greedy_recompute.encoder_decoder(
        model, batch.source_BS, batch.source_lengths_B, batch.target_in_BT, batch.mask_BT > 0
    )
    return predicted_BT, batch.target_out_BT, batch.mask_BT


def _is_set(value) -> bool:
    """Whether an override field holds a value (unset: None, or an empty group of options)."""
    return value is not None and not (isinstance(value, ml_collections.ConfigDict) and len(value) == 0)


class Copy(Task):
    """Copy n random symbols after a separator, decoder-only or encoder-decoder."""

    name = "copy"
    schema = staticmethod(schema)

    def __init__(self, config):
        super().__init__(config)
        self._batches = None  # the training batches, built when first needed (after check())

    def copy_batches(self, seed: int) -> copy_task.CopyBatches:
        """The batches of `seed`, in the layout of config.architecture."""
        c = self.config
        return copy_task.CopyBatches(
            batch_size=c.batch_size,
            max_length=c.max_length,
            num_symbols=c.num_symbols,
            architecture=c.architecture,
            seed=seed,
            min_symbols=c.min_symbols,
            examples_per_step=c.examples_per_step,
            packed=c.packed,
        )

    def check(self) -> None:
        c = self.config
        check_sizes(c, positive=("num_symbols", "max_length", "eval_batches"))
        check_sizes(c, non_negative=("min_symbols", "examples_per_step"))
        if c.architecture != "decoder" and (c.packed or c.examples_per_step):
            raise ValueError(
                f"config.packed={c.packed} and config.examples_per_step={c.examples_per_step} apply to "
                f"architecture='decoder' only (set packed=false, examples_per_step=0); this config has "
                f"architecture={c.architecture!r}."
            )
        if c.packed and not attention_class(c.model.attention).supports_segments:
            raise ValueError(
                f"config.packed=True needs an attention kind that takes segment ids; "
                f"config.model.attention={c.model.attention!r} does not (kinds that do: "
                f"{kinds_with('supports_segments')})."
            )
        self.copy_batches(c.seed)  # the architecture, max_length and min_symbols, as the data takes them
        if c.model.model_dim % 2:
            raise ValueError(
                f"config.model.model_dim must be even (sine/cosine positions), got {c.model.model_dim}."
            )
        if c.architecture == "decoder":
            set_fields = [f"encoder.{k}" for k, v in c.encoder.items() if _is_set(v)]
            set_fields += [
                f"model.{k}" for k in ("cross_attention", "cross_attention_options") if c.model[k] is not None
            ]
            if set_fields:
                raise ValueError(
                    f"config {set_fields} apply to "
                    f"architecture='encoder_decoder' only; this config has architecture='decoder'."
                )
        elif c.encoder.attention is None and c.encoder.attention_options:
            raise ValueError(
                "config.encoder.attention_options are options of config.encoder.attention, "
                "which is unset (the encoder uses config.model's kind and options); set it too."
            )
        self.model_configs()  # every value, before any work

    def attention_kinds(self) -> dict[str, str]:
        kinds = {"model.attention": self.config.model.attention}
        if self.config.architecture == "encoder_decoder":
            encoder, decoder = self.model_configs()
            kinds["encoder.attention"] = encoder.attention
            kinds["model.cross_attention"] = decoder.cross_kind
        return kinds

    def source_width(self) -> int:
        """Most symbols an example holds: the encoder's (and decoder's) sequence length."""
        return copy_task.length_range(self.config.max_length)[1] - 1

    def _options(self, kind, options) -> dict:
        options = dict(options or {})
        if kind == "linformer" and "max_length" not in options:
            options["max_length"] = self.source_width()  # the longest source it will see
        return options

    def model_configs(
        self, sequence_axis: str | None = None
    ) -> tuple[TransformerConfig | None, TransformerConfig]:
        """(encoder or None, decoder) TransformerConfigs; `sequence_axis` as in TransformerConfig."""
        c = self.config
        model = c.model
        fields = {
            "sequence_axis": sequence_axis,
            "attention_options": self._options(model.attention, model.attention_options),
        }
        if model.cross_attention is not None:
            fields["cross_attention_options"] = self._options(
                model.cross_attention, model.cross_attention_options
            )
        decoder = model_config(model, **fields)
        if c.architecture == "decoder":
            return None, decoder
        overrides = {
            k: v for k, v in c.encoder.to_dict().items() if v is not None and k != "attention_options"
        }
        if c.encoder.attention is not None:
            overrides["attention_options"] = c.encoder.attention_options.to_dict()
        group = ml_collections.ConfigDict({**model.to_dict(), **overrides})
        encoder = model_config(
            group,
            "config.encoder.",
            sequence_axis=sequence_axis,
            attention_options=self._options(group.attention, group.attention_options),
        )
        return encoder, decoder

    def build_model(self, *, sequence_axis=None) -> nnx.Module:
        rngs = nnx.Rngs(params=self.config.seed, dropout=self.config.seed + 1)
        vocab = self.config.num_symbols + 1
        encoder, decoder = self.model_configs(sequence_axis)
        if encoder is None:
            return CausalLM(decoder, vocab, rngs=rngs)
        return EncoderDecoder(encoder, decoder, vocab, rngs=rngs)

    def batch(self, step: int):
        if self._batches is None:
            self._batches = self.copy_batches(self.config.seed)
        return self._batches.batch(step)

    def pad_for_mesh(self, batch, sequence: int):
        return pad_time(batch, sequence)

    def loss(self, model, batch):
        return loss_and_counts(model, batch)

    def train_scalars(self, loss, sums) -> dict:
        return {"train_token_accuracy": sums["correct"] / sums["symbols"]}

    def progress(self, scalars) -> dict:
        return {"loss": f"{scalars['loss']:.4f}", "token_acc": f"{scalars['train_token_accuracy']:.3f}"}

    def eval_sums(self, model, batch) -> dict:
        loss, counts = loss_and_counts(model, batch)
        return {"loss_sum": loss * counts["symbols"], **counts}

    def greedy(self) -> str | None:
        """How evaluation decodes greedily: with the recurrent decoder ("recurrent"), by
        re-running the parallel model per token where there is no recurrent form (LSH:
        "recompute"), or not at all (a recurrent decoder-only model: teacher forcing is
        greedy decoding)."""
        if not attention_class(self.config.model.attention).has_recurrent_form:
            return "recompute"
        return "recurrent" if self.config.architecture == "encoder_decoder" else None

    def evaluate(self, trainer: Trainer) -> dict:
        """Loss and accuracies over config.eval_batches held-out batches."""
        c = self.config
        batches = self.copy_batches(c.seed + EVAL_SEED_OFFSET)
        greedy_kind = self.greedy()
        totals, greedy = {}, {}
        model = trainer.eval_model() if greedy_kind else None
        mesh = trainer.mesh
        data_only = mesh_lib.mesh_from_shape((mesh.size, 1), mesh.devices.flat)
        for i in range(c.eval_batches):
            batch = batches.batch(i)
            for k, v in trainer.eval_sums(batch).items():
                totals[k] = totals.get(k, 0.0) + v
            if greedy_kind == "recompute":
                predicted_BT, targets_BT, mask_BT = _greedy_by_recompute(model, batch)
            elif greedy_kind == "recurrent":
                # Unpadded, split on "data" only if the batch divides over every device.
                source = (batch.source_BS, batch.source_lengths_B)
                if c.batch_size % mesh.size == 0:
                    source = mesh_lib.shard_batch(data_only, source)
                predicted_BT = greedy_decode(
                    model,
                    source[0],
                    batch.source_BS.shape[1],
                    start_token=copy_task.SEPARATOR,
                    source_lengths=source[1],
                )
                targets_BT, mask_BT = batch.target_out_BT, batch.mask_BT
            if greedy_kind:
                for k, v in accuracy_counts(predicted_BT, targets_BT, mask_BT).items():
                    greedy[k] = greedy.get(k, 0.0) + float(v)
        result = {
            "eval_loss": totals["loss_sum"] / totals["symbols"],
            "token_accuracy": totals["correct"] / totals["symbols"],
            "sequence_accuracy": totals["exact"] / totals["sequences"],
        }
        if greedy:
            result["greedy_token_accuracy"] = greedy["correct"] / greedy["symbols"]
            result["greedy_sequence_accuracy"] = greedy["exact"] / greedy["sequences"]
        return result
