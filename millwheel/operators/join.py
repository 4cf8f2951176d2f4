"""Built-in interval join of two keyed streams, ``left`` (A) and ``right`` (B), and
``stream_join``, the same join without a time bound (or with a symmetric one).

Behaviour a user can rely on:
* a record ``a`` of ``left`` and ``b`` of ``right`` with the same key (after each
  input's key extractor) are joined when ``lower_us <= t_b - t_a <= upper_us``; each
  such pair gives exactly one record, produced when the second of the two arrives;
* the joined record has the key, timestamp ``max(t_a, t_b)`` and the JSON value
  ``{"key", "left", "right", "left_ts", "right_ts"}``, where ``left`` and ``right``
  are the two values parsed as JSON, or as text when they are not JSON;
* each side's records are kept only while a record of the other side may still match
  them: a ``left`` record until the input watermark passes ``t_a + upper_us +
  allowed_lateness_us``, a ``right`` record until it passes ``t_b - lower_us +
  allowed_lateness_us`` (one event-time timer per key, without watermark hold), so the
  state of a key is bounded by the records of that span;
* a record more than ``allowed_lateness_us`` behind the input watermark is not joined
  (the late-data policy drops or routes it before; under ``process`` it is skipped).
  A late record within the lateness joins, and its joined records may be late
  downstream, as a corrected ``window_aggregate`` result is.

Records reach the operator with their input stream's name in front of the value
(:mod:`millwheel.input_tag`); a record without one (its stream is neither input) is an
error, under the computation's error policy. State, readable through GetState, is JSON
``{"l": [[t, value], ...], "r": [...]}`` in arrival order, written only through the
computation's context, so checkpoints cover it with the timer.

``stream_join`` (:class:`StreamJoin`) is this join with the bounds open (SQL's regular
join on the key, Nexmark q3): every pair of a key, each produced once when the second
of the two arrives. Nothing expires, so a key's state is all its records, and no record
is too late to join (every record it could match is kept). With ``retention_us`` it is
the interval join ``-retention_us <= t_b - t_a <= retention_us``: a record is kept
until the watermark passes ``t + retention_us + allowed_lateness_us``, and which pairs
are joined is decided by the timestamps, not by when records arrived.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from millwheel import jsonvalue
from millwheel.computation import Computation, Context
from millwheel.errors import InvalidSpecError
from millwheel.input_tag import untag
from millwheel.operators.outputs import default_output
from millwheel.record import MAX_TIMESTAMP, Record, Timer

GC_TAG = "gc"


class IntervalJoin(Computation):
    """``lower_us`` or ``upper_us`` None is that side of the interval open (what
    :class:`StreamJoin` builds; the ``interval_join`` parameters require both)."""

    operator = "interval_join"

    def __init__(
        self,
        *,
        left: str,
        right: str,
        lower_us: int | None,
        upper_us: int | None,
        output: str | None = None,
        allowed_lateness_us: int = 0,
    ) -> None:
        if left == right:
            raise InvalidSpecError(f"{self.operator}: left and right must be two streams, both are {left!r}")
        if lower_us is not None and upper_us is not None and int(lower_us) > int(upper_us):
            raise InvalidSpecError(f"{self.operator}: lower_us ({lower_us}) must be <= upper_us ({upper_us})")
        self.left, self.right = left, right
        self.lower_us = None if lower_us is None else int(lower_us)
        self.upper_us = None if upper_us is None else int(upper_us)
        self.output = output
        self.allowed_lateness_us = int(allowed_lateness_us)

    def bind_outputs(self, outputs: tuple[str, ...]) -> None:
        self.output = default_output(self.operator, self.output, outputs)

    def process_record(self, ctx: Context, record: Record) -> None:
        self.process_records(ctx, (record,))

    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        state = _load(ctx.state)
        watermark = ctx.input_watermark
        lateness = self.allowed_lateness_us
        for record in records:
            stream, raw = untag(record.value)
            if stream == self.left:
                side, other = "l", "r"
            elif stream == self.right:
                side, other = "r", "l"
            else:
                raise InvalidSpecError(
                    f"{self.operator}: record {record.record_id} is from neither {self.left!r} nor "
                    f"{self.right!r} (stream {stream!r})")
            t = record.timestamp
            if t + lateness < watermark and (self.lower_us if side == "l" else self.upper_us) is not None:
                continue  # closed for good: what it could join may be gone
            value = decode_value(raw)
            for t_other, v_other in state[other]:
                if side == "l":
                    self._maybe_emit(ctx, t, value, t_other, v_other)
                else:
                    self._maybe_emit(ctx, t_other, v_other, t, value)
            state[side].append([t, value])
        self._store(ctx, state)

    def _maybe_emit(self, ctx: Context, t_l: int, v_l: Any, t_r: int, v_r: Any) -> None:
        lower, upper = self.lower_us, self.upper_us
        if (lower is not None and t_r - t_l < lower) or (upper is not None and t_r - t_l > upper):
            return
        payload = {"key": ctx.key, "left": v_l, "right": v_r, "left_ts": t_l, "right_ts": t_r}
        assert self.output is not None
        ctx.produce(self.output, ctx.key, json.dumps(payload).encode(), max(t_l, t_r))

    def _expiry(self, side: str, t: int) -> int | None:
        """The watermark past which a record of ``side`` at ``t`` can match nothing more
        (None: never, its side of the interval is open)."""
        if side == "l":
            if self.upper_us is None:
                return None
            bound = self.upper_us
        else:
            if self.lower_us is None:
                return None
            bound = -self.lower_us
        return min(t + bound + self.allowed_lateness_us, MAX_TIMESTAMP - 1)

    def _store(self, ctx: Context, state: dict[str, list[list[Any]]]) -> None:
        """Write the state and move the key's one timer to its earliest expiry."""
        expiring = self.lower_us is not None or self.upper_us is not None  # else no timer, ever
        if not state["l"] and not state["r"]:
            ctx.set_state(None)
            if expiring:
                ctx.clear_timer(GC_TAG)
            return
        ctx.set_state(json.dumps(state, separators=(",", ":")).encode())
        expiries = [e for side in ("l", "r") for t, _v in state[side] if (e := self._expiry(side, t)) is not None]
        if expiries:
            ctx.set_timer(GC_TAG, max(min(expiries), -MAX_TIMESTAMP), hold=False)
        elif expiring:
            ctx.clear_timer(GC_TAG)

    def process_timer(self, ctx: Context, timer: Timer) -> None:
        if timer.tag != GC_TAG:
            return
        state = _load(ctx.state)
        watermark = ctx.input_watermark
        for side in ("l", "r"):
            state[side] = [e for e in state[side] if (x := self._expiry(side, e[0])) is None or x >= watermark]
        self._store(ctx, state)


class StreamJoin(IntervalJoin):
    """``stream_join``: the join of every pair of a key (see the module's docstring)."""

    operator = "stream_join"

    def __init__(
        self,
        *,
        left: str,
        right: str,
        retention_us: int | None = None,
        output: str | None = None,
        allowed_lateness_us: int = 0,
    ) -> None:
        bound = None if retention_us is None else int(retention_us)
        if bound is not None and bound < 0:
            raise InvalidSpecError(f"stream_join: retention_us must be >= 0, got {retention_us}")
        super().__init__(left=left, right=right, lower_us=None if bound is None else -bound, upper_us=bound,
                         output=output, allowed_lateness_us=allowed_lateness_us)


def decode_value(raw: bytes) -> Any:
    """A joined value as the output shows it: parsed as JSON, or its text."""
    try:
        return jsonvalue.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _load(state: bytes | None) -> dict[str, list[list[Any]]]:
    if not state:
        return {"l": [], "r": []}
    loaded: dict[str, list[list[Any]]] = jsonvalue.loads(state)
    return loaded
