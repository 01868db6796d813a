"""The device mesh of a training run, from `config.mesh` (both trainers use it).

A 2-D mesh with axes ("data", "sequence") and automatic (GSPMD) axis types:

  data      the batch is split over it (data parallelism); parameters and optimizer state are
            replicated, gradients are averaged by the partitioner.
  sequence  the time axis of every [B, T, ...] batch array is split over it (sequence
            parallelism). The model is built with `TransformerConfig(sequence_axis="sequence")`:
            its attention ops wrap themselves in `jax.shard_map` over this axis (LASP-2 for the
            linear kinds, gathered keys/values for softmax); everything else in the model is
            per position, so the partitioner keeps it split over time.

`config.mesh.data=-1` means "the devices left over": data = device_count / sequence.

Legend: B batch, T time.
"""

from __future__ import annotations

import hashlib
import math
import pathlib

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

DATA, SEQUENCE = "data", "sequence"
AXES = (DATA, SEQUENCE)


_announced = False


def backend_line() -> str:
    """The backend and devices JAX runs on, in one line ("JAX backend: gpu, 1 device (NVIDIA
    H100 80GB HBM3); jax 0.11.2"), with the process where there are several."""
    devices = jax.local_devices()
    kinds = ", ".join(dict.fromkeys(d.device_kind for d in devices))
    count = f"{len(devices)} device{'s' if len(devices) != 1 else ''}"
    if jax.process_count() > 1:
        count += f" of {jax.device_count()}, process {jax.process_index()} of {jax.process_count()}"
    return f"JAX backend: {jax.default_backend()}, {count} ({kinds}); jax {jax.__version__}"


def announce_backend() -> None:
    """Print `backend_line()` once per process: every command's first lines say where it runs
    (a CPU-only jaxlib on a GPU machine then shows at once). After `jax.distributed` is joined:
    asking for the devices starts the backend."""
    global _announced
    if not _announced:
        print(backend_line(), flush=True)
        _announced = True


