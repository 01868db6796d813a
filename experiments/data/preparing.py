"""One process at a time prepares a data set in a data directory.

TFDS writes a data set into a temporary folder and renames it into place. Processes sharing the
directory (a run's processes on one host, or on hosts sharing a file system) that all find the
data set unprepared would each prepare it, and every one but the first fails on its rename with
FileExistsError. Held around the check and the preparation, `one_at_a_time` makes the first
prepare it and the others, once it is done, find it prepared.
"""

from __future__ import annotations

import contextlib
import os

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no lock, one process per data directory
    fcntl = None


@contextlib.contextmanager
def one_at_a_time(data_dir: os.PathLike | str, name: str):
    """An exclusive lock on `name` in `data_dir` while the block runs: a process waits for
    another preparing the same data set there (`flock` on `<data_dir>/.<name>.lock`; the kernel
    releases it when a holder dies, so a killed process never leaves it held)."""
    if fcntl is None:
        yield
        return
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, f".{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
