"""`train_and_evaluate(config, workdir, task_class)`: the one training loop, for every task.

A task (`Task`, implemented in experiments/tasks/) says what is trained: its config schema, the
model, the batch of each step, the loss, the evaluation and, optionally, samples. Everything
else is here, the same for every task:

- devices: the ("data", "sequence") mesh of `config.mesh` (experiments/training/mesh.py).
  Parameters and optimizer state are replicated, every batch array is split on "data" and,
  with mesh.sequence > 1, its time axis on "sequence", the model built with
  `TransformerConfig(sequence_axis="sequence")`; the recurrent forms (sampling, greedy
  decoding) use the same parameters in a model without sequence parallelism (`eval_model`).
- the workdir (run_dir.py): locked, resumed from the newest intact checkpoint, checkpointed
  every `checkpoint_every` steps and at the end; SIGINT/SIGTERM stop after the step in flight
  with a checkpoint of it (interrupts.py).
- processes (processes.py): with `config.distributed`, one run over several processes, each
  feeding its rows of every batch; a signal to any of them stops all after the same step
  (`processes.StopVote`), a process that dies or fails ends the others, naming it; process 0
  alone writes metrics, config.json and samples.
- reproducibility: the batch of step s is a function of (seed, s) and dropout keys are folded
  from s, so a resumed run replays exactly what an uninterrupted one would have done.
- non-finite losses: an update whose loss or gradients are not finite is never applied
  (optimizer.apply_if_finite); the flag of step s is read while step s + 1 runs, and always
  before anything is logged, evaluated or checkpointed, so no bad state reaches the disk.
- metrics: `metrics.jsonl` (and TensorBoard when installed) every `log_every` steps, one
  progress bar. Checkpoints hold the logging window (metrics.LogWindow), so a run resumed
  mid-window logs the uninterrupted run's numbers; an evaluation or samples due at the resumed
  step and missing from the workdir (the run stopped right after that checkpoint) are done
  before training goes on.
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging
from flax import nnx
from tqdm import tqdm

from experiments.training import interrupts, processes
from experiments.training import mesh as mesh_lib
from experiments.training.checkpoints import CUSTOM_METADATA
from experiments.training.config_checks import check_keys, check_mesh, check_values
from experiments.training.metrics import LogWindow, MetricsWriter, evaluated_steps, read_metrics
from experiments.training.optimizer import apply_if_finite, make_optimizer, make_schedule
from experiments.training.run_dir import RunDirectory


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/Inf loss or gradient; the checkpoints on disk are all good."""


class Task(abc.ABC):
    """What the trainer needs from an experiment; one instance per run, built from its config
    (after the config has been checked against `schema()`).

    Batches are pytrees of numpy arrays, batch first and, for arrays of rank >= 2, time second
    (the trainer lays them out over the mesh). `loss`, `eval_sums` run compiled.
    """

    name: str  # the config.task value that selects it

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config

    @staticmethod
    @abc.abstractmethod
    def schema() -> ml_collections.ConfigDict:
        """Every key of the task's config with its default: its own keys and the shared
        groups of experiments/training/schemas.py, which the trainer reads (`model`,
        `optimisation`, `bookkeeping`, `devices`)."""

    def check(self) -> None:
        """Raise ValueError for a value of the task's own keys it cannot use, naming the key
        and the value (sizes: `config_checks.check_sizes`). Runs before any work; the shared
        groups and config.model are checked before it (config_checks knows no task's keys)."""

    def attention_kinds(self) -> dict[str, str]:
        """{config key: attention kind} of every attention the model builds (for the mesh check)."""
        return {"model.attention": self.config.model.attention}

    def sequence_length(self) -> int | None:
        """The time axis of every batch when it must divide over mesh.sequence; None when
        `pad_for_mesh` pads it."""
        return None

    def load_data(self) -> None:
        """Read what the batches come from (called once, in the locked workdir)."""

    @abc.abstractmethod
    def build_model(self, *, sequence_axis: str | None = None) -> nnx.Module:
        """The model, initialised from config.seed; `sequence_axis` as in TransformerConfig
        (the parameters do not depend on it)."""

    @abc.abstractmethod
    def batch(self, step: int):
        """The global training batch of `step`."""

    def pad_for_mesh(self, batch, sequence: int):
        """`batch` with its time axis made divisible by `sequence` (default: unchanged)."""
        return batch

    @abc.abstractmethod
    def loss(self, model: nnx.Module, batch) -> tuple[jax.Array, dict]:
        """(scalar loss to minimise, {name: scalar} summed over a logging window)."""

    def train_scalars(self, loss: float, sums: dict) -> dict:
        """Task-specific scalars of a logging window (mean loss, summed aux)."""
        return {}

    @abc.abstractmethod
    def eval_sums(self, model: nnx.Module, batch) -> dict:
        """{name: scalar} sums over one evaluation batch (the model in evaluation mode)."""

    @abc.abstractmethod
    def evaluate(self, trainer: Trainer) -> dict:
        """Held-out metrics of the trainer's current state."""

    def write_samples(self, trainer: Trainer, directory, step: int) -> None:
        """Write samples of the current state (default: none)."""

    def samples_file(self, directory, step: int) -> pathlib.Path | None:
        """The file `write_samples(trainer, directory, step)` writes (a resumed run writes it
        if it is missing); None: the task writes none."""
        return None

    def progress(self, scalars: dict) -> dict:
        """What the progress bar shows of a logging window's scalars."""
        return {"loss": f"{scalars['loss']:.4f}"}