def use_compilation_cache(directory: str) -> str | None:
    """Keep compiled programs in `directory` (JAX's persistent compilation cache), so that the
    next run of the same programs (a resumed run, another run of one model) loads them instead
    of compiling: the first training step's compile, tens of seconds on a GPU, is paid once per
    machine. A directory JAX was already given (JAX_COMPILATION_CACHE_DIR, or the caller's
    jax.config) is kept; "" leaves the cache off. Returns the directory in use, or None.

    With several processes JAX writes entries from process 0 alone; on CPU host devices the
    other processes' cache keys differ from its own, so they compile every program each run."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if not directory:
        return None
    # JAX bounds the cache's size only with the filelock package, which is not ours to add:
    # it grows as new programs are compiled (a few MB each); delete the directory to empty it.
    path = pathlib.Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return str(path)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_mesh_values(mesh_config) -> None:
    """`data` a positive int or -1, `sequence` a positive int, and no other key; else ValueError."""
    if not isinstance(mesh_config, (ml_collections.ConfigDict, dict)):
        raise ValueError(
            f"config.mesh must be a ConfigDict with keys {list(AXES)} (e.g. "
            f"data=-1, sequence=1), got {mesh_config!r}."
        )
    unknown = sorted(set(mesh_config) - set(AXES))
    missing = sorted(set(AXES) - set(mesh_config))
    if unknown or missing:
        raise ValueError(
            f"config.mesh keys not understood: {unknown}; missing: {missing}. "
            f"config.mesh has keys {list(AXES)}."
        )
    data, sequence = mesh_config["data"], mesh_config["sequence"]
    if not (_is_int(data) and (data >= 1 or data == -1)):
        raise ValueError(
            f"config.mesh.data must be a positive int, or -1 for the devices left "
            f"over after mesh.sequence, got {data!r}."
        )
    if not (_is_int(sequence) and sequence >= 1):
        raise ValueError(
            f"config.mesh.sequence must be a positive int (1 = no sequence parallelism), got {sequence!r}."
        )


def mesh_shape(mesh_config, device_count: int | None = None) -> tuple[int, int]:
    """(data, sequence) sizes for `device_count` devices (default: all), resolving data=-1; a
    ValueError names the values and the device count when they do not multiply to it."""
    check_mesh_values(mesh_config)
    device_count = jax.device_count() if device_count is None else device_count
    data, sequence = int(mesh_config["data"]), int(mesh_config["sequence"])
    if data == -1:
        if device_count % sequence:
            raise ValueError(
                f"config.mesh.sequence={sequence} does not divide the "
                f"{device_count} devices (config.mesh.data=-1 takes the rest); "
                f"choose a divisor of {device_count}."
            )
        data = device_count // sequence
    if data * sequence != device_count:
        raise ValueError(
            f"config.mesh data={data} x sequence={sequence} = {data * sequence} "
            f"devices, but there are {device_count}; the product must equal the "
            f"device count (set config.mesh.data=-1 to use the rest)."
        )
    return data, sequence


def make_mesh(config: ml_collections.ConfigDict, devices=None) -> jax.sharding.Mesh:
    """The ("data", "sequence") mesh of `config.mesh` over `devices` (default: all), with Auto
    axis types, so model code needs no sharding annotations."""
    devices = jax.devices() if devices is None else list(devices)
    mesh_config = config.get("mesh") or {"data": -1, "sequence": 1}
    mesh = mesh_from_shape(mesh_shape(mesh_config, len(devices)), devices)
    # Each process supplies whole rows of every batch (shard_batch), so time is split over the
    # devices of one process only.
    if any(len({d.process_index for d in row}) > 1 for row in mesh.devices):
        raise ValueError(
            f"config.mesh.sequence={mesh.shape[SEQUENCE]} splits time over devices of several "
            f"processes; it must divide the {jax.local_device_count()} devices of each process "
            f"(data parallelism spans the processes)."
        )
    return mesh


def mesh_from_shape(shape: tuple[int, int], devices=None) -> jax.sharding.Mesh:
    """A ("data", "sequence") mesh of `shape` over `devices` (default: all)."""
    devices = jax.devices() if devices is None else list(devices)
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, got {len(devices)}.")
    return jax.make_mesh(tuple(shape), AXES, devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def sequence_axis(mesh: jax.sharding.Mesh) -> str | None:
    """ "sequence" when `mesh` splits time over more than one device, else None: what the
    model's `TransformerConfig.sequence_axis` must be on this mesh."""
    return SEQUENCE if mesh.shape[SEQUENCE] > 1 else None


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Every device holds the whole array (parameters, optimizer state, scalars)."""
    return NamedSharding(mesh, PartitionSpec())


def replicate(tree, mesh: jax.sharding.Mesh):
    """`tree` (numpy or process-local JAX arrays holding the same values in every process: the
    state built from the config's seed) on every device of `mesh`.

    With several processes, one gather of a digest checks that they agree: `jax.device_put`
    would gather every leaf whole to each process to compare it (a collective per leaf, and the
    model's size times the process count through each host)."""
    sharding = replicated(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    tree = jax.tree.map(np.asarray, tree)  # on the host once: digested, then put
    multihost_utils.assert_equal(
        digest(tree),
        fail_message="the processes' replicated states differ (each builds them from the config's "
        "seed: the same code and config must give the same values)",
    )
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)


def digest(tree) -> np.ndarray:
    """A SHA-256 of `tree`'s structure and every leaf's dtype, shape and bytes, as 8 uint32."""
    sha = hashlib.sha256(str(jax.tree.structure(tree)).encode())
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        sha.update(f"{leaf.dtype}{leaf.shape}".encode())
        sha.update(np.ascontiguousarray(leaf).tobytes())
    return np.frombuffer(sha.digest(), np.uint32)


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int) -> NamedSharding:
    """How a batch array of rank `ndim` is laid out: [B] on "data", [B, T, ...] on ("data",
    "sequence"), scalars replicated."""
    if ndim == 0:
        return replicated(mesh)
    if ndim == 1:
        return NamedSharding(mesh, PartitionSpec(DATA))
    return NamedSharding(mesh, PartitionSpec(DATA, SEQUENCE))


def shard_batch(mesh: jax.sharding.Mesh, batch):
    """Lay out a global batch (a pytree of numpy arrays, batch first, time second) over `mesh`.

    Each process supplies its own rows (every column of them): with several hosts, the time
    axis must be split over devices of one host (mesh.sequence <= local devices).
    """

    def put(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.ndim)
        if x.ndim == 0:
            return jax.device_put(x, sharding)
        rows = np.array_split(x, jax.process_count())[jax.process_index()]
        return jax.make_array_from_process_local_data(sharding, rows, x.shape)

    return jax.tree.map(put, batch)
