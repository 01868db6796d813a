"""SIGINT and SIGTERM stop training at a step boundary, after a checkpoint of that step.

Python raises KeyboardInterrupt wherever the main thread happens to be when the signal lands:
often while it waits on a step whose update has already been dispatched, so the state in hand
and the step counter no longer agree. Inside `deferred_signals()` the first SIGINT or SIGTERM
only sets a flag; the training loop checks it between steps, saves, and raises `Interrupted`.
A second SIGINT raises KeyboardInterrupt at once, for when the user really means "now".

A checkpoint save is the exception: inside `completing_save()` signals are held until the save
has finished (a save cut short leaves Orbax's writer threads failing one by one, hundreds of
lines of tracebacks, and a half-written directory that a save in hand would race with). A
second SIGINT held there then stops the run with `Interrupted`, the checkpoint complete.
"""

from __future__ import annotations

import contextlib
import signal
import threading

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Training stopped on `signum` after saving checkpoint `step`; re-running resumes there."""

    def __init__(self, signum: int, step: int, directory):
        self.signum, self.step, self.directory = signum, step, directory
        super().__init__(
            f"{signal.Signals(signum).name} received: stopped after step {step} "
            f"with a checkpoint of it in {directory}; run the same command again "
            f"to resume."
        )


class SignalFlag:
    """The first SIGINT/SIGTERM received inside `deferred_signals()` (None: none yet), and
    whether a second SIGINT stops at once."""

    def __init__(self, signum: int | None = None, *, stop_at_once: bool = True):
        self.signum, self.stop_at_once = signum, stop_at_once

    @property
    def received(self) -> bool:
        return self.signum is not None


_flags: list[SignalFlag] = []  # the flags of the deferred_signals() blocks now open, innermost last


@contextlib.contextmanager
def deferred_signals(*, stop_at_once: bool = True):
    """Yield a SignalFlag that records SIGINT/SIGTERM instead of letting them raise.

    Inside another such block the flag starts with the outer one's signal. `stop_at_once=False`
    (a run of several processes, which must stop at the same step) makes a second SIGINT only
    recorded too. Handlers can only be installed from the main thread; elsewhere the flag stays
    unset and signals keep their usual effect. The previous handlers are restored on exit.
    """
    outer = _flags[-1] if _flags else None
    flag = SignalFlag(
        outer.signum if outer else None, stop_at_once=stop_at_once and (outer is None or outer.stop_at_once)
    )
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handle(signum, frame):
        if flag.received and signum == signal.SIGINT and flag.stop_at_once:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        flag.signum = flag.signum or signum

    previous = {s: signal.signal(s, handle) for s in HANDLED}
    _flags.append(flag)
    try:
        yield flag
    finally:
        _flags.remove(flag)
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def completing_save(step: int, directory):
    """Run the save of checkpoint `step` (in `directory`) to its end whatever signals arrive.

    SIGINT and SIGTERM received meanwhile are held. Once the save has finished: inside
    `deferred_signals()`, a second SIGINT (the flag already set, or two held) raises
    `Interrupted` (the checkpoint of `step` is complete: re-running resumes from it), a first
    one sets the flag as usual; outside it, each is raised again with the handlers of the
    caller (a KeyboardInterrupt for SIGINT). A save that fails raises its own error; the signals
    held are then only recorded in the flag.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in HANDLED}
    try:
        yield
        completed = True
    except BaseException:
        completed = False
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        flag = _flags[-1] if _flags else None
        for signum in held:
            if flag is None:
                if completed:
                    signal.raise_signal(signum)
            elif completed and flag.received and signum == signal.SIGINT and flag.stop_at_once:
                raise Interrupted(signum, step, directory)
            else:
                flag.signum = flag.signum or signum
