"""User code of the console tests (``--allow-code tests.integration.ui_console_code``):
a computation with two outputs of different rates, one failing transiently (retried),
and one whose code cannot be built.

Workers import it by name, so it holds only what they run (no test, no fixture).
"""

from __future__ import annotations

import json

from millwheel.computation import Computation, Context
from millwheel.record import Record, Timer


class Split(Computation):
    """Every record to ``all``; every ``every``-th (by its JSON ``n``) also to ``some``:
    two outputs whose rates differ, as the console must show them."""

    def __init__(self, every: int = 4) -> None:
        self.every = int(every)

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.produce("all", record.key, record.value, record.timestamp)
        if json.loads(record.value)["n"] % self.every == 0:
            ctx.produce("some", record.key, record.value, record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        pass


class Flaky(Computation):
    """Forwards every record; the first run of every ``every``-th (by its JSON ``n``)
    raises, a retry succeeds (a transient error: the batch is rolled back and run again,
    which the console used to count as input twice)."""

    def __init__(self, every: int = 25) -> None:
        self.every = int(every)
        self.failed: set[str] = set()

    def process_record(self, ctx: Context, record: Record) -> None:
        if json.loads(record.value)["n"] % self.every == 0 and record.record_id not in self.failed:
            self.failed.add(record.record_id)
            raise ConnectionError("the feature store timed out (transient)")
        ctx.produce("flaky_out", record.key, record.value, record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        pass


class Broken(Computation):
    """Cannot be built: its key ranges are failing (stage ``build``)."""

    def __init__(self, **params: object) -> None:
        raise RuntimeError("cannot reach the feature store")

    def process_record(self, ctx: Context, record: Record) -> None:  # pragma: no cover
        raise AssertionError("never built")

    def process_timer(self, ctx: Context, timer: Timer) -> None:  # pragma: no cover
        raise AssertionError("never built")
