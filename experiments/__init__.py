"""Entry points, tasks, training and benchmarks built on linear_transformers."""

import gc
import os

# jaxlib 0.10.2's XLA:CPU hands fused reductions to YNNPACK, which there gives nondeterministic
# results, whole batches of NaN at times (a 2-layer "linear" CausalLM called eagerly on one
# batch of 64: 1 call in 8; tests/models/test_cpu_determinism.py), and runs a multiply-reduce
# 20-40x slower when an operand has a size-1 axis (jax-ml/jax#37465). Every entry point imports
# this package before JAX starts its CPU backend, so they run with those fusions off, unless
# XLA_FLAGS already chooses.
YNN_REDUCE_OFF = "--xla_cpu_experimental_ynn_fusion_type=-reduce"


def default_xla_flag(flag_and_value: str) -> None:
    """Add `--flag=value` to XLA_FLAGS unless XLA_FLAGS already names the flag. It takes effect
    in this process only before JAX starts its backend, and in the processes it starts."""
    flag = flag_and_value.split("=", 1)[0]
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag_and_value}".strip()


default_xla_flag(YNN_REDUCE_OFF)

# Tracing and lowering a step allocate millions of short-lived Python objects. At Python's
# default threshold (700 allocations) the collector runs thousands of times a compile, and about
# one run in a hundred walks every object the imports made (JAX, Flax, Orbax). Every 10,000: the
# copy task's smoke run took about 8% less CPU (6.6-6.8 s against 7.2 s, the 2-core CPU VM);
# 200,000 was no faster, and the peak memory did not change. A higher threshold set before this
# import is kept, as is 0 (no automatic collection).
YOUNGEST_GENERATION_THRESHOLD = 10_000
if 0 < gc.get_threshold()[0] < YOUNGEST_GENERATION_THRESHOLD:
    gc.set_threshold(YOUNGEST_GENERATION_THRESHOLD, *gc.get_threshold()[1:])

HOST_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def with_host_devices(count: int, xla_flags: str | None = None) -> str:
    """XLA_FLAGS for a process with `count` CPU host devices: `xla_flags` (this process's
    XLA_FLAGS when None) with any device count it names replaced and its other flags kept."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    kept = [f for f in flags.split() if not f.startswith(HOST_DEVICE_COUNT)]
    return " ".join([*kept, f"{HOST_DEVICE_COUNT}={count}"])
