"""Stopping a run on request without losing it: SIGINT (Ctrl-C) or SIGTERM (a scheduler's
preemption notice) lets the current step finish, then the loop writes a checkpoint and returns;
a second SIGINT stops at once (KeyboardInterrupt), leaving the newest complete checkpoint.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Optional

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """Context manager: while inside, the first SIGINT/SIGTERM only sets `requested` (its name)."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for number in HANDLED:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame: Optional[FrameType]) -> None:
        if self.requested is not None and number == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: the user means now
        self.requested = signal.Signals(number).name