class Trainer:
    """The compiled steps, shardings and state of one run of `task` on `mesh` (a ("data",
    "sequence") mesh; a "sequence" axis of more than one device makes the training and
    evaluation model sequence-parallel)."""

    def __init__(self, config: ml_collections.ConfigDict, task: Task, mesh: jax.sharding.Mesh):
        self.config, self.task, self.mesh = config, task, mesh
        model = task.build_model(sequence_axis=mesh_lib.sequence_axis(mesh))
        self.graphdef, params, self.rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        model.eval()  # Dropout off: a second graph for evaluation, same variables.
        self.eval_graphdef = nnx.split(model, nnx.Param, nnx.RngState, ...)[0]
        # The recurrent forms run the same variables in a graph without sequence parallelism.
        self.plain_graphdef = self.eval_graphdef
        if mesh_lib.sequence_axis(mesh) is not None:
            plain = nnx.eval_shape(lambda: task.build_model())  # the graph only: no init
            plain.eval()
            self.plain_graphdef = nnx.split(plain, nnx.Param, nnx.RngState, ...)[0]
        self.tx = make_optimizer(config)
        self.schedule = make_schedule(config)
        # The step lives in the state, so a checkpoint's label and its contents always agree.
        state = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            "rest": rest,
        }
        self.state = mesh_lib.replicate(state, mesh)
        self.dropout_key = jax.random.key(config.seed + 2)
        self._train_step = jax.jit(self._train_step_fn, donate_argnums=0)
        self._eval_step = jax.jit(self._eval_step_fn)

    def _train_step_fn(self, state, rng_state, batch):
        model = nnx.merge(self.graphdef, state["params"], rng_state, state["rest"])
        # Dropout keys are a function of the step alone, so a resumed run replays them; a
        # stack's layers hold one key each ([L] keys: split from the step's key).
        nnx.reseed(model, dropout=jax.random.fold_in(self.dropout_key, state["step"]), policy="match_shape")
        # nnx.value_and_grad: dropout advances its RNG count inside the differentiated function.
        (loss, aux), grads = nnx.value_and_grad(self.task.loss, has_aux=True)(model, batch)
        new_state, finite = apply_if_finite(self.tx, state, loss, grads)
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "finite": finite, **aux}

    def _eval_step_fn(self, state, batch):
        model = nnx.merge(self.eval_graphdef, state["params"], self.rng_state, state["rest"])
        return self.task.eval_sums(model, batch)

    def shard_batch(self, batch):
        """A global numpy batch laid out over the mesh (time made to divide over "sequence")."""
        return mesh_lib.shard_batch(
            self.mesh, self.task.pad_for_mesh(batch, self.mesh.shape[mesh_lib.SEQUENCE])
        )

    def train(self, batch):
        """One training step on a global batch: the state advances; returns its metrics
        (device arrays: reading them waits for the step)."""
        with jax.set_mesh(self.mesh):  # the sequence-parallel ops shard_map over this mesh
            self.state, metrics = self._train_step(self.state, self.rng_state, self.shard_batch(batch))
        return metrics

    def eval_sums(self, batch) -> dict:
        """`task.eval_sums` of a global batch with the current parameters, as floats."""
        with jax.set_mesh(self.mesh):
            sums = self._eval_step(self.state, self.shard_batch(batch))
        return {k: float(v) for k, v in sums.items()}

    def eval_model(self) -> nnx.Module:
        """The current parameters in evaluation mode, without sequence parallelism (for the
        recurrent forms, outside any mesh context). With several processes each gets a copy on
        one of its own devices: what it computes with them (samples, process 0 alone) needs no
        other process."""
        params, rest = self.state["params"], self.state["rest"]
        if processes.multiprocess():
            params, rest = jax.tree.map(lambda x: x.addressable_data(0), (params, rest))
        return nnx.merge(self.plain_graphdef, params, self.rng_state, rest)


def due(step: int, every: int) -> bool:
    """Whether a task repeated `every` steps (0 = never) falls on `step`."""
    return every > 0 and step % every == 0


