"""User code of tests/integration/test_watermark_why.py (``--allow-code
tests.integration.watermark_why_code``): one class per cause that holds a watermark.

Workers import it by name, so it holds only what they run (no test, no fixture).
"""

from __future__ import annotations

from millwheel.computation import Computation, Context
from millwheel.record import Record, Timer
from tests.support.misbehaving_code import PassThrough

HOUR_US = 3_600_000_000
DOWN_MESSAGE = "the reminder service is down"
BROKEN_MESSAGE = "cannot reach the fraud model"
REFUSED_MESSAGE = "the ledger refuses every record"


class Forward(PassThrough):
    """Every record to ``output``, unchanged (defined here: the workers run only classes
    defined in an allowed module)."""


class CannotBuild(Computation):
    """Raises when constructed: its key ranges are failing (stage ``build``)."""

    def __init__(self, **params: object) -> None:
        raise RuntimeError(BROKEN_MESSAGE)

    def process_record(self, ctx: Context, record: Record) -> None:  # pragma: no cover
        raise AssertionError("never built")

    def process_timer(self, ctx: Context, timer: Timer) -> None:  # pragma: no cover
        raise AssertionError("never built")


class RefusesEveryRecord(Computation):
    """Raises on every record (under ``on_error: fail`` each batch is retried, so the
    records wait in their sender's outbox)."""

    def process_record(self, ctx: Context, record: Record) -> None:
        raise ConnectionError(REFUSED_MESSAGE)

    def process_timer(self, ctx: Context, timer: Timer) -> None:  # pragma: no cover
        pass


class RemindAnHourLater(Computation):
    """Sets an event-time timer (tag ``remind``) an hour after each record; firing it
    raises (under ``on_error: fail`` it is retried, pending, holding the watermark)."""

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.set_timer("remind", record.timestamp + HOUR_US)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        raise ConnectionError(DOWN_MESSAGE)
