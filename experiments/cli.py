"""What the command-line entry points share: a user's mistake ends in one line, not a trace.

`main` functions are wrapped with `one_line_errors`: an error the user can fix (a bad config
value, a missing file, a busy workdir, a damaged checkpoint) prints `<program>: error: <what is
wrong and what to do>` as the last line and exits 1; an interrupted run prints where it stopped
and exits 128 + the signal's number, as a shell does (130 for a Ctrl-C that stopped it at
once). `--verbosity=1` (or higher) re-raises instead, for the full traceback.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import signal
import sys
import threading
import traceback

from absl import flags, logging
from ml_collections import config_flags

from experiments.training import interrupts, processes
from experiments.training.checkpoints import CheckpointError
from experiments.training.workdir_lock import WorkdirInUseError

# ImportError: an optional dependency the command needs (torch, to read a .pth file).
USER_ERRORS = (ValueError, OSError, ArithmeticError, ImportError, CheckpointError, WorkdirInUseError)


def _program() -> str:
    return os.path.basename(sys.argv[0]).removesuffix(".py") or "experiments"


def one_line_errors(main):
    """Wrap an absl `main(argv)` as described in the module docstring."""

    @functools.wraps(main)
    def wrapped(argv):
        verbose = flags.FLAGS["verbosity"].present and flags.FLAGS.verbosity >= 1
        if not flags.FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)  # Orbax logs every save and restore at INFO
        try:
            if len(argv) > 1:  # absl leaves what is not a --flag in argv; no command reads it.
                raise ValueError(
                    f"unexpected arguments {argv[1:]}: every option is a --flag (--helpshort lists them)."
                )
            return main(argv)
        except interrupts.Interrupted as e:
            print(f"{_program()}: {e}", file=sys.stderr, flush=True)
            sys.exit(128 + e.signum)
        except KeyboardInterrupt:  # before training started, or a second Ctrl-C
            if verbose:
                raise
            print(
                f"{_program()}: interrupted; re-run the same command to resume from the newest checkpoint.",
                file=sys.stderr,
                flush=True,
            )
            _exit(128 + signal.SIGINT)
        except USER_ERRORS as e:
            if verbose:
                raise
            message = " ".join(str(e).split()) or type(e).__name__
            print(f"{_program()}: error: {message}", file=sys.stderr, flush=True)
            _exit(1)
        except Exception:
            if processes.multiprocess():
                traceback.print_exc()
                _exit(1)
            raise

    return wrapped


def _exit(status: int) -> None:
    # A process of several that failed ends at once, not on JAX's shutdown barrier with peers
    # that are stopping (processes.exit_process); otherwise as usual.
    processes.exit_process(status)
    sys.exit(status)


def missing_config_file(path: str, flag_name: str = "config") -> str | None:
    """The message for a --config file `path` that does not exist, naming the configs there
    are; None when it exists (or no path was given)."""
    if not path or os.path.isfile(path):
        return None
    configs = pathlib.Path("configs")
    choices = (
        sorted(p.name for p in configs.glob("*.py") if "def get_config" in p.read_text())
        if configs.is_dir()
        else []
    )
    return (
        f"config file {path!r} (--{flag_name}) does not exist"
        + (f"; the configs are configs/{{{','.join(choices)}}}" if choices else "")
        + "."
    )


def check_config_file(flag_name: str = "config") -> None:
    """A --config file that does not exist: a FileNotFoundError naming it and the choices.

    ml_collections only reports it, in several lines, when the config is first read."""
    path = config_flags.get_config_filename(flags.FLAGS[flag_name]).split(":", 1)[0]
    message = missing_config_file(path, flag_name)
    if message:
        raise FileNotFoundError(message)


@contextlib.contextmanager
def stop_at_once_on_interrupt():
    """Inside: SIGINT or SIGTERM ends the process within moments, with one line and exit status
    128 + the signal's number, for commands that have nothing to save (sampling).

    Why not KeyboardInterrupt: Python runs a signal's handler only when the main thread is back
    in the interpreter, and a compile or a compiled sampling loop keeps it in XLA for as long as
    they take (a minute for a large model). The C-level handler still writes the signal's number
    to the wakeup fd at once; a thread waiting on it (XLA releases the GIL while it works) prints
    the line and ends the process.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch():
        data = os.read(read_fd, 1)
        if data:  # b"" once the block ends and the pipe is closed
            name = signal.Signals(data[0]).name
            print(f"{_program()}: {name} received: stopped, nothing written.", file=sys.stderr, flush=True)
            os._exit(128 + data[0])

    previous = {s: signal.signal(s, lambda signum, frame: None) for s in interrupts.HANDLED}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="interrupt-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(write_fd)
        watcher.join()
        os.close(read_fd)
