"""A thread that sends signals to this process while the trainer waits on a step in flight:
how the resume tests deliver SIGINT / SIGTERM at the worst moment, for any task."""

import os
import sys
import threading
import time

from experiments.training import trainer

# Where the trainer waits on a step in flight (it reads step s's finite flag while s + 1 runs).
_WAIT_FUNCTION, _WAIT_LINE = "verify", 'if not bool(metrics["finite"]):'


class SignalWhileWaiting(threading.Thread):
    """Sends `signals` to this process once the main thread, past step `after`, is blocked on
    the metrics of the step in flight (its _WAIT_FUNCTION frame in the trainer sits on
    _WAIT_LINE)."""

    def __init__(self, signals, after, counter):
        super().__init__(daemon=True)
        self.signals, self.after, self.counter = signals, after, counter
        self.filename = trainer.__file__
        self.sent_at_step = None
        self.stop = False

    def _waiting(self) -> bool:
        frame = sys._current_frames().get(threading.main_thread().ident)
        while frame is not None:
            if frame.f_code.co_name == _WAIT_FUNCTION and frame.f_code.co_filename == self.filename:
                import linecache

                return _WAIT_LINE in linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            frame = frame.f_back
        return False

    def run(self):
        while not self.stop:
            if len(self.counter) >= self.after and self._waiting():
                self.sent_at_step = len(self.counter)
                for signum in self.signals:
                    os.kill(os.getpid(), signum)
                    time.sleep(0.02)  # two signals sent at once could be handled as one
                return
            time.sleep(0.0005)
