"""A running (unwindowed) aggregate per key: SQL's ``GROUP BY`` without a window.

Nexmark q4 averages the final prices of each category's auctions over the whole
stream: an aggregation with no window, whose result changes with every input.
``window_aggregate`` and ``session_window`` produce a result when a window closes;
this produces the key's result so far with every record, so the **last** record of a
key is its current answer (as Flink's updating result of an unwindowed ``GROUP BY`` is
its last row per key).

Use it from a spec as ``code: {name: "millwheel.nexmark.running:RunningAggregate",
params: {aggregation: mean, field: price}}``. Each record's number is its JSON value or
the value's ``field``; the result is JSON ``{"key", "agg", "value", "count"}`` stamped
with the record's timestamp (so it is never behind the input watermark). State per key
is JSON ``[count, sum, min, max]``; it is never expired (the aggregate is over the
whole stream), so keys should be few (q4's are the five categories).
"""

from __future__ import annotations

import json
from typing import Any

from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.record import Record, Timer

AGGREGATIONS = ("count", "sum", "min", "max", "mean")


class RunningAggregate(Computation):
    """Per key, ``aggregation`` over every record so far, produced with each record."""

    def __init__(self, *, aggregation: str = "count", field: str | None = None, output: str | None = None) -> None:
        if aggregation not in AGGREGATIONS:
            raise InvalidSpecError(f"running aggregate: aggregation {aggregation!r} not one of {AGGREGATIONS}")
        self.aggregation = aggregation
        self.field = field
        self.output = output

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        if self.output is None:
            if not outputs:
                raise InvalidSpecError("running aggregate needs an output stream")
            self.output = outputs[0]

    def _number(self, record: Record) -> float | int:
        value: Any = json.loads(record.value)
        if self.field is not None:
            value = value[self.field]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"record {record.record_id}: not a number: {value!r}")
        return value

    def process_record(self, ctx: Context, record: Record) -> None:
        state: list[Any] = json.loads(ctx.state) if ctx.state else [0, 0, None, None]
        count, total, low, high = state
        if self.aggregation != "count":
            x = self._number(record)
            total += x
            low = x if low is None else min(low, x)
            high = x if high is None else max(high, x)
        count += 1
        ctx.set_state(json.dumps([count, total, low, high]).encode())
        value: Any = {"count": count, "sum": total, "min": low, "max": high}.get(self.aggregation)
        if self.aggregation == "mean":
            value = total / count
        assert self.output is not None
        result = {"key": ctx.key, "agg": self.aggregation, "value": value, "count": count}
        ctx.produce(self.output, ctx.key, json.dumps(result).encode(), record.timestamp)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        """No timers: a running aggregate is produced with each record."""
