"""`train_and_evaluate(config, workdir)` for the copy task (configs/copy.py).

Two models: the paper's decoder-only transformer (`CausalLM` over [0, s, 0, s]) and the
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

Batches are a function of (seed, step) and dropout keys are folded from the step, so a resumed
run replays an uninterrupted one; `wall_time` (training seconds, evaluation excluded) carries
over a resume through the metrics file.

Devices: the ("data", "sequence") mesh of `config.mesh` (experiments/training/mesh.py).
Parameters and optimizer state are replicated, the batch is split on "data"; with
mesh.sequence > 1 its time axis is split on "sequence" and the model is built with
`TransformerConfig(sequence_axis="sequence")` (every attention kind in it must have a
sequence-parallel form). Time is then padded up to a multiple of mesh.sequence (`pad_time`):
padding sits after every real token with loss weight 0, and the decoder is causal and the
encoder masks keys past `source_lengths`, so the loss and accuracies are those of the unpadded
batch. Training and teacher-forced evaluation run under `jax.set_mesh(mesh)`; greedy decoding
(recurrent) runs the same parameters in a model without sequence parallelism, batch on "data".

Legend: B batch, T time, V vocabulary, W widest sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from experiments.data import copy_task
from experiments.training import greedy_recompute, schemas
from experiments.training import mesh as mesh_lib
from experiments.training.config_checks import check_attention, check_keys, check_mesh, check_values
from experiments.training.loop import NonFiniteLossError, due, transformer_config
from experiments.training.metrics import MetricsWriter, read_metrics
from experiments.training.optimizer import apply_if_finite, make_optimizer, make_schedule
from experiments.training.run_dir import RunDirectory
from linear_transformers.attention import attention_class
from linear_transformers.lm import CausalLM
from linear_transformers.seq2seq import EncoderDecoder, greedy_decode
from linear_transformers.transformer import TransformerConfig

EVAL_SEED_OFFSET = 1_000_003  # held-out batches come from another stream than training's


def check_copy_config(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError naming any unknown key or unusable value of a copy-task config."""
    check_keys(config, schemas.copy_task(), "experiments/training/schemas.py (copy_task)")
    check_values(config)
    if config.model not in copy_task.CopyBatches.MODELS:
        raise ValueError(f"config.model must be one of {copy_task.CopyBatches.MODELS}, got {config.model!r}.")
    copy_task.length_range(config.max_length)
    if config.model_dim % 2:
        raise ValueError(f"config.model_dim must be even (sine/cosine positions), got {config.model_dim}.")
    if config.model == "decoder":
        for key in ("encoder_attention", "cross_attention"):
            if config[key]:
                raise ValueError(
                    f"config.{key}={config[key]!r} applies to model="
                    f"'encoder_decoder' only; this config has model='decoder'."
                )
    elif config.encoder_attention:
        check_attention(config, "encoder_attention")
    check_mesh(config, kinds=attention_kinds(config))  # time is padded: no length condition


def attention_kinds(config) -> dict[str, str]:
    """{config key: attention kind} of every attention the model of `config` builds."""
    kinds = {"attention": config.attention}
    if config.model == "encoder_decoder":
        kinds["encoder_attention"] = config.encoder_attention or config.attention
        # "" = TransformerConfig's default for the decoder's kind.
        kinds["cross_attention"] = (
            config.cross_attention or TransformerConfig(attention=config.attention).cross_kind
        )
    return kinds


def source_width(config) -> int:
    """Most symbols an example holds: the encoder's (and decoder's) sequence length."""
    return copy_task.length_range(config.max_length)[1] - 1


def _options(config, kind, options) -> dict:
    options = dict(options)
    if kind == "linformer" and "max_length" not in options:
        options["max_length"] = source_width(config)  # the longest source it will see
    return options


