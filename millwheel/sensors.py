"""Sensor hooks the core calls; exporters (Prometheus, tests, the demo) implement them.

The core never imports a metrics library: it calls these hooks, and
``services/metrics.py`` turns them into Prometheus series.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol


class Sensors(Protocol):
    def records_in(self, computation: str, count: int) -> None: ...
    def records_out(self, computation: str, count: int) -> None: ...
    def duplicates_dropped(self, computation: str, count: int) -> None: ...
    def late_records(self, computation: str, count: int, action: str, input: str = "") -> None:
        """``count`` records behind the input watermark on input stream ``input`` ("" if
        not known): ``action`` is what became of them, the late_policy's name (process,
        drop, route; see :mod:`millwheel.late`)."""
        ...
    def checkpoint(self, computation: str, seconds: float, records: int) -> None: ...
    def fenced(self, computation: str, range_id: int) -> None: ...
    def watermark(self, node: str, watermark: int, lag_us: int) -> None: ...
    def spark_job(self, computation: str, outcome: str, seconds: float, windows: int) -> None:
        """A Spark stage job ended: outcome is "ok", "retry" or "failed"."""
        ...


class NullSensors:
    def records_in(self, computation: str, count: int) -> None:
        pass

    def records_out(self, computation: str, count: int) -> None:
        pass

    def duplicates_dropped(self, computation: str, count: int) -> None:
        pass

    def late_records(self, computation: str, count: int, action: str, input: str = "") -> None:
        pass

    def checkpoint(self, computation: str, seconds: float, records: int) -> None:
        pass

    def fenced(self, computation: str, range_id: int) -> None:
        pass

    def watermark(self, node: str, watermark: int, lag_us: int) -> None:
        pass

    def spark_job(self, computation: str, outcome: str, seconds: float, windows: int) -> None:
        pass


class CountingSensors(NullSensors):
    """Keeps totals in memory: what the demo prints and tests assert on."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        #: (computation, input stream, action) -> late records
        self.late: Counter[tuple[str, str, str]] = Counter()
        self.watermarks: dict[str, int] = {}

    def records_in(self, computation: str, count: int) -> None:
        self.counts[f"in:{computation}"] += count

    def records_out(self, computation: str, count: int) -> None:
        self.counts[f"out:{computation}"] += count

    def duplicates_dropped(self, computation: str, count: int) -> None:
        self.counts[f"duplicates:{computation}"] += count

    def late_records(self, computation: str, count: int, action: str, input: str = "") -> None:
        self.counts[f"late_{action}:{computation}"] += count
        self.late[(computation, input, action)] += count

    def checkpoint(self, computation: str, seconds: float, records: int) -> None:
        self.counts[f"checkpoints:{computation}"] += 1

    def fenced(self, computation: str, range_id: int) -> None:
        self.counts[f"fenced:{computation}"] += 1

    def watermark(self, node: str, watermark: int, lag_us: int) -> None:
        self.watermarks[node] = watermark

    def spark_job(self, computation: str, outcome: str, seconds: float, windows: int) -> None:
        self.counts[f"spark_{outcome}:{computation}"] += 1
