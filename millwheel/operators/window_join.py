"""Built-in ``window_join``: a windowed inner join of two keyed streams, ``left`` and
``right`` (Nexmark q8: people who registered and opened an auction in one window).

Behaviour a user can rely on:
* windows are tumbling, ``[start, start + size_us)`` with ``start = offset_us (mod
  size_us)``; a record of ``left`` and one of ``right`` with the same key (after each
  input's key extractor) in the same window are a pair;
* once the input watermark passes a window's end, each pair of the key's window gives
  one record, stamped ``end - 1``, JSON ``{"key", "left", "right", "left_ts",
  "right_ts", "start", "end"}`` (``left``/``right`` parsed as JSON, or their text); then
  the window's state is dropped. With ``mode: semi`` each ``left`` record of a window
  holding at least one ``right`` record gives one record instead, ``{"key", "left",
  "left_ts", "start", "end"}`` (SQL's ``EXISTS``: which right records matched does not
  change it);
* with ``allowed_lateness_us`` > 0 a window's records are kept until the watermark
  passes ``end - 1 + allowed_lateness_us``. A late record of a produced window gives
  at once only what is new: its pairs with the other side's records kept (under
  ``semi``: a late ``left`` record, when the window has a right record; the first
  ``right`` record of a window, its left records). Every pair is produced once;
* a record in a window more than ``allowed_lateness_us`` past its end is not joined
  (the late-data policy drops or routes it before; under ``process`` it is skipped, as
  ``window_aggregate`` skips a window closed for good).

Records reach the operator with their input stream's name in front of the value
(:mod:`millwheel.input_tag`); a record of neither input is an error, under the error
policy. State (GetState) is JSON ``{"START": [[[t, value], ...], [[t, value], ...],
fired]}`` (left, right, in arrival order); timers ``end:START`` at ``end - 1`` and,
under lateness, ``gc:START`` (no hold), all through the computation's context.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from millwheel import jsonvalue
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.input_tag import untag
from millwheel.operators.join import decode_value
from millwheel.operators.outputs import default_output
from millwheel.operators.window_top import at_most, window_start
from millwheel.record import Record, Timer

MODES = ("inner", "semi")
_LEFT, _RIGHT, _FIRED = range(3)


class WindowJoin(Computation):
    def __init__(
        self,
        *,
        left: str,
        right: str,
        size_us: int,
        offset_us: int = 0,
        mode: str = "inner",
        output: str | None = None,
        allowed_lateness_us: int = 0,
    ) -> None:
        if left == right:
            raise InvalidSpecError(f"window_join: left and right must be two streams, both are {left!r}")
        if int(size_us) <= 0:
            raise InvalidSpecError(f"window_join: size_us must be > 0, got {size_us}")
        if not 0 <= int(offset_us) < int(size_us):
            raise InvalidSpecError(f"window_join: offset_us must be in [0, size_us={size_us}), got {offset_us}")
        if mode not in MODES:
            raise InvalidSpecError(f"window_join: mode {mode!r} not one of {MODES}")
        self.left, self.right = left, right
        self.size_us, self.offset_us = int(size_us), int(offset_us)
        self.semi = mode == "semi"
        self.output = output
        self.allowed_lateness_us = int(allowed_lateness_us)

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        self.output = default_output("window_join", self.output, outputs)

    def process_record(self, ctx: Context, record: Record) -> None:
        self.process_records(ctx, (record,))

    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        windows = _load(ctx.state)
        watermark = ctx.input_watermark
        size, lateness = self.size_us, self.allowed_lateness_us
        for record in records:
            stream, raw = untag(record.value)
            if stream == self.left:
                side = _LEFT
            elif stream == self.right:
                side = _RIGHT
            else:
                raise InvalidSpecError(
                    f"window_join: record {record.record_id} is from neither {self.left!r} nor "
                    f"{self.right!r} (stream {stream!r})")
            t = record.timestamp
            start = window_start(t, size, self.offset_us)
            if start + size - 1 + lateness < watermark:
                continue  # the window closed for good: what it could join may be gone
            start_s = str(start)
            w = windows.get(start_s)
            if w is None:
                w = windows[start_s] = [[], [], False]
                ctx.set_timer(f"end:{start}", at_most(start + size - 1))
                if lateness:
                    ctx.set_timer(f"gc:{start}", at_most(start + size - 1 + lateness), hold=False)
            entry = [t, decode_value(raw)]
            if w[_FIRED]:  # a late record of a produced window: only its new pairs, now
                self._emit_late(ctx, start, w, side, entry)
            if self.semi and side == _RIGHT and w[_RIGHT]:
                continue  # under semi only whether a window has a right record counts
            w[side].append(entry)
        _store(ctx, windows)

    def _emit_late(self, ctx: Context, start: int, w: list[Any], side: int, entry: list[Any]) -> None:
        if self.semi:
            if side == _LEFT and w[_RIGHT]:
                self._emit(ctx, start, entry, None)
            elif side == _RIGHT and not w[_RIGHT]:
                for left in w[_LEFT]:
                    self._emit(ctx, start, left, None)
        elif side == _LEFT:
            for right in w[_RIGHT]:
                self._emit(ctx, start, entry, right)
        else:
            for left in w[_LEFT]:
                self._emit(ctx, start, left, entry)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        kind, _, start_s = timer.tag.partition(":")
        windows = _load(ctx.state)
        w = windows.get(start_s)
        if w is None:
            return
        if kind == "end":
            if not w[_FIRED] and w[_RIGHT]:
                start = int(start_s)
                for left in w[_LEFT]:
                    if self.semi:
                        self._emit(ctx, start, left, None)
                    else:
                        for right in w[_RIGHT]:
                            self._emit(ctx, start, left, right)
            w[_FIRED] = True
            if not self.allowed_lateness_us:
                del windows[start_s]
        elif kind == "gc":
            del windows[start_s]
        _store(ctx, windows)

    def _emit(self, ctx: Context, start: int, left: list[Any], right: list[Any] | None) -> None:
        end = start + self.size_us
        payload: dict[str, Any] = {"key": ctx.key, "left": left[1]}
        if right is not None:
            payload["right"] = right[1]
        payload["left_ts"] = left[0]
        if right is not None:
            payload["right_ts"] = right[0]
        payload["start"], payload["end"] = start, end
        assert self.output is not None
        ctx.produce(self.output, ctx.key, json.dumps(payload).encode(), at_most(end - 1))


def _load(state: bytes | None) -> dict[str, list[Any]]:
    return jsonvalue.loads(state) if state else {}


def _store(ctx: Context, windows: dict[str, list[Any]]) -> None:
    ctx.set_state(json.dumps(windows, separators=(",", ":")).encode() if windows else None)
