"""What the command-line entry points share: a user's mistake ends in one line, not a trace.

`main` functions are wrapped with `one_line_errors`: an error the user can fix (a bad config
value, a missing file, a busy workdir, a damaged checkpoint) prints `<program>: error: <what is
wrong and what to do>` as the last line and exits 1; an interrupted run prints where it stopped
and exits 128 + the signal's number, as a shell does (130 for a Ctrl-C that stopped it at
once). `--verbosity=1` (or higher) re-raises instead, for the full traceback.
"""

from __future__ import annotations

import functools
import os
import pathlib
import signal
import sys

from absl import flags, logging
from ml_collections import config_flags

from experiments.training import interrupts
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
            sys.exit(128 + signal.SIGINT)
        except USER_ERRORS as e:
            if verbose:
                raise
            message = " ".join(str(e).split()) or type(e).__name__
            print(f"{_program()}: error: {message}", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapped


def check_config_file(flag_name: str = "config") -> None:
    """A --config file that does not exist: a FileNotFoundError naming it and the choices.

    ml_collections only reports it, in several lines, when the config is first read."""
    path = config_flags.get_config_filename(flags.FLAGS[flag_name]).split(":", 1)[0]
    if path and not os.path.isfile(path):
        configs = pathlib.Path("configs")
        choices = (
            sorted(p.name for p in configs.glob("*.py") if "def get_config" in p.read_text())
            if configs.is_dir()
            else []
        )
        raise FileNotFoundError(
            f"config file {path!r} (--{flag_name}) does not exist"
            + (f"; the configs are configs/{{{','.join(choices)}}}" if choices else "")
            + "."
        )
