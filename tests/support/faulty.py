"""User code that fails on some records or timers, for the error-policy tests.

Loaded by import path (``tests.support.faulty:Doubler``) in local and service runs.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from millwheel.computation import Computation, Context
from millwheel.record import Record, Timer


class Doubler(Computation):
    """Produces ``{"doubled": 2 * amount}`` per record to its first output; raises on an
    ``amount`` that is not a number, unless ``fixed_flag`` names a file that exists
    (the user's fix: such amounts then count as 0)."""

    def __init__(self, fixed_flag: str | None = None, output: str = "doubled") -> None:
        self.fixed_flag = Path(fixed_flag) if fixed_flag else None
        self.output = output

    def process_record(self, ctx: Context, record: Record) -> None:
        amount = json.loads(record.value)["amount"]
        try:
            number = float(amount)
        except ValueError:
            if self.fixed_flag is None or not self.fixed_flag.exists():
                raise
            number = 0.0
        ctx.produce(self.output, ctx.key, json.dumps({"doubled": 2 * number}).encode(), record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        pass


class Flaky(Doubler):
    """A Doubler whose first ``failures`` runs of each record in ``flaky_ids`` raise
    (a transient error: a retry succeeds). Counts runs in this process."""

    runs: Counter[str] = Counter()

    def __init__(self, flaky_ids: list[str], failures: int, output: str = "doubled") -> None:
        super().__init__(None, output)
        self.flaky_ids = set(flaky_ids)
        self.failures = failures

    def process_record(self, ctx: Context, record: Record) -> None:
        if record.record_id in self.flaky_ids:
            Flaky.runs[record.record_id] += 1
            if Flaky.runs[record.record_id] <= self.failures:
                raise ConnectionError(f"transient failure #{Flaky.runs[record.record_id]}")
        super().process_record(ctx, record)


class TimerPerRecord(Computation):
    """Sets an event-time timer per record (tag = the record's ID); firing produces
    ``fired:TAG``, except that it raises for keys in ``bad_keys``."""

    def __init__(self, bad_keys: list[str], output: str = "fired") -> None:
        self.bad_keys = set(bad_keys)
        self.output = output

    def process_record(self, ctx: Context, record: Record) -> None:
        ctx.set_timer(record.record_id, record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        if ctx.key in self.bad_keys:
            raise RuntimeError(f"timer {timer.tag} of a bad key")
        ctx.produce(self.output, ctx.key, f"fired:{timer.tag}".encode(), timer.time)