def check_config(config: ml_collections.ConfigDict, task_class: type[Task]) -> Task:
    """The task of `config` after every check that needs no data or device: keys and types
    against the task's schema, the shared values, config.model, then the task's own; a
    ValueError names the first problem."""
    check_keys(config, task_class.schema(), f"{task_class.__module__}.schema")
    check_values(config)
    task = task_class(config)
    task.check()
    return task


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir,
    task_class: type[Task],
    *,
    step_callback: Callable[[int, dict], None] | None = None,
) -> dict:
    """Train (resuming from the newest intact checkpoint in `workdir`) and evaluate; return the
    last logged scalars (step, loss, grad_norm, steps_per_sec, wall_time, learning_rate and the
    task's) and the last evaluation.

    The workdir is locked for the run (workdir_lock). SIGINT or SIGTERM stops the run after the
    step in flight, saves a checkpoint of it and raises `interrupts.Interrupted`; a second
    SIGINT, or a KeyboardInterrupt from `step_callback(step, metrics)` (run after every step),
    saves the state in hand under its own step and re-raises. Either way re-running resumes
    exactly: the losses equal an uninterrupted run's. `wall_time` (training seconds, without
    evaluation) carries over a resume.
    """
    task = check_config(config, task_class)
    processes.join(config)
    mesh_lib.announce_backend()
    mesh_lib.use_compilation_cache(config.compilation_cache_dir)
    if not processes.multiprocess():
        return _run(config, workdir, task, step_callback)
    # Signals before the loop are held too: every process must stop at the same step.
    with interrupts.deferred_signals(stop_at_once=False):
        try:
            result = _run(config, workdir, task, step_callback)
            # Process 0 alone writes the last samples: the others wait for it (JAX's exit barrier
            # would give up after peer_timeout).
            processes.barrier("finished", timeout_seconds=24 * 3600)
            return result
        except interrupts.Interrupted:
            raise
        except BaseException as e:
            processes.failing(e)  # the other processes stop within moments, naming this one
            raise


def _run(config, workdir, task: Task, step_callback) -> dict:
    processes.check_same_config(config, workdir)
    check_mesh(config, kinds=task.attention_kinds(), sequence_length=task.sequence_length())
    with RunDirectory(workdir, config) as run:
        task.load_data()
        trainer = Trainer(config, task, mesh_lib.make_mesh(config))
        trainer.state, step, window = _resume(run, trainer.state, config)
        wall_time = max(
            [r["wall_time"] for r in read_metrics(run.path) if "wall_time" in r and r["step"] <= step],
            default=0.0,
        )
        run.write_config(config)
        return _train(config, run, trainer, step, wall_time, window, step_callback)


# The logging window's entry in a checkpoint's custom metadata (metrics.LogWindow.saved).
WINDOW = "log_window"


def _resume(run: RunDirectory, state, config) -> tuple[dict, int, LogWindow]:
    """(state, step, logging window) of the newest intact checkpoint, or (state, 0, empty)."""
    state, step = run.resume(state)
    if step == 0:
        return state, 0, LogWindow(0)
    try:
        saved = run.checkpointer.custom_metadata(step).get(WINDOW)
    except Exception:  # unreadable: the arrays restored, only the window is lost
        saved = None
    if LogWindow.lost(saved) and (saved is not None or not due(step, config.log_every)):
        logging.warning(
            "checkpoint step %d in %s holds no logging window (%s): the next log line covers only "
            "the steps after step %d, not every step since the last log line.",
            step,
            run.checkpointer.directory,
            "written before checkpoints held it" if saved is None else "saved by a stop mid-step",
            step,
        )
    return state, step, LogWindow.restored(saved, step)


class _FiniteCheck:
    """The finite flag of the last step, read late: while the next step runs."""

    def __init__(self, run: RunDirectory):
        self.run, self.unchecked = run, None

    def expect(self, step: int, metrics: dict) -> None:
        self.verify()
        self.unchecked = (step, metrics)

    def verify(self) -> None:
        if self.unchecked is None:
            return
        step, metrics = self.unchecked
        self.unchecked = None
        if not bool(metrics["finite"]):
            raise NonFiniteLossError(
                f"non-finite loss or gradient at step {step} (loss={float(metrics['loss'])}); "
                f"training stopped. The update was not applied and no checkpoint was written "
                f"after it: the latest checkpoint ({self.run.latest_step()}) in "
                f"{self.run.checkpointer.directory} is intact. Lower config.learning_rate or "
                f"raise config.warmup_steps."
            )

    def all_finite(self) -> bool:
        try:
            self.verify()
        except NonFiniteLossError:
            return False
        return True


