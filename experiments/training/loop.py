"""`train_and_evaluate(config, workdir)`: the paper's autoregressive image generator, end to end.

Runs on the ("data", "sequence") mesh of `config.mesh` (experiments/training/mesh.py):
parameters and optimizer state replicated, the batch split on "data" and, with
mesh.sequence > 1, its sub-pixel (time) axis split on "sequence", the model built with
`TransformerConfig(sequence_axis="sequence")`. Training and test-set evaluation run under
`jax.set_mesh(mesh)` with that model; sampling (`sample_images`, recurrent) uses the same
parameters in a model without sequence parallelism.

The batch of step s is a pure function of (seed, s) and dropout keys are folded from s, so a
resumed run replays exactly what an uninterrupted one would have done.

Legend: B batch, L sub-pixels per image (H*W*C), P mixture parameters per sub-pixel.
"""

from __future__ import annotations

import math
import pathlib
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from experiments.data import pipeline
from experiments.training import images
from experiments.training import mesh as mesh_lib
from experiments.training.config_checks import check_config, check_mesh
from experiments.training.metrics import MetricsWriter
from experiments.training.optimizer import apply_if_finite, make_optimizer, make_schedule
from experiments.training.run_dir import RunDirectory
from linear_transformers import mixture
from linear_transformers.image_generator import ImageGenerator, sample_images
from linear_transformers.transformer import TransformerConfig


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/Inf loss or gradient; the checkpoints on disk are all good."""


def transformer_config(
    config: ml_collections.ConfigDict,
    attention: str | None = None,
    attention_options=None,
    *,
    sequence_axis: str | None = None,
    **extra,
) -> TransformerConfig:
    """The model part of a trainer config; `attention`/`attention_options` default to the
    config's, `sequence_axis` (a mesh axis name, e.g. mesh.SEQUENCE) splits time over that axis
    in every attention layer, `extra` sets further TransformerConfig fields (e.g.
    cross_attention)."""
    if sequence_axis is not None:
        extra["sequence_axis"] = sequence_axis
    return TransformerConfig(
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        model_dim=config.model_dim,
        feed_forward_dim=config.feed_forward_dim,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        softmax_temp=config.softmax_temp or None,
        attention=attention or config.attention,
        dtype=config.dtype,
        attention_options=dict(config.attention_options if attention_options is None else attention_options),
        **extra,
    )


def build_model(
    config: ml_collections.ConfigDict, info, *, sequence_axis: str | None = None
) -> ImageGenerator:
    """The image generator for data set `info`, initialised from config.seed; `sequence_axis`
    as in `transformer_config` (the parameters do not depend on it)."""
    return ImageGenerator(
        transformer_config(config, sequence_axis=sequence_axis),
        num_classes=info.num_classes,
        num_mixtures=config.num_mixtures,
        max_length=math.prod(info.image_shape),
        rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1),
    )


_SPLIT_SPEC = re.compile(r"^(\w+)(?:\[(\d*):(\d*)\])?$")


def load_split(config, spec: str) -> np.ndarray:
    """Flattened images [N, L] of a split spec: "train", "test", or a slice like "test[:9000]"
    or "test[9000:]" (to train on part of a split when only that split is at hand)."""
    match = _SPLIT_SPEC.match(spec)
    if match is None or match.group(1) not in pipeline.SPLITS:
        raise ValueError(
            f"split {spec!r} is not one of {pipeline.SPLITS}, optionally sliced as 'test[:9000]'."
        )
    name, start, stop = match.groups()
    images = pipeline.load_images(
        config.dataset,
        name,
        data_dir=config.data_dir,
        manual_dir=config.manual_dir or None,
        download=config.download,
    )
    x = pipeline.flatten_images(images)[int(start) if start else None : int(stop) if stop else None]
    if not len(x):
        raise ValueError(f"split {spec!r} of {config.dataset!r} is empty.")
    # Checked once here: inside the compiled steps a bad value would only show as a NaN loss.
    num_classes = pipeline.dataset_info(config.dataset).num_classes
    low, high = int(x.min()), int(x.max())
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"split {spec!r} of {config.dataset!r} has sub-pixel values in "
            f"[{low}, {high}]; the model takes [0, {num_classes}). Check the data "
            f"files in {config.manual_dir or config.data_dir}."
        )
    return x


def _load_data(config):
    train = load_split(config, config.train_split)
    test = load_split(config, config.eval_split)
    if config.max_train_examples:
        train = train[: config.max_train_examples]
    if config.max_eval_examples:
        test = test[: config.max_eval_examples]
    if len(train) < config.batch_size:
        raise ValueError(
            f"config.batch_size={config.batch_size} exceeds the {len(train)} "
            f"training images of {config.dataset!r} {config.train_split!r}."
        )
    return train, test


class _Trainer:
    """Holds the compiled steps and shardings of one run; `train_and_evaluate` drives it.

    `mesh` is a ("data", "sequence") mesh (mesh_lib.make_mesh); a "sequence" axis of more than
    one device makes the training and evaluation model sequence-parallel.
    """

    def __init__(self, config, info, mesh):
        self.config, self.info, self.mesh = config, info, mesh
        self.replicated = mesh_lib.replicated(mesh)
        model = build_model(config, info, sequence_axis=mesh_lib.sequence_axis(mesh))
        self.graphdef, params, self.rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        model.eval()  # Dropout off: a second graph for evaluation, same variables.
        self.eval_graphdef = nnx.split(model, nnx.Param, nnx.RngState, ...)[0]
        # Sampling runs the recurrent form on the replicated model: the same variables in a
        # graph without sequence parallelism (the parameters do not depend on it).
        self.sample_graphdef = self.eval_graphdef
        if mesh_lib.sequence_axis(mesh) is not None:
            plain = nnx.eval_shape(lambda: build_model(config, info))  # the graph only: no init
            plain.eval()
            self.sample_graphdef = nnx.split(plain, nnx.Param, nnx.RngState, ...)[0]
        self.tx = make_optimizer(config)
        self.schedule = make_schedule(config)
        # The step lives in the state, so a checkpoint's label and its contents always agree.
        state = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            "rest": rest,
        }
        self.state = jax.device_put(state, self.replicated)
        self.dropout_key = jax.random.key(config.seed + 2)
        self.train_step = jax.jit(self._train_step, donate_argnums=0)
        self.eval_step = jax.jit(self._eval_step)

    def _train_step(self, state, rng_state, x_BL):
        model = nnx.merge(self.graphdef, state["params"], rng_state, state["rest"])
        # Dropout keys are a function of the step alone, so a resumed run replays them.
        nnx.reseed(model, dropout=jax.random.fold_in(self.dropout_key, state["step"]))

        def loss_fn(model):
            return model.nll(x_BL)

        # nnx.value_and_grad: dropout advances its RNG count inside the differentiated function.
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        new_state, finite = apply_if_finite(self.tx, state, loss, grads)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "finite": finite}
        return new_state, metrics

    def _eval_step(self, state, x_BL, weight_B):
        model = nnx.merge(self.eval_graphdef, state["params"], self.rng_state, state["rest"])
        return -jnp.sum(model.log_prob(x_BL) * weight_B)

    def shard_batch(self, x: np.ndarray) -> jax.Array:
        """This process's rows of a global batch, laid out over the mesh: [B] on "data",
        [B, L] on ("data", "sequence")."""
        return mesh_lib.shard_batch(self.mesh, x)

    def train(self, x_BL: np.ndarray):
        """One training step on the global batch x_BL: (new state, metrics)."""
        with jax.set_mesh(self.mesh):  # the sequence-parallel ops shard_map over this mesh
            return self.train_step(self.state, self.rng_state, self.shard_batch(x_BL))

    def evaluate(self, test_BL: np.ndarray) -> float:
        """Test bits/dim over every test image (the last batch padded, padding weighted 0)."""
        bs = self.config.eval_batch_size
        bs += (-bs) % self.mesh.shape[mesh_lib.DATA]
        total = 0.0
        for start in range(0, len(test_BL), bs):
            x = test_BL[start : start + bs]
            weight = np.zeros(bs, np.float32)
            weight[: len(x)] = 1.0
            x = np.concatenate([x, np.zeros((bs - len(x), x.shape[1]), x.dtype)])
            with jax.set_mesh(self.mesh):
                total += float(self.eval_step(self.state, self.shard_batch(x), self.shard_batch(weight)))
        return float(mixture.bits_per_dim(total / (len(test_BL) * test_BL.shape[1])))

    def eval_model(self) -> ImageGenerator:
        """The current parameters in evaluation mode, without sequence parallelism (for
        sampling with the recurrent form, outside any mesh context)."""
        return nnx.merge(self.sample_graphdef, self.state["params"], self.rng_state, self.state["rest"])

    def write_samples(self, path, step: int) -> pathlib.Path:
        """Sample config.num_samples images with the recurrent form; write a PNG grid."""
        key = jax.random.fold_in(jax.random.key(self.config.seed + 3), step)
        x_NL = np.asarray(sample_images(self.eval_model(), key, self.config.num_samples))
        scale = max(1, 128 // self.info.image_shape[0])
        return images.save_image_grid(
            path, x_NL.reshape(-1, *self.info.image_shape), self.info.num_classes, scale=scale
        )


def data_mesh(devices=None) -> jax.sharding.Mesh:
    """A data-parallel-only ("data", "sequence") mesh over `devices` (default: all): "data"
    spans them, "sequence" has size 1. Automatic (GSPMD) sharding, so the model code needs no
    sharding annotations."""
    devices = jax.devices() if devices is None else list(devices)
    return mesh_lib.mesh_from_shape((len(devices), 1), devices)


def due(step: int, every: int) -> bool:
    """Whether a task repeated `every` steps (0 = never) falls on `step`."""
    return every > 0 and step % every == 0


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir, *, step_callback: Callable[[int, dict], None] | None = None
) -> dict:
    """Train (resuming from the newest intact checkpoint in `workdir`), evaluate, sample;
    return the final metrics {"step", "train_bits_per_dim", "test_bits_per_dim",
    "steps_per_sec"}.

    The workdir is locked for the run (workdir_lock). SIGINT or SIGTERM stops the run after the
    step in flight, saves a checkpoint of it and raises `interrupts.Interrupted`; a second
    SIGINT, or a KeyboardInterrupt from `step_callback(step, metrics)` (run after every step),
    saves the state in hand under its own step and re-raises. Either way re-running resumes
    exactly: the losses equal an uninterrupted run's.
    """
    check_config(config)
    if config.distributed:
        jax.distributed.initialize()
    info = pipeline.dataset_info(config.dataset)
    check_mesh(config, kinds={"attention": config.attention}, sequence_length=math.prod(info.image_shape))
    with RunDirectory(workdir, config) as run:
        train_BL, test_BL = _load_data(config)
        trainer = _Trainer(config, info, mesh_lib.make_mesh(config))
        trainer.state, step = run.resume(trainer.state)
        run.write_config(config)
        return _train(config, run, trainer, train_BL, test_BL, step, step_callback)


def _train(config, run, trainer, train_BL, test_BL, step, step_callback) -> dict:
    batches = pipeline.Batches(train_BL, config.batch_size, seed=config.seed)
    writer = MetricsWriter(run.path)
    progress = None
    if config.progress_bar and jax.process_index() == 0:
        from tqdm import tqdm

        progress = tqdm(
            total=config.num_steps,
            initial=step,
            desc=f"{config.dataset} {config.attention}",
            dynamic_ncols=True,
        )
    result = {"step": step}
    window_start, window_steps, window_loss = time.perf_counter(), 0, []
    with run.stopping_at_step_boundaries(lambda: trainer.state) as signals:
        try:
            while step < config.num_steps:
                trainer.state, metrics = trainer.train(batches.batch(step))
                if not bool(metrics["finite"]):
                    raise NonFiniteLossError(
                        f"non-finite loss or gradient at step {step} (loss="
                        f"{float(metrics['loss'])}); training stopped. The update was not "
                        f"applied and no checkpoint was written after it: the latest checkpoint "
                        f"({run.latest_step()}) in {run.checkpointer.directory} is intact. "
                        f"Lower config.learning_rate or raise config.warmup_steps."
                    )
                step += 1
                window_steps += 1
                window_loss.append(metrics["loss"])
                if step_callback is not None:
                    step_callback(step, metrics)
                if due(step, config.log_every) or step == config.num_steps:
                    loss = float(np.mean(jax.device_get(window_loss)))
                    rate = window_steps / (time.perf_counter() - window_start)
                    scalars = {
                        "loss": loss,
                        "train_bits_per_dim": loss / math.log(2),
                        "grad_norm": float(metrics["grad_norm"]),
                        "steps_per_sec": rate,
                        "learning_rate": float(trainer.schedule(step - 1)),
                    }
                    writer.write(step, scalars)
                    result.update(
                        step=step, train_bits_per_dim=scalars["train_bits_per_dim"], steps_per_sec=rate
                    )
                    if progress is not None:
                        progress.set_postfix(
                            loss=f"{loss:.4f}", bpd=f"{loss / math.log(2):.4f}", steps_s=f"{rate:.1f}"
                        )
                    window_start, window_steps, window_loss = time.perf_counter(), 0, []
                if progress is not None:
                    progress.update(1)
                if due(step, config.checkpoint_every):
                    run.save(trainer.state)
                if due(step, config.eval_every) or step == config.num_steps:
                    test_bpd = trainer.evaluate(test_BL)
                    writer.write(step, {"test_bits_per_dim": test_bpd})
                    result["test_bits_per_dim"] = test_bpd
                if (due(step, config.sample_every) or step == config.num_steps) and jax.process_index() == 0:
                    trainer.write_samples(run.path / "samples" / f"step_{step:07d}.png", step)
                if step < config.num_steps:
                    run.stop_if_signalled(signals, trainer.state)
            run.save(trainer.state)
        finally:
            if progress is not None:
                progress.close()
            writer.close()
    if "test_bits_per_dim" not in result:  # resumed at the end: nothing trained this time
        result["test_bits_per_dim"] = trainer.evaluate(test_BL)
    result["step"] = step
    return result
