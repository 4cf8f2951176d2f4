"""The in-memory index of one key range's durable timers.

The store holds the timers (changed only through checkpoints); this queue answers
"which timers are due" and "what is the oldest event time a pending timer holds the
output watermark at" without scanning. Heaps use lazy deletion: an entry is valid
only while the timer map still holds that exact timer.
"""

from __future__ import annotations

import heapq
from typing import Iterable

from millwheel.record import MAX_TIMESTAMP, TimeDomain, Timer

_Entry = tuple[int, str, str]


class TimerQueue:
    def __init__(self, timers: Iterable[Timer] = ()) -> None:
        self._timers: dict[tuple[str, str], Timer] = {}
        self._event: list[_Entry] = []
        self._processing: list[_Entry] = []
        self._holds: list[_Entry] = []
        for timer in timers:
            self.set(timer)

    def __len__(self) -> int:
        return len(self._timers)

    def get(self, key: str, tag: str) -> Timer | None:
        return self._timers.get((key, tag))

    def set(self, timer: Timer) -> None:
        self._timers[(timer.key, timer.tag)] = timer
        entry = (timer.time, timer.key, timer.tag)
        if timer.domain is TimeDomain.EVENT:
            heapq.heappush(self._event, entry)
            if timer.hold:
                heapq.heappush(self._holds, entry)
        else:
            heapq.heappush(self._processing, entry)

    def clear(self, key: str, tag: str) -> None:
        self._timers.pop((key, tag), None)

    def _valid(self, entry: _Entry, domain: TimeDomain, hold: bool = False) -> bool:
        timer = self._timers.get((entry[1], entry[2]))
        return (
            timer is not None
            and timer.time == entry[0]
            and timer.domain is domain
            and (timer.hold or not hold)
        )

    def _pop_due(self, heap: list[_Entry], domain: TimeDomain, due: int, strict: bool) -> Timer | None:
        while heap:
            entry = heap[0]
            if not self._valid(entry, domain):
                heapq.heappop(heap)
                continue
            if entry[0] < due or (not strict and entry[0] == due):
                heapq.heappop(heap)
                return self._timers.pop((entry[1], entry[2]))
            return None
        return None

    def pop_due_event(self, input_watermark: int) -> Timer | None:
        """The earliest event-time timer with ``time < input_watermark``, removed."""
        return self._pop_due(self._event, TimeDomain.EVENT, input_watermark, strict=True)

    def pop_due_processing(self, now_us: int) -> Timer | None:
        """The earliest processing-time timer with ``time <= now_us``, removed."""
        return self._pop_due(self._processing, TimeDomain.PROCESSING, now_us, strict=False)

    def hold(self) -> int:
        """The oldest event time at which a pending timer holds the output watermark."""
        heap = self._holds
        while heap and not self._valid(heap[0], TimeDomain.EVENT, hold=True):
            heapq.heappop(heap)
        return heap[0][0] if heap else MAX_TIMESTAMP

    def holding(self) -> Timer | None:
        """The pending timer at :meth:`hold` (the earliest that holds the watermark,
        the least key and tag among equals); None when none holds it."""
        if self.hold() == MAX_TIMESTAMP:
            return None
        _time, key, tag = self._holds[0]
        return self._timers[(key, tag)]

    def pending(self) -> list[Timer]:
        return sorted(self._timers.values(), key=lambda t: (t.time, t.key, t.tag))
