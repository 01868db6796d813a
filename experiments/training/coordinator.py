"""JAX's coordination service in a process of its own, started by process 0 of a run
(processes.join): when process 0's program dies (SIGKILL, a crash, out of memory) the service
lives on, so the other processes learn it from the missing heartbeat and end naming process 0,
instead of being aborted by JAX the moment the service goes.

  python -m experiments.training.coordinator PORT NUM_PROCESSES HEARTBEAT SHUTDOWN PARENT_PID

It ignores SIGINT and SIGTERM (a Ctrl-C in the terminal reaches the whole process group: the
run stops through process 0), prints one line once it listens, and ends `linger` seconds after
its parent is gone (process 0 ends it at once at a normal exit).
"""

from __future__ import annotations

import os
import signal
import sys
import time

READY = "coordination service listening"


def serve(port: int, num_processes: int, heartbeat: int, shutdown: int, parent: int, linger: float) -> None:
    from jax._src.lib import _jax  # the service JAX's distributed.initialize starts in process 0

    try:
        service = _jax.get_distributed_runtime_service(
            f"[::]:{port}", num_processes, heartbeat_timeout=heartbeat, shutdown_timeout=shutdown
        )
    except Exception as e:  # the port is taken (a previous run's service still lingering)
        print(f"cannot listen on port {port}: {str(e).splitlines()[0] if str(e) else e}", flush=True)
        os._exit(1)
    print(READY, flush=True)
    while os.getppid() == parent:
        time.sleep(0.25)
    time.sleep(linger)  # the other processes notice process 0 is gone, then end
    del service
    os._exit(0)


if __name__ == "__main__":
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    port, count, heartbeat, shutdown, parent = map(int, sys.argv[1:6])
    serve(port, count, heartbeat, shutdown, parent, linger=float(sys.argv[6]))