def _catch_up(config, run, trainer: Trainer, step: int, writer: MetricsWriter, result: dict) -> bool:
    """Do what was due at the resumed `step` and is missing from the workdir (the run was
    stopped between that step's checkpoint and them): its evaluation, its samples. Returns
    whether it evaluated."""
    if step == 0:
        return False
    task, last = trainer.task, step == config.num_steps
    evaluated = False
    missing = step not in evaluated_steps(read_metrics(run.path))
    # Every process evaluates (a collective) as process 0, which reads its own file, decides.
    missing = processes.from_process_0(f"evaluation_missing/{step}", str(int(missing))) == "1"
    if (due(step, config.eval_every) or last) and missing:
        evaluation = task.evaluate(trainer)
        writer.write(step, evaluation)
        result.update(evaluation)
        evaluated = True
    if (due(step, config.get("sample_every", 0)) or last) and jax.process_index() == 0:
        path = task.samples_file(run.path / "samples", step)
        if path is not None and not path.exists():
            task.write_samples(trainer, run.path / "samples", step)
    return evaluated


def _train(
    config, run, trainer: Trainer, step: int, wall_time: float, window: LogWindow, step_callback
) -> dict:
    task = trainer.task
    writer = MetricsWriter(run.path)
    progress = None
    if config.progress_bar and jax.process_index() == 0:
        progress = tqdm(
            total=config.num_steps,
            initial=step,
            desc=f"{task.name} {config.model.attention}",
            dynamic_ncols=True,
        )
    result = {"step": step}
    finite = _FiniteCheck(run)

    def checkpoint(state):  # of the state after `step`
        return {**state, CUSTOM_METADATA: {WINDOW: window.saved(step)}}

    def state_in_hand():
        # On an abrupt stop the state in hand is saved only if its last step is known finite.
        if not finite.all_finite():
            return None
        try:
            held = int(jax.device_get(trainer.state["step"]))
        except Exception:  # its buffers are gone: the save that follows fails and says so
            held = None
        return {**trainer.state, CUSTOM_METADATA: {WINDOW: window.saved(held)}}

    def log(step):  # the window's line at `step`, and a new window after it
        nonlocal window, wall_time
        steps, loss, sums, grad_norm = window.read()
        elapsed = window.elapsed()
        wall_time += elapsed
        scalars = {
            "loss": loss,
            **task.train_scalars(loss, sums),
            "grad_norm": grad_norm,
            "steps_per_sec": steps / elapsed,
            "wall_time": wall_time,
            "learning_rate": float(trainer.schedule(step - 1)),
        }
        writer.write(step, scalars)
        result.update(step=step, **scalars)
        if progress is not None:
            progress.set_postfix(**task.progress(scalars), steps_s=f"{scalars['steps_per_sec']:.3g}")
        window = window.next(step)

    sample_every = config.get("sample_every", 0)
    with run.stopping_at_step_boundaries(state_in_hand) as signals:
        vote = processes.StopVote(signals)
        try:
            # A state saved by an abrupt stop right after a step due to be logged holds that
            # step's window, not yet written: write it as the uninterrupted run did.
            if window and window.end == step and (due(step, config.log_every) or step == config.num_steps):
                log(step)
            evaluated = _catch_up(config, run, trainer, step, writer, result)
            if step < config.num_steps and (stop_signal := vote.now()):
                run.stop(stop_signal, checkpoint(trainer.state))
            if not window:
                window.restart_clock()
            while step < config.num_steps:
                metrics = trainer.train(task.batch(step))
                vote.cast()
                # Added before anything can stop the loop: a state in hand saved with its window.
                window.add(metrics)
                finite.expect(step, metrics)  # checks the previous step while this one runs
                step += 1
                if step_callback is not None:
                    step_callback(step, metrics)
                last = step == config.num_steps
                logging_now = due(step, config.log_every) or last
                evaluating = due(step, config.eval_every) or last
                sampling = (due(step, sample_every) or last) and jax.process_index() == 0
                saving = due(step, config.checkpoint_every)
                if logging_now or evaluating or sampling or saving:
                    finite.verify()
                if logging_now:
                    log(step)
                if progress is not None:
                    progress.update(1)
                if saving:
                    run.save(checkpoint(trainer.state))
                if evaluating:
                    evaluation = task.evaluate(trainer)
                    writer.write(step, evaluation)
                    result.update(evaluation)
                    evaluated = True
                if sampling:
                    task.write_samples(trainer, run.path / "samples", step)
                if not last and (stop_signal := vote.agreed()):
                    finite.verify()
                    run.stop(stop_signal, checkpoint(trainer.state))
                if not window:  # a new window starts after checkpointing and evaluation
                    window.restart_clock()
            finite.verify()
            run.save(checkpoint(trainer.state))
        finally:
            if progress is not None:
                progress.close()
            writer.close()
    if not evaluated:  # resumed at the end: nothing trained this time
        result.update(task.evaluate(trainer))
    result["step"] = step
    return result
