"""JAX's coordination service in a process of its own, started by process 0 of a run
(processes.join): when process 0's program dies (SIGKILL, a crash, out of memory) the service
lives on, so the other processes learn it from the missing heartbeat and end naming process 0,
instead of being aborted by JAX the moment the service goes.

  python -m experiments.training.coordinator PORT NUM_PROCESSES HEARTBEAT SHUTDOWN PARENT_PID

It ignores SIGINT and SIGTERM (a Ctrl-C in the terminal reaches the whole process group: the
run stops through process 0), prints one line once it listens, and ends `linger` seconds after
its parent is gone: at once if its parent wrote a line to its stdin first (process 0 ending on
purpose, after the others), and process 0 kills it at a normal exit. Its pid is in
`pid_file(port)`: gRPC lets a second server listen on a port already taken (SO_REUSEPORT), so
the next run's process 0 ends a service still lingering there before it starts its own
(`end_lingering`), or the two runs' processes would meet in either.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import tempfile
import threading
import time

READY = "coordination service listening"
STOP = signal.SIGUSR1  # what ends it at once (it ignores SIGINT and SIGTERM)


def pid_file(port: int) -> pathlib.Path:
    return pathlib.Path(tempfile.gettempdir()) / f"linear_transformers-coordinator-{port}.pid"


def end_lingering(port: int, wait_seconds: float = 5.0) -> None:
    """End the service a previous run left on `port` on this host, if one is there (its pid file
    names a live process of this module; without /proc nothing is ended)."""
    path = pid_file(port)
    try:
        pid = int(path.read_text())
        words = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return
    if b"experiments.training.coordinator" not in words:
        return  # the pid is another process's now
    stop(pid, wait_seconds)


def stop(pid: int, wait_seconds: float = 5.0) -> None:
    """End service `pid`, not a child of this process (STOP: it removes its pid file), SIGKILL
    if it has not within the time."""
    for signum in (STOP, signal.SIGKILL):
        try:
            os.kill(pid, signum)
        except OSError:
            return
        deadline = time.monotonic() + wait_seconds / 2
        while pathlib.Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def serve(port: int, num_processes: int, heartbeat: int, shutdown: int, parent: int, linger: float) -> None:
    # The service JAX's distributed.initialize starts in process 0, from jaxlib's extension
    # alone: process 0 waits for this process to listen, and importing jax would add ~1.3 s.
    try:
        from jaxlib import _jax
    except ImportError:  # a jaxlib laid out otherwise: jax knows where it is
        from jax._src.lib import _jax

    try:
        service = _jax.get_distributed_runtime_service(
            f"[::]:{port}", num_processes, heartbeat_timeout=heartbeat, shutdown_timeout=shutdown
        )
    except Exception as e:  # the port is taken (a previous run's service still lingering)
        print(f"cannot listen on port {port}: {str(e).splitlines()[0] if str(e) else e}", flush=True)
        os._exit(1)
    pid_file(port).write_text(str(os.getpid()))
    signal.signal(STOP, lambda signum, frame: _leave(port))
    print(READY, flush=True)
    told = threading.Event()  # process 0 wrote a line: it ends on purpose, the others know
    threading.Thread(target=lambda: sys.stdin.readline() and told.set(), daemon=True).start()
    while os.getppid() == parent:
        time.sleep(0.1)
    if not told.wait(0.5):
        time.sleep(linger)  # the other processes notice process 0 is gone, then end
    del service
    _leave(port)


def _leave(port: int) -> None:
    try:
        if pid_file(port).read_text() == str(os.getpid()):
            pid_file(port).unlink()
    except OSError:
        pass
    os._exit(0)


if __name__ == "__main__":
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    port, count, heartbeat, shutdown, parent = map(int, sys.argv[1:6])
    serve(port, count, heartbeat, shutdown, parent, linger=float(sys.argv[6]))
