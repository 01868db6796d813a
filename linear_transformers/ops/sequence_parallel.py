"""Sequence parallelism: the time axis of [B, T, ...] arrays split over one mesh axis.

Legend: B batch, T time (this device's block inside `jax.shard_map`, the whole sequence
outside), P devices on the sequence axis.

An op that supports `sequence_axis=name` has a *local* form, run inside `jax.shard_map` where
`name` is a manual axis and each device holds its own [B, T/P, ...] block, and is callable in
the *global* view: with a mesh set by `jax.set_mesh(mesh)`, `call_over_sequence` wraps the
local form in `jax.shard_map` (time over `name`, batch over the mesh's other axes where they
divide B). Model code therefore passes `sequence_axis` through and never leaves the global view.

Under a mesh with explicit axis types, an array's type says how it is sharded; an op given
arrays whose time axis is sharded on one mesh axis uses that axis (`explicit_time_axis`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

TIME, BATCH = "time", "batch"


def _context_mesh():
    return jax.sharding.get_abstract_mesh()


def _has_axis_type(mesh, axis_type) -> bool:
    return any(t == axis_type for t in mesh.axis_types)


def is_manual(axis: str) -> bool:
    """Whether `axis` is a manual axis here, i.e. we are inside `jax.shard_map` over it."""
    mesh = _context_mesh()
    return not mesh.empty and axis in mesh.manual_axes


def axis_size(axis: str) -> int:
    """Number of devices P on mesh axis `axis` (inside `jax.shard_map` or under `jax.set_mesh`)."""
    mesh = _context_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        raise ValueError(
            f"sequence_axis={axis!r} is not an axis of the current mesh "
            f"({'none set' if mesh.empty else mesh.axis_names}); call the op inside "
            f"jax.shard_map over that axis, or under `with jax.set_mesh(mesh):`."
        )
    return mesh.shape[axis]


def check_sequence_axis(axis, length: int, *, name: str) -> int:
    """Validate `axis` for a time axis of (global) `length`; return the device count P."""
    if not isinstance(axis, str) or not axis:
        raise ValueError(f"{name}: sequence_axis must be a mesh axis name (str) or None, got {axis!r}.")
    size = axis_size(axis)
    if length % size:
        raise ValueError(
            f"{name}: the sequence length T={length} does not split evenly over "
            f"the {size} devices of mesh axis {axis!r}; pad T to a multiple of "
            f"{size} (key_lengths masks the padding)."
        )
    return size


def explicit_time_axis(x) -> str | None:
    """The mesh axis the time axis (1) of `x` is sharded on under explicit axis types, or None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or len(spec) < 2 or spec[1] is None:
        return None
    entry = spec[1]
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    if len(names) != 1:
        raise ValueError(
            f"the time axis is sharded over several mesh axes {names}; sequence "
            "parallelism splits it over one. Reshard it onto a single axis."
        )
    return names[0]


def explicit_sequence_axis(*arrays_BTx, name: str) -> str | None:
    """The one mesh axis the time axes of `arrays` are sharded on under explicit axis types (the
    axis an op called without `sequence_axis` splits over), or None when none is."""
    axes = {explicit_time_axis(x) for x in arrays_BTx if x is not None} - {None}
    if len(axes) > 1:
        raise ValueError(
            f"{name}: the time axes of the inputs are sharded on different mesh "
            f"axes {sorted(axes)}; shard them alike."
        )
    return axes.pop() if axes else None


def match_batch_sharding(tree_Bx, like_BTx):
    """Under explicit axis types, give a per-example pytree the batch sharding of `like`.

    A `lax.scan` carry must keep its type; a state made unsharded (zeros, or a user's) would
    otherwise meet updates sharded like the batch.
    """
    spec = getattr(getattr(jax.typeof(like_BTx), "sharding", None), "spec", None)
    if (
        spec is None
        or not len(spec)
        or spec[0] is None
        or not _has_axis_type(_context_mesh(), AxisType.Explicit)
    ):
        return tree_Bx
    return jax.tree.map(lambda x: jax.sharding.reshard(x, PartitionSpec(spec[0])), tree_Bx)


def device_offset(axis: str, local_length: int):
    """Global index of this device's first position: axis_index * T_local (int32, traced)."""
    return jax.lax.axis_index(axis) * local_length


