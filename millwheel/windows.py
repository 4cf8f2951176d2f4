"""Event-time window assignment: tumbling and sliding windows, in microseconds.

A window is ``[start, start + size)``. Its result is stamped ``end - 1`` (the last
timestamp it can hold), and its end-of-window timer is set at that same time, so the
timer's watermark hold keeps the result from ever being late downstream.

It is used by the built-in ``window_aggregate`` (:mod:`millwheel.operators`) and by the
Spark stage and backfill (:mod:`millwheel.spark`), so it sits below both packages: the
operators package registers the Spark stage, and the Spark stage reaching back into
the operators package for its windows was an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from millwheel.errors import InvalidSpecError


@dataclass(frozen=True)
class Windowing:
    size_us: int
    period_us: int | None = None  # None: tumbling; else sliding every period_us

    def __post_init__(self) -> None:
        if self.size_us <= 0:
            raise InvalidSpecError(f"window size_us must be > 0, got {self.size_us}")
        if self.period_us is not None and not 0 < self.period_us <= self.size_us:
            raise InvalidSpecError(
                f"window period_us must be in (0, size_us={self.size_us}], got {self.period_us}"
            )

    @property
    def step(self) -> int:
        return self.period_us or self.size_us

    def assign(self, timestamp: int) -> list[int]:
        """Start times of every window containing ``timestamp``, oldest first."""
        if self.period_us is None:  # tumbling: exactly one
            return [timestamp - timestamp % self.size_us]
        step = self.step
        last = timestamp - timestamp % step
        starts = []
        start = last
        while start > timestamp - self.size_us:
            starts.append(start)
            start -= step
        starts.reverse()
        return starts

    def end(self, start: int) -> int:
        return start + self.size_us
