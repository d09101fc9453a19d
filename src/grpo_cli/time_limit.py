"""A time limit on a user's Python code (a reward function, a tool) run in this process."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class TimeLimitExceeded(BaseException):
    """Raised inside the code under `time_limit` once its seconds have passed. A BaseException,
    so that the code's own `except Exception` does not swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise TimeLimitExceeded in the code running within, once `seconds` have passed (SIGALRM:
    the main thread only; elsewhere, and for 0 or None, no limit). Python code is stopped
    wherever it is, a sleep or a blocking read included; a C loop that never returns to Python
    is not."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeLimitExceeded

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