def build_model(config: ml_collections.ConfigDict, *, sequence_axis: str | None = None) -> nnx.Module:
    """The decoder-only or encoder-decoder model of `config`, initialised from config.seed;
    `sequence_axis` (a mesh axis name) makes every attention layer sequence-parallel over it
    (the parameters do not depend on it)."""
    rngs = nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    vocab = config.num_symbols + 1
    if config.model == "decoder":
        return CausalLM(
            transformer_config(
                config,
                attention_options=_options(config, config.attention, config.attention_options),
                sequence_axis=sequence_axis,
            ),
            vocab,
            rngs=rngs,
        )
    enc_kind = config.encoder_attention or config.attention
    enc_options = config.encoder_attention_options if config.encoder_attention else config.attention_options
    cross = {}
    if config.cross_attention:
        cross = dict(
            cross_attention=config.cross_attention,
            cross_attention_options=_options(config, config.cross_attention, {}),
        )
    encoder = transformer_config(
        config, enc_kind, _options(config, enc_kind, enc_options), sequence_axis=sequence_axis
    )
    decoder = transformer_config(
        config,
        attention_options=_options(config, config.attention, config.attention_options),
        sequence_axis=sequence_axis,
        **cross,
    )
    return EncoderDecoder(encoder, decoder, vocab, rngs=rngs)


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
    """(logits [B, T, V], targets [B, T], mask [B, T]) for either layout."""
    if isinstance(batch, copy_task.LanguageModelBatch):
        return model(batch.inputs_BT), batch.targets_BT, batch.mask_BT
    logits = model(batch.source_BW, batch.target_in_BW, source_lengths=batch.source_lengths_B)
    return logits, batch.target_out_BW, batch.mask_BW


def loss_and_counts(model, batch):
    """Masked mean cross-entropy, and sums for the accuracies."""
    logits_BTV, targets_BT, mask_BT = _forward(model, batch)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), targets_BT)
    loss = jnp.sum(ce_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)
    return loss, accuracy_counts(jnp.argmax(logits_BTV, -1), targets_BT, mask_BT)


def accuracy_counts(predicted_BT, targets_BT, mask_BT) -> dict:
    """Sums over a batch: correct copied symbols, copied symbols, exact sequences, sequences."""
    correct_BT = (predicted_BT == targets_BT) & (mask_BT > 0)
    exact_B = jnp.all(correct_BT | (mask_BT == 0), axis=-1)
    return {
        "correct": jnp.sum(correct_BT),
        "symbols": jnp.sum(mask_BT > 0),
        "exact": jnp.sum(exact_B),
        "sequences": jnp.asarray(exact_B.shape[0]),
    }


