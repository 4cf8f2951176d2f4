"""Bounded in-memory time series for the console (the last 15 minutes per series).

Each series is a ring (:class:`collections.deque` with ``maxlen``): memory is fixed
per series whatever the uptime, and series of names no longer registered are dropped
by :meth:`History.keep`, so neither time nor churn grows the controller.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Iterable

WINDOW_S = 15 * 60


class History:
    def __init__(self, interval_s: float, window_s: float = WINDOW_S) -> None:
        self.size = max(2, int(window_s / interval_s) + 1)
        self._series: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def add(self, kind: str, owner: str, t: float, value: float) -> None:
        series = (kind, owner)
        with self._lock:
            ring = self._series.get(series)
            if ring is None:
                ring = self._series[series] = deque(maxlen=self.size)
            ring.append((round(t, 3), value))

    def get(self, kind: str, owner: str) -> list[tuple[float, float]]:
        with self._lock:
            return list(self._series.get((kind, owner), ()))

    def keep(self, owners: Iterable[str]) -> None:
        """Drop every series of an owner (a computation, injector or worker) not listed."""
        alive = set(owners)
        with self._lock:
            for name in [n for n in self._series if n[1] not in alive]:
                del self._series[name]

    def names(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._series)
