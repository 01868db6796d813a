"""Timing and memory measurement shared by the benchmarks.

Times are wall-clock seconds of an already compiled function, synchronised with
`jax.block_until_ready`, after one warm-up call; the median of the repeats is reported. Memory is
XLA's own figure for the compiled program (arguments, outputs and temporaries from
`memory_analysis()`), which is exact, deterministic, available before running,
and the same on CPU and GPU, unlike process RSS.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import platform
import statistics
import time

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class CaseOptions:
    """How every case is measured (the benchmarks' options extend it).

    min_repeats: Time each case at least this often.
    min_seconds: Repeat each case for at least this long.
    memory_fraction: Fraction of the device's free memory a case may use (one that needs more
        is skipped).
    seed: Seed of the random inputs and untrained weights.
    """

    min_repeats: int = 3
    min_seconds: float = 0.5
    memory_fraction: float = 0.6
    seed: int = 0

    def budget_bytes(self) -> int:
        """What one case may use on the default device (`memory_budget_bytes`)."""
        return memory_budget_bytes(fraction=self.memory_fraction)


def check_known(what: str, values, known) -> None:
    """A ValueError for the first of `values` (an option's) that is not in `known`."""
    for value in values:
        if value not in known:
            raise ValueError(f"unknown {what} {value!r}; expected some of {tuple(known)}.")


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    repeats: int


def time_compiled(
    compiled, *args, min_repeats: int = 3, max_repeats: int = 50, min_seconds: float = 0.5
) -> Timing:
    """Median wall time of `compiled(*args)`; repeats until `min_repeats` and `min_seconds`.

    A call whose warm-up takes over 2 * min_seconds (and over a second) is timed once more only:
    seconds-long calls vary little, and repeating them would dominate a benchmark's run time.
    """
    return time_call(
        lambda: jax.block_until_ready(compiled(*args)),
        min_repeats=min_repeats,
        max_repeats=max_repeats,
        min_seconds=min_seconds,
    )


def time_call(call, *, min_repeats: int = 3, max_repeats: int = 50, min_seconds: float = 0.5) -> Timing:
    """`time_compiled` for any synchronous `call()` (one that returns when its work is done,
    e.g. torch on the CPU)."""
    if min_repeats < 1 or max_repeats < min_repeats:
        raise ValueError(
            f"time_call: need 1 <= min_repeats <= max_repeats, got {min_repeats}, {max_repeats}."
        )
    start = time.perf_counter()
    call()  # first call: allocation, autotuning, caches
    if time.perf_counter() - start > max(2 * min_seconds, 1.0):
        min_repeats = 1
    times = []
    while len(times) < min_repeats or (sum(times) < min_seconds and len(times) < max_repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), min(times), len(times))


def interleaved_times(calls: dict, *, rounds: int) -> dict[str, list[float]]:
    """Seconds of each call in each of `rounds` rounds, the calls in turn, each run twice in a
    row and the second run timed. `calls`: name -> synchronous call.

    For ratios between calls on a machine whose speed drifts (a shared VM): two medians timed
    minutes apart move with the drift, and so does their ratio; times seconds apart share it
    (`median_ratio`). The untimed run absorbs what the call before left behind: on the 2-core
    CPU a call right after the delta rule's scan (gigabytes allocated and freed) took twice as
    long as the same call repeated."""
    if rounds < 1:
        raise ValueError(f"interleaved_times: rounds must be >= 1, got {rounds}.")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            call()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def median_ratio(times: dict[str, list[float]], name: str, baseline: str) -> float:
    """The median over rounds of `name`'s time over `baseline`'s in the same round
    (`interleaved_times`)."""
    for key in (name, baseline):
        if key not in times:
            raise ValueError(f"median_ratio: {key!r} was not timed; timed: {sorted(times)}.")
    return statistics.median(a / b for a, b in zip(times[name], times[baseline], strict=True))


def peak_bytes(compiled) -> int | None:
    """Bytes XLA reserves for one call of a compiled function, or None if the backend is silent.

    arguments + outputs + temporaries - aliased: the temporaries figure is XLA's buffer
    assignment, which already reuses dead buffers. (`peak_memory_in_bytes` leaves the
    temporaries out on the CPU backend of jax 0.10, so it is only used when it is larger.)
    """
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    total = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes
    )
    return int(max(total, getattr(analysis, "peak_memory_in_bytes", 0)))


def fit_and_time(
    row: dict, compiled, args, budget: int, opts: CaseOptions, *, skip_reason=None, devices=None
) -> Timing | None:
    """Record `compiled`'s peak memory (row["peak_mib"]) and time it on `args()` (made only when
    timed; row["repeats"]; opts' min_repeats and min_seconds), unless it needs more than `budget`
    bytes (on all `devices` together, when given) or `skip_reason` says why not: then
    row["status"] says so and None is returned."""
    peak = peak_bytes(compiled)
    row["peak_mib"] = math.nan if peak is None else peak / 2**20
    needs = (peak or 0) * (devices or 1)
    if needs > budget:
        where = f" on {devices} devices" if devices else ""
        row["status"] = f"skipped: needs {needs / 2**30:.1f} GiB{where}, budget {budget / 2**30:.1f} GiB"
        return None
    if skip_reason:
        row["status"] = skip_reason
        return None
    timing = time_compiled(compiled, *args(), min_repeats=opts.min_repeats, min_seconds=opts.min_seconds)
    row["repeats"] = timing.repeats
    return timing


def memory_budget_bytes(device=None, fraction: float = 0.6) -> int:
    """What one benchmark case may use: `fraction` of the device's free memory.

    GPU/TPU: the allocator's limit minus what is in use; CPU: MemAvailable from /proc/meminfo
    (or physical pages when that file does not exist).
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = _host_available_bytes()
    return int(free * fraction)


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine_description(device=None) -> dict:
    """Device, versions and host, recorded beside every result."""
    import flax

    device = device or jax.devices()[0]
    return {
        "device": f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "num_devices": jax.device_count(),
        "host_cpus": os.cpu_count(),
        "machine": platform.machine(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "flax": flax.__version__,
        "numpy": np.__version__,
    }


def _jaxlib_version() -> str:
    # jaxlib is installed with jax (not imported here: it is jax's dependency, not ours).
    return importlib.metadata.version("jaxlib")


def matmul_flops_per_second(m: int, k: int, n: int, dtype="float32", *, seed: int = 0) -> float:
    """Measured throughput of one [m, k] x [k, n] matmul on the default device (FLOP/s)."""
    key_a, key_b = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(key_a, (m, k), dtype)
    b = jax.random.normal(key_b, (k, n), dtype)
    compiled = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
    timing = time_compiled(compiled, a, b, min_seconds=0.3)
    return 2.0 * m * k * n / timing.median_s
