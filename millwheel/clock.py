"""Injectable clocks: the runtime never reads wall time directly.

Processing-time timers, record-ID retention and latency sensors all ask a
:class:`Clock`, so tests drive time with :class:`ManualClock` instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_us(self) -> int:
        """Current processing time in integer microseconds since the epoch."""
        ...


class SystemClock:
    """Wall-clock time."""

    def now_us(self) -> int:
        return time.time_ns() // 1000


class ManualClock:
    """A clock that only moves when a test tells it to."""

    def __init__(self, start_us: int = 0) -> None:
        self._now = start_us

    def now_us(self) -> int:
        return self._now

    def advance(self, delta_us: int) -> None:
        if delta_us < 0:
            raise ValueError("a clock does not go backwards")
        self._now += delta_us

    def set(self, now_us: int) -> None:
        if now_us < self._now:
            raise ValueError("a clock does not go backwards")
        self._now = now_us
