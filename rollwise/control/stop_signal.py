"""SIGTERM stops a command the way Ctrl-C does: by unwinding, so every `finally` runs.

A batch scheduler's preemption, `kill`, `timeout` and container runtimes all send SIGTERM. Python's
default for it ends the process on the spot: no `finally`, no `atexit`. Then the trainer's rank
processes lose their controller mid-collective (and print a screen of tracebacks), a vLLM engine's
weights directory (hundreds of MB under /tmp) stays behind, and sandboxes and reward workers are
left to notice on their own. Raised as a KeyboardInterrupt, SIGTERM takes the path Ctrl-C already
takes through the training loop: placement.close() stops engines, ranks and workers in order.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Stopped(KeyboardInterrupt):
    """The process was asked to stop by a signal other than Ctrl-C (SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for "ended by signal N"


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    # A second SIGTERM while cleaning up ends the process at once, as a user sending it twice expects.
    signal.signal(signum, signal.SIG_DFL)
    raise Stopped(signum)


def stop_on_sigterm() -> bool:
    """Make SIGTERM raise `Stopped` in the main thread; False (nothing changed) off the main thread,
    where Python refuses signal handlers, or where SIGTERM is already handled or ignored."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:  # an embedding program's own choice stands
        return False
    signal.signal(signal.SIGTERM, _raise_stopped)
    return True
