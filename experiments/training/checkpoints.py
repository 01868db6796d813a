"""Orbax checkpoints of the whole training state, verified by checksum, with clear errors.

Every save writes `checksums.json` into the step's directory: the SHA-256 of each file Orbax
wrote. Orbax itself does not check the bytes it reads (flipped bits in array data restore as
wrong numbers), so a restore verifies them first. Hashing is in the standard library
(hashlib); the cost is one extra read of the checkpoint per save and restore.

A checkpoint written before a module was renamed (`RENAMED_KEYS`) restores into the renamed
model: its arrays are read under the old names and returned under the new ones. One written
before a stack's layers were stacked (`STACKED_KEYS`: `layers/<i>/...` per layer, where the model
now holds `layers/...` with a leading axis of L) restores too: the L arrays of each parameter
(and of the optimizer's copies of it) are read and stacked.

A save runs to its end whatever signals arrive (interrupts.completing_save); a save that fails
for want of disk space is one `CheckpointSaveError` naming the directory, the space free there
and the space needed, its half-written directory removed.
"""

from __future__ import annotations

import hashlib
import json
import logging as std_logging
import os
import pathlib
import shutil
import sys

import jax
import orbax.checkpoint as ocp
from absl import logging

from experiments.training import interrupts, model_change, processes, save_faults
from experiments.training.config_diff import config_differences

MANIFEST = "checksums.json"
DAMAGED_DIR = "damaged_checkpoints"  # beside the checkpoint directory, outside Orbax's view
# A saved dict's entry of JSON values (not arrays): written as the checkpoint's Orbax custom
# metadata, committed with it, read back by `Checkpointer.custom_metadata`. Why not arrays: a
# restore target (experiments.sample's, a test's) then need not know it is there.
CUSTOM_METADATA = "custom_metadata"

# Old -> new names of renamed dict keys (modules) in the saved tree. Why: a checkpoint stores
# every array under its path in the model (params.<module>..., and the optimizer state's copies
# of it), so renaming a module attribute would otherwise strand every checkpoint written before
# the rename. A key is read under its old name only where the target has the new name and the
# checkpoint the old one at that same position; any other difference is still a mismatch.
RENAMED_KEYS = {
    # CausalLM's and ImageGenerator's causal Encoder stack (not a cross-attending Decoder).
    "decoder": "transformer",
}