class _CopyTrainer:
    """Holds the compiled steps and shardings of one run; `train_and_evaluate` drives it.

    `mesh`: a ("data", "sequence") mesh (default: `mesh_lib.make_mesh(config)`); a "sequence"
    axis of more than one device makes the training and evaluation model sequence-parallel.
    """

    def __init__(self, config, mesh: jax.sharding.Mesh | None = None):
        self.config = config
        self.mesh = mesh_lib.make_mesh(config) if mesh is None else mesh
        self.sequence_axis = mesh_lib.sequence_axis(self.mesh)
        model = build_model(config, sequence_axis=self.sequence_axis)
        self.graphdef, params, self.rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        model.eval()
        self.eval_graphdef = nnx.split(model, nnx.Param, nnx.RngState, ...)[0]
        # Greedy decoding: the same variables in a graph without sequence parallelism.
        self.decode_graphdef = self.eval_graphdef
        if self.sequence_axis is not None:
            plain = nnx.eval_shape(lambda: build_model(config))  # the graph only: no init
            plain.eval()
            self.decode_graphdef = nnx.split(plain, nnx.Param, nnx.RngState, ...)[0]
        self.tx = make_optimizer(config)
        self.schedule = make_schedule(config)
        # The step lives in the state, so a checkpoint's label and its contents always agree.
        state = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            "rest": rest,
        }
        self.state = jax.device_put(state, mesh_lib.replicated(self.mesh))
        self.dropout_key = jax.random.key(config.seed + 2)
        self.train_step = jax.jit(self._train_step, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step)
        # How evaluation decodes greedily: with the recurrent decoder ("recurrent"), by
        # re-running the parallel model per token where there is no recurrent form (LSH:
        # "recompute"), or not at all (a recurrent decoder-only model: teacher forcing is
        # greedy decoding).
        if not attention_class(config.attention).has_recurrent_form:
            self.greedy = "recompute"
        else:
            self.greedy = "recurrent" if config.model == "encoder_decoder" else None

    def _train_step(self, state, rng_state, batch):
        model = nnx.merge(self.graphdef, state["params"], rng_state, state["rest"])
        nnx.reseed(model, dropout=jax.random.fold_in(self.dropout_key, state["step"]))
        (loss, counts), grads = nnx.value_and_grad(loss_and_counts, has_aux=True)(model, batch)
        new_state, finite = apply_if_finite(self.tx, state, loss, grads)
        return new_state, {"loss": loss, "finite": finite, **counts}

    def _eval_step(self, state, batch):
        model = nnx.merge(self.eval_graphdef, state["params"], self.rng_state, state["rest"])
        loss, counts = loss_and_counts(model, batch)
        return {"loss_sum": loss * counts["symbols"], **counts}

    def shard_batch(self, batch):
        """A global numpy batch laid out over the mesh, time padded for the sequence axis."""
        return mesh_lib.shard_batch(self.mesh, pad_time(batch, self.mesh.shape[mesh_lib.SEQUENCE]))

    def train(self, batch):
        """One training step on a global batch: (new state, metrics)."""
        with jax.set_mesh(self.mesh):  # the sequence-parallel ops shard_map over this mesh
            return self.train_step(self.state, self.rng_state, self.shard_batch(batch))

    def eval_model(self):
        """The current parameters in evaluation mode, without sequence parallelism (for
        greedy decoding with the recurrent form)."""
        return nnx.merge(self.decode_graphdef, self.state["params"], self.rng_state, self.state["rest"])

    def evaluate(self) -> dict:
        """Loss and accuracies over config.eval_batches held-out batches."""
        c = self.config
        batches = copy_task.CopyBatches(
            batch_size=c.batch_size,
            max_length=c.max_length,
            num_symbols=c.num_symbols,
            model=c.model,
            seed=c.seed + EVAL_SEED_OFFSET,
        )
        totals, greedy = {}, {}
        model = self.eval_model() if self.greedy else None
        data_only = mesh_lib.mesh_from_shape((self.mesh.size, 1), self.mesh.devices.flat)
        for i in range(c.eval_batches):
            batch = batches.batch(i)
            with jax.set_mesh(self.mesh):
                counts = self.eval_step(self.state, self.shard_batch(batch))
            for k, v in counts.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            if self.greedy == "recompute":
                predicted_BT, targets_BT, mask_BT = _greedy_by_recompute(model, batch)
            elif self.greedy == "recurrent":
                # Unpadded, split on "data" only if the batch divides over every device.
                source = (batch.source_BW, batch.source_lengths_B)
                if c.batch_size % self.mesh.size == 0:
                    source = mesh_lib.shard_batch(data_only, source)
                predicted_BT = greedy_decode(
                    model,
                    source[0],
                    batch.source_BW.shape[1],
                    start_token=copy_task.SEPARATOR,
                    source_lengths=source[1],
                )
                targets_BT, mask_BT = batch.target_out_BW, batch.mask_BW
            if self.greedy:
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


