"""What a checkpoint save does when it fails: a full disk is one `CheckpointSaveError` (errno
ENOSPC or EDQUOT) naming the directory and the space, and Orbax's writer threads' own reports
of the failure (each thread fails and logs a traceback, some after the save has raised) are
held back, so the failure is said once, by the save."""

from __future__ import annotations

import contextlib
import errno
import logging as std_logging
import os
import threading


class CheckpointSaveError(OSError):
    """A checkpoint that could not be written for want of disk space (errno ENOSPC or EDQUOT)."""

    def __init__(self, message: str, errno_: int):
        super().__init__(message)  # one argument: str() is the message, without "[Errno n]"
        self.errno = errno_


FULL = {errno.ENOSPC: os.strerror(errno.ENOSPC), errno.EDQUOT: os.strerror(errno.EDQUOT)}


def disk_full_errno(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT if `error` or an exception behind it says the disk is full, else None.
    TensorStore (Orbax's array writer) raises ValueError("RESOURCE_EXHAUSTED: ... No space left
    on device"): only its text carries the errno."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in FULL:
            return error.errno
        for number, text in FULL.items():
            if text in str(error):
                return number
        error = error.__cause__ or error.__context__
    return None


def human_size(num_bytes: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "bytes" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024


def _is_writer_thread_report(record: std_logging.LogRecord) -> bool:
    """Orbax's report of one of its writer threads failing (with a traceback); the same
    exception reaches the thread that waits on the save."""
    return "orbax" in record.pathname and "raised an exception" in record.getMessage()


class _WriterReports(std_logging.Filter):
    """The filter on absl's logger that holds back Orbax's writer threads' reports of their
    failures during a save (`writer_failures_reported_once`)."""

    def __init__(self):
        super().__init__()
        self.held: list | None = None  # a list while a save runs
        self.failed = False  # a save failed: its threads' late reports are dropped

    def filter(self, record) -> bool:
        if not _is_writer_thread_report(record):
            return True
        if self.held is not None:
            self.held.append(record)
            return False
        return not self.failed


_writer_reports = _WriterReports()


@contextlib.contextmanager
def writer_failures_reported_once():
    """Inside: Orbax's writer threads' own reports of their failures are held back. When the
    save fails, the failure is raised once, by the save: the reports are dropped, then and from
    any thread still failing after (the threads of one save fail one after the other, some
    after the save has raised), and the threads started by the save are waited for, so they
    are not still writing into the directory removed next. When it succeeds, any report held
    is logged as usual."""
    absl_logger = std_logging.getLogger("absl")
    if _writer_reports not in absl_logger.filters:
        absl_logger.addFilter(_writer_reports)
    before = set(threading.enumerate())
    _writer_reports.held = []
    failed = False
    try:
        yield
    except BaseException:
        failed = _writer_reports.failed = True
        for thread in set(threading.enumerate()) - before:
            if type(thread).__module__.startswith("orbax"):  # not an idle pool's workers
                thread.join(timeout=10)
        raise
    finally:
        held, _writer_reports.held = _writer_reports.held, None
        if not failed:
            for record in held:
                absl_logger.handle(record)