# Modules whose layers were once saved one by one (`<key>/<i>/...`) and are now stacked
# (`<key>/...`, each array [L, ...]: linear_transformers/layer_stack.py). Why: the arrays of the
# checkpoints written before are the same numbers, saved apart.
STACKED_KEYS = ("layers",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, or written by another model."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose bytes are not the bytes that were saved, or cannot be read."""


class CheckpointMismatchError(CheckpointError):
    """A readable checkpoint whose arrays do not have the names (paths) or shapes the target has."""


def _silence_failed_restore_aftermath() -> None:
    """Drop the reports a failed Orbax restore leaves behind, once per process.

    When a read fails, Orbax closes its event loop while TensorStore still has reads in flight:
    each then reports `RuntimeError('Event loop is closed')` through sys.unraisablehook, and
    the tasks and futures nobody awaits any more are logged by asyncio as "... exception was never
    retrieved" when collected, possibly after the error has been shown. Dozens of lines that
    say nothing about the cause and bury it; the cause itself is in the CheckpointError.
    """
    if getattr(sys.unraisablehook, "drops_closed_loop_reports", False):
        return
    previous_hook = sys.unraisablehook

    def hook(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous_hook(unraisable)

    hook.drops_closed_loop_reports = True
    sys.unraisablehook = hook
    std_logging.getLogger("asyncio").addFilter(
        lambda record: "exception was never retrieved" not in record.getMessage()
    )


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost exception behind `error` (TensorStore's own message
    says which array and which bytes; Orbax's wrappers around it do not)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text if len(text) <= 400 else text[:400] + "..."


def _key_name(key) -> str:
    """The name of one step of a pytree key path: a dict key, attribute or index, as a string
    (Orbax saves namedtuples as dicts, tuples as lists and every key as a string)."""
    for field in ("key", "name", "idx"):
        if hasattr(key, field):
            return str(getattr(key, field))
    return str(key)


def _paths_and_leaves(tree) -> list[tuple[tuple[str, ...], object]]:
    return [
        (tuple(map(_key_name, path)), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _renamed_path(path, saved_prefixes, old_names) -> tuple[str, ...]:
    """`path` with each key the saved tree holds under its old name (`RENAMED_KEYS`) renamed."""
    old_path = ()
    for key in path:
        old = old_names.get(key)
        if (
            old is not None
            and old_path + (key,) not in saved_prefixes
            and old_path + (old,) in saved_prefixes
        ):
            key = old
        old_path += (key,)
    return old_path


def _per_layer_paths(path, leaf, saved_paths) -> tuple[tuple[str, ...], ...] | None:
    """The saved paths of the L layers of a stacked target leaf (`STACKED_KEYS`), where the
    saved tree holds them one by one and not stacked; else None."""
    if path in saved_paths or not getattr(leaf, "shape", ()):
        return None
    for i, key in enumerate(path):
        if key in STACKED_KEYS and i + 1 < len(path) and not path[i + 1].isdigit():
            layers = tuple(path[: i + 1] + (str(n),) + path[i + 1 :] for n in range(leaf.shape[0]))
            if all(layer in saved_paths for layer in layers):
                return layers
    return None


def _saved_paths(target, saved) -> list | None:
    """Where `saved` (a checkpoint's metadata tree) holds each leaf of `target`, in the target's
    leaf order: its path, reading a key of the target under its old name (`RENAMED_KEYS`) where
    the saved tree has the old name at that position and not the new one; or, for a stacked
    leaf saved one layer at a time (`STACKED_KEYS`), the tuple of its L layers' paths. None
    unless the two trees then hold exactly the same arrays."""
    saved_paths = {path for path, _ in _paths_and_leaves(saved)}
    saved_prefixes = {path[:i] for path in saved_paths for i in range(len(path) + 1)}
    old_names = {new: old for old, new in RENAMED_KEYS.items()}
    mapped, read = [], []
    for path, leaf in _paths_and_leaves(target):
        old_path = _renamed_path(path, saved_prefixes, old_names)
        layers = _per_layer_paths(old_path, leaf, saved_paths)
        mapped.append(old_path if layers is None else layers)
        read.extend([old_path] if layers is None else layers)
    if len(set(read)) != len(read) or set(read) != saved_paths:
        return None
    return mapped


def _is_per_layer(source) -> bool:
    return isinstance(source[0], tuple)


def _fits(target, saved) -> bool:
    """Whether `saved` (a checkpoint's metadata tree) holds every array of `target` under its
    path (after `RENAMED_KEYS`, or one layer at a time: `STACKED_KEYS`) with its shape, and
    nothing else. Dtypes are not compared: Orbax casts on restore."""
    sources = _saved_paths(target, saved)
    if sources is None:
        return False
    saved_leaves = dict(_paths_and_leaves(saved))
    for source, (_, leaf) in zip(sources, _paths_and_leaves(target)):
        # A stacked leaf read one layer at a time: each layer's array lacks the leading axis.
        paths, expected = (
            (source, tuple(leaf.shape[1:])) if _is_per_layer(source) else ((source,), tuple(leaf.shape))
        )
        for path in paths:
            shape = getattr(saved_leaves[path], "shape", None)
            if shape is not None and tuple(shape) != expected:
                return False
    return True


def _one_layer(leaf):
    """The restore target of one layer of a stacked leaf: its shape, dtype and sharding
    without the leading axis."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype, sharding=sharding)


def _file_hashes(step_dir: pathlib.Path) -> dict[str, str]:
    hashes = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            hashes[path.relative_to(step_dir).as_posix()] = digest.hexdigest()
    return hashes


class Checkpointer:
    """Save and restore `{"step", "params", "opt_state", "rest"}` pytrees by step in `directory`.

    Saves are synchronous and atomic (Orbax writes a temporary directory and renames it), so
    an interrupt, a crash or a NaN never leaves a half-written checkpoint under a step's name;
    `checksums.json` then records what was written.
    """

    def __init__(self, directory, *, max_to_keep: int = 2):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(
                f"Checkpointer: max_to_keep must be an int >= 1 (the newest "
                f"checkpoint is always kept), got {max_to_keep!r}."
            )
        self.directory = pathlib.Path(directory).expanduser().absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers=ocp.StandardCheckpointHandler(),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
            ),
        )

    def all_steps(self) -> list[int]:
        """Every complete checkpoint's step, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def save(self, step: int, state) -> None:
        """Write `state` as checkpoint `step` (a no-op if that step is already saved).

        Signals do not cut the save short (interrupts.completing_save). A full disk raises
        CheckpointSaveError; the checkpoints saved before are left as they were. A dict's
        CUSTOM_METADATA entry is saved as JSON beside the arrays (`custom_metadata`).
        """
        custom = state.get(CUSTOM_METADATA) if isinstance(state, dict) else None
        if custom is not None:
            state = {k: v for k, v in state.items() if k != CUSTOM_METADATA}
        with interrupts.completing_save(step, self.directory):
            if step in self._manager.all_steps():
                return
            _silence_failed_restore_aftermath()  # a failed write leaves the same reports
            try:
                with save_faults.writer_failures_reported_once():
                    self._manager.save(
                        step, args=ocp.args.StandardSave(state), force=True, custom_metadata=custom
                    )
                    self._manager.wait_until_finished()
                    if jax.process_index() == 0:
                        self._write_manifest(step)
            except Exception as e:
                number = save_faults.disk_full_errno(e)
                if number is None:
                    raise
                raise self._disk_full_error(step, state, number) from e

    def _write_manifest(self, step: int) -> None:
        step_dir = self.directory / str(step)
        manifest = step_dir / MANIFEST
        partial = manifest.with_suffix(".tmp")
        try:
            partial.write_text(json.dumps(_file_hashes(step_dir), indent=1))
        except OSError:
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, manifest)  # atomic: a manifest is whole or absent

    def _disk_full_error(self, step: int, state, number: int) -> save_faults.CheckpointSaveError:
        """The error for a save of `step` that ran out of space, once what it had written is
        removed (Orbax's temporary directory: never a checkpoint, and it holds the space)."""
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
        self._manager.reload()
        try:
            free = save_faults.human_size(shutil.disk_usage(self.directory).free)
        except OSError:
            free = "unknown"
        latest = self.latest_step()
        if latest is None:
            resume = "step 0 (there is no checkpoint)"
            arrays = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(state))
            needed = f"its arrays alone take {save_faults.human_size(arrays)}"
        else:
            resume = f"checkpoint step {latest}"
            taken = sum(p.lstat().st_blocks * 512 for p in (self.directory / str(latest)).rglob("*"))
            needed = f"checkpoint step {latest} takes {save_faults.human_size(taken)}"
        return save_faults.CheckpointSaveError(
            f"cannot save checkpoint step {step} in {self.directory}: {save_faults.FULL[number].lower()} "
            f"({free} free there; {needed}). Make room there, then run the same command again "
            f"to resume from {resume}.",
            number,
        )

    def verify(self, step: int) -> None:
        """Raise DamagedCheckpointError unless checkpoint `step`'s files match its checksums.

        A checkpoint without checksums.json (the process died between Orbax's commit and the
        manifest) passes: Orbax committed it whole, so only later damage would go unseen.
        """
        step_dir = self.directory / str(step)
        if not step_dir.is_dir():
            raise CheckpointError(
                f"there is no checkpoint step {step} in {self.directory}; its steps are {self.all_steps()}."
            )
        manifest = step_dir / MANIFEST
        if not manifest.exists():
            logging.warning(
                "checkpoint step %d in %s has no %s; restoring it unverified.", step, self.directory, MANIFEST
            )
            return
        try:
            expected = json.loads(manifest.read_text())
        except ValueError as e:
            raise DamagedCheckpointError(
                f"checkpoint step {step} in {self.directory} is damaged: {MANIFEST} is unreadable ({e})."
            ) from None
        found = _file_hashes(step_dir)
        missing = sorted(set(expected) - set(found))
        changed = sorted(name for name in set(expected) & set(found) if expected[name] != found[name])
        if missing or changed:
            what = "; ".join(
                filter(
                    None,
                    [
                        missing and f"missing files {missing}",
                        changed and f"files whose bytes changed {changed}",
                    ],
                )
            )
            raise DamagedCheckpointError(f"checkpoint step {step} in {self.directory} is damaged: {what}.")

    def restore(self, target, step: int | None = None):
        """Verify and restore checkpoint `step` (default: latest) into the structure, shapes
        and shardings of `target`. Raises CheckpointError (DamagedCheckpointError for bytes
        that changed) with the step and the cause; CheckpointMismatchError for a checkpoint whose
        arrays or their names (after `RENAMED_KEYS`) are not the target's."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"there is no checkpoint in {self.directory}.")
        self.verify(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        # Before any read, metadata included: a failed read of damaged bytes leaves reports too.
        _silence_failed_restore_aftermath()
        # A checkpoint of another model is named before any array is read: a read that fails
        # part way leaves TensorStore reads behind that report themselves at exit.
        try:
            fits = _fits(abstract, self._saved_tree(step))
        except Exception:  # unreadable metadata: the restore below says what is wrong
            fits = True
        if not fits:
            raise CheckpointMismatchError(self._mismatch_message(step))
        try:
            return self._restore_renamed(step, abstract)
        except Exception as e:  # orbax raises many types; the user needs the step and the cause
            cause = _root_cause(e)
            try:
                saved = self._saved_tree(step)
                fits = _fits(abstract, saved)
            except Exception:  # unreadable metadata: the checkpoint, not the config, is at fault
                fits = True
            if not fits:
                raise CheckpointMismatchError(self._mismatch_message(step)) from e
            raise DamagedCheckpointError(
                f"checkpoint step {step} in {self.directory} cannot be read: {cause}"
            ) from e

    def _mismatch_message(self, step: int) -> str:
        return (
            f"cannot restore checkpoint step {step} from {self.directory}: its arrays do not "
            f"have the names and shapes of this model and optimizer; it was written by a "
            f"different config."
        )

    def _saved_tree(self, step: int):
        """Checkpoint `step`'s saved tree of array metadata, as nested dicts and lists."""
        metadata = self._manager.item_metadata(step)
        return getattr(metadata, "tree", metadata)

    def _restore_renamed(self, step: int, abstract):
        """Restore checkpoint `step` into `abstract`; if the checkpoint holds some of its arrays
        under the old names of `RENAMED_KEYS`, or one layer at a time (`STACKED_KEYS`), read them
        there and return them under the new names, stacked."""
        try:
            saved = self._saved_tree(step)
            sources = _saved_paths(abstract, saved)
        except Exception:  # unreadable metadata: let the restore itself report what is wrong
            sources = None
        targets = _paths_and_leaves(abstract)
        new_paths = [path for path, _ in targets]
        if sources is None or sources == new_paths:
            return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        renamed = sorted(
            {
                (n, o)
                for new, source in zip(new_paths, sources)
                if not _is_per_layer(source)
                for n, o in zip(new, source)
                if n != o
            }
        )
        stacked = sorted({"/".join(new) for new, source in zip(new_paths, sources) if _is_per_layer(source)})
        logging.info(
            "checkpoint step %d in %s predates %s; restoring it into this model's layout.",
            step,
            self.directory,
            " and ".join(
                filter(
                    None,
                    [
                        renamed and "renames " + ", ".join(f"{o!r} -> {n!r}" for n, o in renamed),
                        stacked and f"stacked layers ({len(stacked)} arrays saved one layer at a time)",
                    ],
                )
            ),
        )
        by_saved_path = {}
        for source, (_, leaf) in zip(sources, targets):
            if _is_per_layer(source):
                by_saved_path.update({path: _one_layer(leaf) for path in source})
            else:
                by_saved_path[source] = leaf
        # The restore target in the saved tree's own layout, each array with the target's shape,
        # dtype and sharding; the result goes back into the target's structure path by path.
        saved_target = jax.tree_util.tree_map_with_path(
            lambda path, _: by_saved_path[tuple(map(_key_name, path))], saved
        )
        restored = dict(
            _paths_and_leaves(self._manager.restore(step, args=ocp.args.StandardRestore(saved_target)))
        )

        def assemble(source, leaf):
            if not _is_per_layer(source):
                return restored[source]
            layers = jax.numpy.stack([restored[path] for path in source])
            sharding = getattr(leaf, "sharding", None)
            return layers if sharding is None else jax.device_put(layers, sharding)

        return jax.tree.structure(abstract).unflatten(
            [assemble(source, leaf) for source, (_, leaf) in zip(sources, targets)]
        )

    def metadata(self, step: int):
        """The saved tree of checkpoint `step` with each array's shape and dtype (no data read)."""
        return self._manager.item_metadata(step)

    def custom_metadata(self, step: int) -> dict:
        """The CUSTOM_METADATA entry saved with checkpoint `step` ({} when it has none)."""
        return dict(self._manager.metadata(step).custom_metadata or {})

    def set_aside(self, step: int) -> pathlib.Path:
        """Move checkpoint `step` out of the checkpoint directory (into damaged_checkpoints/
        beside it), so a later save of the same step is not skipped; return where it went."""
        destination = self.directory.parent / DAMAGED_DIR / str(step)
        if jax.process_index() == 0:  # every process found it damaged; one moves it
            if destination.exists():
                shutil.rmtree(destination)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(self.directory / str(step), destination)
        processes.barrier(f"set_aside/{step}")
        self._manager.reload()
        return destination

    def close(self) -> None:
        """Release the manager's resources."""
        self._manager.close()


def _config_mismatch(checkpointer, step, workdir, config) -> str | None:
    """The message for a checkpoint written under another config, or None if the workdir's
    config.json is absent, unreadable or the same as `config`."""
    path = pathlib.Path(workdir).expanduser() / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    current = json.loads(config.to_json_best_effort())
    differences = config_differences(saved, current)
    if not differences:
        return None
    # A checkpoint that does not fit is explained by the model's keys, where some differ; the
    # others (num_steps, the learning rate) may change on a resume.
    differences = model_change.model_changes(saved, current) or differences
    return (
        f"cannot restore checkpoint step {step} from {checkpointer.directory}: it was "
        f"written by the run configured in {path}, and this config differs in "
        f"{'; '.join(differences)}. Resume with that run's config, or train this one in "
        f"another workdir."
    )


def restore_newest_intact(checkpointer: Checkpointer, target, workdir, config):
    """Resume a trainer in `workdir` with `config`: (state, step) of the newest checkpoint that
    verifies and restores, or (target, 0) when there is none.

    A damaged checkpoint is moved to damaged_checkpoints/ with a warning naming it and the
    step resumed from. A checkpoint that does not fit `config` while the workdir's config.json
    differs raises a CheckpointError naming the keys that differ; if every checkpoint is
    unusable, one CheckpointError lists them.
    """
    problems = []
    for step in reversed(checkpointer.all_steps()):
        try:
            state = checkpointer.restore(target, step)
        except DamagedCheckpointError as e:
            problems.append(str(e))
            moved = checkpointer.set_aside(step)
            logging.warning("%s Moved it to %s; trying the previous checkpoint.", e, moved)
            continue
        except CheckpointMismatchError as e:
            mismatch = _config_mismatch(checkpointer, step, workdir, config)
            if mismatch is not None:
                raise CheckpointMismatchError(mismatch) from e.__cause__
            raise
        if problems:
            logging.warning(
                "resuming from checkpoint step %d, the newest intact one in %s.", step, checkpointer.directory
            )
        return state, step
    if problems:
        raise CheckpointError(
            f"no intact checkpoint in {checkpointer.directory}: {' '.join(problems)} The damaged "
            f"ones were moved to {checkpointer.directory.parent / DAMAGED_DIR}; re-running starts "
            f"from step 0."
        )
    return target, 0
