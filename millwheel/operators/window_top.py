"""Built-in ``window_top``: per key and tumbling window, the records holding the window's
maximum, produced as they came in (Nexmark q7: the highest bids of each window).

Behaviour a user can rely on:
* windows are tumbling, ``[start, start + size_us)`` with ``start = offset_us (mod
  size_us)``; a record's number is its JSON value, or the value's ``field`` (a
  top-level key, else a dotted path such as ``bid.price``);
* once the input watermark passes a window's end, every record of the key's window
  whose number equals the window's maximum is produced, ties in arrival order, each
  with its **original value** (bytes unchanged) and the key, stamped ``end - 1``;
* with ``allowed_lateness_us`` > 0 the window is kept that much past its end. A late
  record whose number is at least the window's maximum is produced at once (stamped
  ``end - 1``): equal, it joins the window's top records; greater, it replaces them.
  So a consumer's answer for a window (key and ``end - 1``) is **the produced records
  with the greatest number**; a late record below the maximum produces nothing;
* a record in a window more than ``allowed_lateness_us`` past its end is not counted
  (the late-data policy drops or routes it before; under ``process`` it is skipped, as
  ``window_aggregate`` skips a window closed for good);
* a value that is not a number (at ``field``) is an error of that record, under the
  computation's error policy.

State is bounded by the watermark and holds no record below a window's maximum: JSON
``{"START": [max, [value, ...], fired]}`` (values as text; none once the window is
produced, when only its maximum counts), readable through GetState.
Timers are ``end:START`` at ``end - 1`` and, under lateness, ``gc:START`` at ``end - 1 +
allowed_lateness_us`` (no watermark hold), all through the computation's context, so
checkpoints cover them and a restarted range resumes exactly.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable

from millwheel import jsonvalue
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.operators.outputs import default_output
from millwheel.record import MAX_TIMESTAMP, Record, Timer

_TOP, _VALUES, _FIRED = range(3)


def window_start(t: int, size_us: int, offset_us: int) -> int:
    """The start of the tumbling window holding ``t`` (Python's ``%`` is never negative,
    so this holds for timestamps before the epoch too)."""
    return t - (t - offset_us) % size_us


def at_most(t: int) -> int:
    """A timer or output time no later than the largest event time (a window's end plus
    lateness may lie past it; such a time is reached only by a finished source)."""
    return min(t, MAX_TIMESTAMP - 1)


def at_path(value: Any, field: str) -> Any:
    """``value[field]``, or, when ``field`` is no top-level key, the dotted path in it
    (``bid.price``). KeyError or TypeError when it is not there."""
    if isinstance(value, dict) and field in value:
        return value[field]
    for part in field.split("."):
        value = value[part]
    return value


def number_at(record: Record, field: str | None, operator: str) -> int | float:
    """The number a record is ranked by, kept exact (an integer stays an integer, so
    prices past 2**53 compare exactly). Numeric text counts; booleans, NaN and
    infinities do not. A record without one fails with a message naming it."""
    try:
        value: Any = jsonvalue.loads(record.value)
        if field is not None:
            value = at_path(value, field)
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{type(value).__name__} is not a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{value} is not a finite number")
        return value
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise InvalidSpecError(
            f"{operator}: record {record.record_id} value is not a number"
            f"{' at field ' + repr(field) if field else ''}: {exc}") from None


def value_text(value: bytes) -> str:
    """A value as JSON-safe text that :func:`value_bytes` turns back into the same
    bytes, whatever they are (invalid UTF-8 rides as escaped surrogates)."""
    return value.decode("utf-8", "surrogateescape")


def value_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class WindowTop(Computation):
    def __init__(
        self,
        *,
        size_us: int,
        offset_us: int = 0,
        field: str | None = None,
        output: str | None = None,
        allowed_lateness_us: int = 0,
    ) -> None:
        if int(size_us) <= 0:
            raise InvalidSpecError(f"window_top: size_us must be > 0, got {size_us}")
        if not 0 <= int(offset_us) < int(size_us):
            raise InvalidSpecError(f"window_top: offset_us must be in [0, size_us={size_us}), got {offset_us}")
        self.size_us = int(size_us)
        self.offset_us = int(offset_us)
        self.field = field
        self.output = output
        self.allowed_lateness_us = int(allowed_lateness_us)

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        self.output = default_output("window_top", self.output, outputs)

    def process_record(self, ctx: Context, record: Record) -> None:
        self.process_records(ctx, (record,))

    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        """The key's windows are decoded once per batch, updated by each record in
        arrival order, and encoded once."""
        windows = _load(ctx.state)
        watermark = ctx.input_watermark
        size, offset, lateness = self.size_us, self.offset_us, self.allowed_lateness_us
        for record in records:
            start = window_start(record.timestamp, size, offset)
            end = start + size
            if end - 1 + lateness < watermark:
                continue  # the window closed for good: its state may be gone
            x = number_at(record, self.field, "window_top")
            start_s = str(start)
            w = windows.get(start_s)
            if w is None:
                w = windows[start_s] = [x, [], False]
                ctx.set_timer(f"end:{start}", at_most(end - 1))
                if lateness:
                    ctx.set_timer(f"gc:{start}", at_most(end - 1 + lateness), hold=False)
            if x < w[_TOP]:
                continue
            if w[_FIRED]:  # a late record reached a produced window's maximum: out at once
                w[_TOP] = x
                self._emit(ctx, end, record.value)
            elif x > w[_TOP]:
                w[_TOP], w[_VALUES] = x, [value_text(record.value)]
            else:
                w[_VALUES].append(value_text(record.value))
        _store(ctx, windows)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        kind, _, start_s = timer.tag.partition(":")
        windows = _load(ctx.state)
        w = windows.get(start_s)
        if w is None:
            return
        if kind == "end":
            if not w[_FIRED]:
                end = int(start_s) + self.size_us
                for text in w[_VALUES]:
                    self._emit(ctx, end, value_bytes(text))
                w[_FIRED], w[_VALUES] = True, []  # from now on only the maximum counts
            if not self.allowed_lateness_us:
                del windows[start_s]
        elif kind == "gc":
            del windows[start_s]
        _store(ctx, windows)

    def _emit(self, ctx: Context, end: int, value: bytes) -> None:
        assert self.output is not None
        ctx.produce(self.output, ctx.key, value, at_most(end - 1))


def _load(state: bytes | None) -> dict[str, list[Any]]:
    return jsonvalue.loads(state) if state else {}


def _store(ctx: Context, windows: dict[str, list[Any]]) -> None:
    ctx.set_state(json.dumps(windows, separators=(",", ":")).encode() if windows else None)
