"""Built-in windowed aggregation: count, sum, min, max, mean per key per window.

Behaviour a user can rely on:
* a window's result is produced once the input watermark passes its end, stamped
  ``end - 1``, as JSON ``{"key", "start", "end", "agg", "value", "count"}``;
* with ``allowed_lateness_us`` > 0 the window is kept that much longer: a late
  record updates it and a corrected result is produced at once; after that the
  computation's late-data policy applies;
* numeric input is the JSON value itself, or its ``field`` when given.
"""

from __future__ import annotations

import json
from math import isfinite
from typing import Any, Iterable

from millwheel import jsonvalue
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.operators.outputs import default_output
from millwheel.record import Record, Timer
from millwheel.windows import Windowing

AGGREGATIONS = ("count", "sum", "min", "max", "mean")
MAX_DECODED_KEYS = 200_000  # keys whose decoded windows are kept (then the cache restarts)



def record_number(record: Record, aggregation: str, field: str | None, operator: str) -> float:
    """The number a record adds to an aggregation (0 for ``count``): its JSON value, or
    that value's ``field``; a record without one fails with a message naming it."""
    if aggregation == "count":
        return 0.0
    try:
        value: Any = jsonvalue.loads(record.value)
        if field is not None:
            value = value[field]
        return float(value)
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidSpecError(
            f"{operator}: record {record.record_id} value is not a number"
            f"{' at field ' + repr(field) if field else ''}: {exc}"
        ) from None

