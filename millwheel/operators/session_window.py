"""Built-in session windows: per key, records closer than ``gap_us`` form one session.

Behaviour a user can rely on (the conventions of ``window_aggregate``):
* a session is ``[first timestamp, last timestamp + gap_us)``; two records of a key are
  in one session when their ``[t, t + gap_us)`` spans overlap (chains included);
* its result is produced once the input watermark passes its end, stamped ``end - 1``,
  as JSON ``{"key", "start", "end", "agg", "value", "count"}``, with the aggregations
  of ``window_aggregate`` (count, sum, min, max, mean of the value or its ``field``);
* with ``allowed_lateness_us`` > 0 a session is kept that much past its end. A late
  record that falls inside a produced session gives a corrected result at once; one
  that widens it, or bridges two sessions (which then merge into one), gives the
  result of the new, wider session: at once if the watermark is already past its end,
  else when it passes. A result supersedes every earlier result of the same key whose
  ``[start, end)`` lies within its own: keep, per key, the widest;
* a record more than ``allowed_lateness_us`` behind the input watermark is not counted
  (the computation's late-data policy drops or routes it before; under ``process`` it
  is skipped here, as ``window_aggregate`` skips a window closed for good).

State (readable through GetState) is JSON ``{"start": [end, count, sum, min, max,
fired]}``; timers are ``end:START`` at ``end - 1`` and, under lateness, ``gc:START``
at ``end - 1 + allowed_lateness_us`` (no watermark hold), all through the
computation's context, so checkpoints cover them and a restarted range resumes exactly.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from millwheel import jsonvalue
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.operators.aggregate import AGGREGATIONS, record_number
from millwheel.operators.outputs import default_output
from millwheel.record import MAX_TIMESTAMP, Record, Timer

_END, _COUNT, _SUM, _MIN, _MAX, _FIRED = range(6)


def _at_most(t: int) -> int:
    """A timer or output time no later than the largest event time (a session's end
    plus lateness may lie past it; such a time is reached only by a finished source)."""
    return min(t, MAX_TIMESTAMP - 1)


class SessionWindow(Computation):
    def __init__(
        self,
        *,
        gap_us: int,
        aggregation: str = "count",
        field: str | None = None,
        output: str | None = None,
        allowed_lateness_us: int = 0,
    ) -> None:
        if aggregation not in AGGREGATIONS:
            raise InvalidSpecError(f"session_window: aggregation {aggregation!r} not one of {AGGREGATIONS}")
        if int(gap_us) <= 0:
            raise InvalidSpecError(f"session_window: gap_us must be > 0, got {gap_us}")
        self.gap_us = int(gap_us)
        self.aggregation = aggregation
        self.field = field
        self.output = output
        self.allowed_lateness_us = int(allowed_lateness_us)

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        self.output = default_output("session_window", self.output, outputs)

    def _number(self, record: Record) -> float:
        return record_number(record, self.aggregation, self.field, "session_window")

    def process_record(self, ctx: Context, record: Record) -> None:
        self.process_records(ctx, (record,))

    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        """The key's sessions are decoded once per batch, updated by each record in
        arrival order (merging where a record bridges them), and encoded once."""
        sessions = _load(ctx.state)
        watermark = ctx.input_watermark
        for record in records:
            t = record.timestamp
            if t + self.allowed_lateness_us < watermark:
                continue  # behind the watermark by more than the lateness: closed for good
            self._add(ctx, sessions, t, self._number(record), watermark)
        _store(ctx, sessions)

    def _add(self, ctx: Context, sessions: dict[str, list[Any]], t: int, x: float, watermark: int) -> None:
        start, end = t, t + self.gap_us
        count, total, lo, hi = 1, x, x, x
        fired = False
        merged: list[str] = []
        for start_s, s in sessions.items():
            if int(start_s) < end and t < s[_END]:  # [t, t+gap) overlaps [start, end)
                merged.append(start_s)
        old_bounds = None
        if len(merged) == 1:
            s = sessions[merged[0]]
            old_bounds = (int(merged[0]), s[_END])
        for start_s in merged:
            s = sessions.pop(start_s)
            start, end = min(start, int(start_s)), max(end, s[_END])
            count += s[_COUNT]
            total += s[_SUM]
            lo, hi = min(lo, s[_MIN]), max(hi, s[_MAX])
            fired = fired or s[_FIRED]
        new = [end, count, total, lo, hi, False]
        sessions[str(start)] = new
        if fired and old_bounds == (start, end):  # inside a produced session: correct it now
            new[_FIRED] = True
            self._emit(ctx, start, new)
            return
        for start_s in merged:  # the sessions merged away take their timers with them
            if int(start_s) != start:
                ctx.clear_timer(f"end:{start_s}")
                if self.allowed_lateness_us:
                    ctx.clear_timer(f"gc:{start_s}")
        if fired and end - 1 < watermark:  # a produced session widened, its end passed
            new[_FIRED] = True
            ctx.clear_timer(f"end:{start}")
            self._emit(ctx, start, new)
        else:
            ctx.set_timer(f"end:{start}", _at_most(end - 1))
        if self.allowed_lateness_us:
            ctx.set_timer(f"gc:{start}", _at_most(end - 1 + self.allowed_lateness_us), hold=False)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        kind, _, start_s = timer.tag.partition(":")
        sessions = _load(ctx.state)
        s = sessions.get(start_s)
        if s is None:
            return
        if kind == "end":
            if not s[_FIRED]:
                self._emit(ctx, int(start_s), s)
                s[_FIRED] = True
            if not self.allowed_lateness_us:
                del sessions[start_s]
        elif kind == "gc":
            del sessions[start_s]
        _store(ctx, sessions)

    def _emit(self, ctx: Context, start: int, s: list[Any]) -> None:
        count, total, lo, hi = s[_COUNT], s[_SUM], s[_MIN], s[_MAX]
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
        end = s[_END]
        payload = {"key": ctx.key, "start": start, "end": end, "agg": self.aggregation,
                   "value": value, "count": count}
        assert self.output is not None
        ctx.produce(self.output, ctx.key, json.dumps(payload).encode(), _at_most(end - 1))


def _load(state: bytes | None) -> dict[str, list[Any]]:
    return jsonvalue.loads(state) if state else {}


def _store(ctx: Context, sessions: dict[str, list[Any]]) -> None:
    ctx.set_state(json.dumps(sessions, separators=(",", ":")).encode() if sessions else None)
