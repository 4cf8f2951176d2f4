"""Which of a worker's watermark reports go with a heartbeat.

The controller writes each report to the store (one write transaction each, taking the
single writer's turn from checkpoints), and under load heartbeats go every 25 ms: a
range is reported when its watermark moved, when its outbox emptied or became
non-empty, when its pending count changed and the last report is ``REPORT_PENDING_S``
old, and at least every ``refresh`` (``REPORT_REFRESH_S``, longer when so many ranges
are owned that refreshing each every second would be thousands of store writes a
second: ``REFRESH_RANGES_PER_S``)."""

from __future__ import annotations

REPORT_REFRESH_S = 1.0  # an unchanged range is reported again after this long
REPORT_PENDING_S = 0.25  # a changed pending count (display only) waits this long
# Unchanged ranges are re-reported at most this many per second (each is a store write on
# the controller): with thousands of idle ranges the refresh stretches past REPORT_REFRESH_S.
REFRESH_RANGES_PER_S = 500


def report_due(last: tuple[int, int, float] | None, wm: int, pending: int, now: float,
               refresh: float = REPORT_REFRESH_S) -> bool:
    """Whether a range whose last report was ``last`` (watermark, pending, when; None:
    never) is reported now with watermark ``wm`` and ``pending`` outbox entries."""
    if last is None or last[0] != wm or now - last[2] >= refresh:
        return True
    if last[1] != pending:
        return (last[1] == 0) != (pending == 0) or now - last[2] >= REPORT_PENDING_S
    return False