class WindowedAggregate(Computation):
    def __init__(
        self,
        *,
        size_us: int,
        period_us: int | None = None,
        aggregation: str = "count",
        field: str | None = None,
        output: str | None = None,
        allowed_lateness_us: int = 0,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise InvalidSpecError(
                f"window_aggregate: aggregation {aggregation!r} not one of {AGGREGATIONS}"
            )
        self.windowing = Windowing(int(size_us), int(period_us) if period_us else None)
        self.aggregation = aggregation
        self.field = field
        self.output = output
        self.allowed_lateness_us = int(allowed_lateness_us)
        # key -> (the state bytes this operator last wrote, its windows decoded): when
        # ctx.state is that very object the JSON is not decoded again. Identity, not
        # equality: a state reloaded from the store (after a rollback, a restart or a
        # cache eviction) is a new object and is decoded.
        self._decoded: dict[str, tuple[bytes, dict[str, list[Any]]]] = {}

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        self.output = default_output("window_aggregate", self.output, outputs)

    def _number(self, record: Record) -> float:
        return record_number(record, self.aggregation, self.field, "window_aggregate")

    def process_record(self, ctx: Context, record: Record) -> None:
        self.process_records(ctx, (record,))

    def _windows(self, ctx: Context) -> dict[str, list[Any]]:
        """The key's windows, to be changed and then passed to :meth:`_store`. Taken out
        of the decoded cache, so an exception between the two leaves no stale entry."""
        state = ctx.state
        cached = self._decoded.pop(ctx.key, None)
        if cached is not None and state is cached[0]:
            return cached[1]
        return _load(state)

    def _store(self, ctx: Context, windows: dict[str, list[Any]]) -> None:
        if not windows:
            ctx.set_state(None)
            return
        state = _dump(windows)
        ctx.set_state(state)
        if len(self._decoded) >= MAX_DECODED_KEYS:
            self._decoded.clear()
        self._decoded[ctx.key] = (state, windows)

    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        """The per-key batch hook: the key's windows are decoded once (or not at all:
        see ``_decoded``), updated by every record in order, and encoded once."""
        windows = self._windows(ctx)
        windowing = self.windowing
        size = windowing.size_us
        lateness = self.allowed_lateness_us
        watermark = ctx.input_watermark
        counting = self.aggregation == "count"
        timestamps = getattr(records, "timestamps", None)
        if counting and not lateness and windowing.period_us is None and timestamps is not None:
            # Tumbling count without lateness: nothing is produced per record (a window
            # already fired is gone), so whole-batch counting over the timestamps.
            self._count(ctx, windows, timestamps(), size, watermark)
            return
        for record in records:
            x = 0.0 if counting else self._number(record)
            changed_fired: list[str] = []
            for start in windowing.assign(record.timestamp):
                start_s = str(start)
                acc = windows.get(start_s)
                if acc is None:
                    acc = self._open(ctx, windows, start, x, watermark)
                    if acc is None:
                        continue
                acc[0] += 1
                if not counting:
                    acc[1] += x
                    acc[2] = min(acc[2], x)
                    acc[3] = max(acc[3], x)
                if acc[4]:
                    changed_fired.append(start_s)
            for start_s in changed_fired:  # a late record updated a window already produced
                self._emit(ctx, int(start_s), windows[start_s])
        self._store(ctx, windows)

    def _open(self, ctx: Context, windows: dict[str, list[Any]], start: int, x: float,
              watermark: int) -> list[Any] | None:
        """A new window from ``start`` with its timers (end, and gc under lateness), or
        None when it closed for good (the lateness policy let its record through: skip)."""
        end = start + self.windowing.size_us
        if end - 1 + self.allowed_lateness_us < watermark:
            return None
        acc = windows[str(start)] = [0, 0.0, x, x, False]
        ctx.set_timer(f"end:{start}", end - 1)
        if self.allowed_lateness_us:
            ctx.set_timer(f"gc:{start}", end - 1 + self.allowed_lateness_us, hold=False)
        return acc

    def _count(self, ctx: Context, windows: dict[str, list[Any]], timestamps: list[int], size: int,
               watermark: int) -> None:
        """What the per-record loop does for a tumbling count without lateness."""
        per_start: dict[int, int] = {}
        for ts in timestamps:
            start = ts - ts % size
            per_start[start] = per_start.get(start, 0) + 1
        for start, n in per_start.items():
            start_s = str(start)
            acc = windows.get(start_s)
            if acc is None:
                acc = self._open(ctx, windows, start, 0.0, watermark)
                if acc is None:
                    continue
            acc[0] += n
        self._store(ctx, windows)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        kind, _, start_s = timer.tag.partition(":")
        windows = self._windows(ctx)
        acc = windows.get(start_s)
        if acc is None:  # unchanged: nothing written, back in the decoded cache
            state = ctx.state
            if state is not None:
                self._decoded[ctx.key] = (state, windows)
            return
        if kind == "end":
            self._emit(ctx, int(start_s), acc)
            acc[4] = True
            if not self.allowed_lateness_us:
                del windows[start_s]
        elif kind == "gc":
            del windows[start_s]
        self._store(ctx, windows)

    def _emit(self, ctx: Context, start: int, acc: list[Any]) -> None:
        value, timestamp = self._result(ctx.key, start, acc)
        assert self.output is not None
        ctx.produce(self.output, ctx.key, value, timestamp)

    def _result(self, key: str, start: int, acc: list[Any]) -> tuple[bytes, int]:
        """A window's result (the JSON value) and its timestamp ``end - 1``."""
        count, total, lo, hi = acc[0], acc[1], acc[2], acc[3]
        value: float | int
        if self.aggregation == "count":
            value = count
        elif self.aggregation == "sum":
            value = total
        elif self.aggregation == "min":
            value = lo
        elif self.aggregation == "max":
            value = hi
        else:
            value = total / count
        end = self.windowing.end(start)
        payload = {
            "key": key, "start": start, "end": end,
            "agg": self.aggregation, "value": value, "count": count,
        }
        return json.dumps(payload).encode(), end - 1

    def unfired_results(self, key: str, state: bytes | None) -> list[tuple[int, bytes, int]]:
        """``(start, value, timestamp)`` of each of ``key``'s windows whose result was not
        produced yet, as its end timer would produce it now: from the records the window
        holds so far (an early, partial result when its end is still ahead of the
        watermark). What ``millwheel update --on-open-windows flush`` emits before the
        windows' parameters change (services/controller/flush.py)."""
        windows = _load(state)
        return [(int(s), *self._result(key, int(s), acc)) for s, acc in windows.items() if not acc[4]]


_DECODER = json.JSONDecoder()
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _load(state: bytes | None) -> dict[str, list[Any]]:
    return _DECODER.decode(state.decode()) if state else {}


def _dump(windows: dict[str, list[Any]]) -> bytes:
    """Compact JSON ``{"start": [count, sum, min, max, fired]}``, readable through
    GetState. Written by hand (the same bytes ``json.dumps`` gives, a third of its
    time: it runs once per key per batch) unless a value is not a finite float."""
    parts = []
    for start_s, (count, total, lo, hi, fired) in windows.items():
        if (not (isfinite(total) and isfinite(lo) and isfinite(hi))
                or type(count) is not int or type(fired) is not bool):
            return _ENCODER.encode(windows).encode()
        parts.append(f'"{start_s}":[{count!r},{total!r},{lo!r},{hi!r},{"true" if fired else "false"}]')
    return ("{" + ",".join(parts) + "}").encode()