def _greedy_by_recompute(model, batch):
    """(greedy predictions, targets, mask) of a batch, the parallel model re-run on the
    generated prefix for every token (greedy_recompute)."""
    if isinstance(batch, copy_task.LanguageModelBatch):
        predicted_BT = greedy_recompute.decoder_only(model, batch.inputs_BT, batch.mask_BT > 0)
        return predicted_BT, batch.targets_BT, batch.mask_BT
    predicted_BT = greedy_recompute.encoder_decoder(
        model, batch.source_BW, batch.source_lengths_B, batch.target_in_BW, batch.mask_BW > 0
    )
    return predicted_BT, batch.target_out_BW, batch.mask_BW


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir, *, step_callback: Callable[[int, dict], None] | None = None
) -> dict:
    """Train (resuming from the newest intact checkpoint in `workdir`) and evaluate; return
    the last metrics: step, loss, eval_loss, token/sequence accuracies (and greedy ones),
    wall_time. Locking, signals and interrupts as in `loop.train_and_evaluate`."""
    check_copy_config(config)
    mesh = mesh_lib.make_mesh(config)
    with RunDirectory(workdir, config) as run:
        trainer = _CopyTrainer(config, mesh)
        trainer.state, step = run.resume(trainer.state)
        wall_time = max(
            [r["wall_time"] for r in read_metrics(run.path) if "wall_time" in r and r["step"] <= step],
            default=0.0,
        )
        run.write_config(config)
        return _train(config, run, trainer, step, wall_time, step_callback)


def _train(config, run, trainer, step, wall_time, step_callback) -> dict:
    batches = copy_task.CopyBatches(
        batch_size=config.batch_size,
        max_length=config.max_length,
        num_symbols=config.num_symbols,
        model=config.model,
        seed=config.seed,
    )
    writer = MetricsWriter(run.path)
    result = {"step": step}
    window, window_start = [], time.perf_counter()
    with run.stopping_at_step_boundaries(lambda: trainer.state) as signals:
        try:
            while step < config.num_steps:
                trainer.state, metrics = trainer.train(batches.batch(step))
                if not bool(metrics["finite"]):
                    raise NonFiniteLossError(
                        f"non-finite loss or gradient at step {step} (loss="
                        f"{float(metrics['loss'])}); training stopped. The update was not "
                        f"applied; the latest checkpoint ({run.latest_step()}) in "
                        f"{run.checkpointer.directory} is intact. Lower config.learning_rate."
                    )
                step += 1
                window.append(metrics)
                if step_callback is not None:
                    step_callback(step, metrics)
                if due(step, config.log_every) or step == config.num_steps:
                    window = jax.device_get(window)
                    elapsed = time.perf_counter() - window_start
                    wall_time += elapsed
                    scalars = {
                        "loss": float(np.mean([m["loss"] for m in window])),
                        "train_token_accuracy": sum(float(m["correct"]) for m in window)
                        / sum(float(m["symbols"]) for m in window),
                        "steps_per_sec": len(window) / elapsed,
                        "wall_time": wall_time,
                        "learning_rate": float(trainer.schedule(step - 1)),
                    }
                    writer.write(step, scalars)
                    result.update(step=step, loss=scalars["loss"], wall_time=wall_time)
                    if config.progress_bar:
                        print(
                            f"step {step}: loss {scalars['loss']:.4f} train token accuracy "
                            f"{scalars['train_token_accuracy']:.3f} "
                            f"({scalars['steps_per_sec']:.3g} steps/s, "
                            f"{1 / scalars['steps_per_sec']:.3g} s/step)",
                            flush=True,
                        )
                    window = []
                if due(step, config.checkpoint_every):
                    run.save(trainer.state)
                if due(step, config.eval_every) or step == config.num_steps:
                    evaluation = trainer.evaluate()
                    writer.write(step, evaluation)
                    result.update(evaluation)
                if step < config.num_steps:
                    run.stop_if_signalled(signals, trainer.state)
                if not window:  # a new window starts after checkpointing and evaluation
                    window_start = time.perf_counter()
            run.save(trainer.state)
        finally:
            writer.close()
    if "eval_loss" not in result:  # resumed at the end: nothing trained this time
        result.update(trainer.evaluate())
    result["step"] = step
    return result