def reverse_time(x_BTx, axis: str | None):
    """`x` with its time axis (1) reversed, in the global order: inside `jax.shard_map` over
    `axis` each device holds the reversed block of its mirror device (P - 1 - p); else a flip."""
    if axis is None or not is_manual(axis):
        return jnp.flip(x_BTx, axis=1)
    size = axis_size(axis)
    mirrored = jax.lax.ppermute(x_BTx, axis, [(p, size - 1 - p) for p in range(size)])
    return jnp.flip(mirrored, axis=1)


def gather_replicated(tree_x, axis: str):
    """`all_gather` over `axis` typed as the same on every device (its result is), so a value
    computed from it alone can leave `jax.shard_map` with a replicated out_spec."""
    try:
        return jax.lax.all_gather(tree_x, axis, to="invarying")
    except TypeError:  # A JAX without typed replication: the plain gather.
        return jax.lax.all_gather(tree_x, axis)


def exclusive_prefix(gathered_P, axis: str):
    """Sum over devices p < this device of an all-gathered [P, ...] pytree."""
    index = jax.lax.axis_index(axis)

    def prefix(x_P):
        before_P = jnp.arange(x_P.shape[0]) < index
        return jnp.sum(jnp.where(before_P.reshape((-1,) + (1,) * (x_P.ndim - 1)), x_P, 0), axis=0)

    return jax.tree.map(prefix, gathered_P)


def _batch_axes(mesh, axis: str, batch: int, time_array):
    """Mesh axes the batch axis is split over: the array's own (explicit), else the others'."""
    sharding = getattr(jax.typeof(time_array), "sharding", None)
    spec = getattr(sharding, "spec", None)
    explicit_batch = spec is not None and len(spec) and spec[0] is not None
    if explicit_batch and not _has_axis_type(mesh, AxisType.Auto):
        return spec[0]
    others = tuple(a for a in mesh.axis_names if a != axis and a not in mesh.manual_axes)
    if others and batch % math.prod(mesh.shape[a] for a in others) == 0:
        return others
    return None


def call_over_sequence(
    local_fn: Callable, axis: str, args: Sequence[Any], kinds: Sequence[str], out_kinds, *, batch: int
):
    """Run `local_fn(*args)` as the local form of a sequence-parallel op.

    Inside `jax.shard_map` over `axis`, calls it directly. Otherwise wraps it in `jax.shard_map`
    over the current mesh: an argument of kind TIME is [B, T, ...] (time over `axis`), BATCH is
    a per-example pytree ([B, ...]: lengths, states); `None` arguments pass through. `out_kinds`
    is the kind of each output (a pytree prefix of the outputs).
    """
    if is_manual(axis):
        return local_fn(*args)
    mesh = _context_mesh()
    time_arrays = [a for a, k in zip(args, kinds) if k == TIME and a is not None]
    batch_spec = _batch_axes(mesh, axis, batch, time_arrays[0])
    specs = {TIME: PartitionSpec(batch_spec, axis), BATCH: PartitionSpec(batch_spec)}
    present = [i for i, a in enumerate(args) if a is not None]

    def inner(*present_args):
        full = list(args)
        for i, a in zip(present, present_args):
            full[i] = a
        return local_fn(*full)

    in_specs = tuple(specs[kinds[i]] for i in present)
    out_specs = jax.tree.map(lambda k: specs[k], out_kinds)
    present_args = [args[i] for i in present]
    if _has_axis_type(mesh, AxisType.Explicit):
        # Explicit axes: every operand must already carry the sharding its spec names.
        present_args = [
            jax.tree.map(lambda x, s=s: jax.sharding.reshard(x, s), a) for a, s in zip(present_args, in_specs)
        ]
    return jax.shard_map(inner, in_specs=in_specs, out_specs=out_specs)(*present_args)


def varying_axes(*trees) -> frozenset:
    """The manual mesh axes (inside `shard_map`) any array of `trees` varies over."""
    axes = frozenset()
    for x in jax.tree.leaves(trees):
        axes |= jax.typeof(x).manual_axis_type.varying
    return axes


def vary(tree, axes: frozenset):
    """`tree` marked as varying over `axes`: a loop's carry must keep one type, and what the
    loop writes into it varies wherever its inputs do."""

    def mark(x):
        missing = axes - jax.typeof(x).manual_axis_type.varying
        return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

    return jax.tree.map(mark, tree)


def vary_like(tree, *like):
    """`vary(tree, varying_axes(*like))`; outside `shard_map`, `tree` unchanged."""
    return vary(tree, varying_axes(*like))
