"""One training run per workdir: an exclusive lock held for the whole run.

The lock is `fcntl.flock` on `workdir/run.lock`, which the kernel releases when the holding
process ends however it ends (SIGKILL and crashes included), so a lock left by a dead run never
blocks the next one. The file records the holder's pid, host and start time, for the message
the next run shows while the holder is alive. Unix only; the workdir must be on a file system
that supports flock (local disks and NFS do).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import pathlib
import socket

LOCK_FILE = "run.lock"


class WorkdirInUseError(RuntimeError):
    """Another live process holds the workdir's lock."""


class WorkdirLock:
    """Context manager: hold `workdir/run.lock` exclusively, or raise WorkdirInUseError."""

    def __init__(self, workdir):
        self.path = pathlib.Path(workdir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkdirInUseError(
                f"workdir {self.path.parent} is in use by another training run "
                f"({self._holder()}); wait for it to finish or stop it, or use another "
                f"workdir."
            ) from None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd

    def _holder(self) -> str:
        try:
            holder = json.loads(self.path.read_text())
            return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
