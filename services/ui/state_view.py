"""A key's state as a person reads it: the built-in operators' state with field names.

The built-in operators keep compact JSON (arrays, to keep checkpoints small), e.g.
``session_window``'s ``{"START": [end, count, sum, min, max, fired]}``; shown as such,
a user had to find the operator's docstring to tell a count from a maximum (issue 33).
:func:`labelled` turns the state of each built-in operator into entries (one per
window, session or side) with named fields and readable UTC times; the shapes are the
ones each operator's docstring in millwheel/operators/ documents. State it does not
recognise (user code, or a shape that does not match) gives None: the console then
shows the text or JSON as stored.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Callable

from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.topology import ComputationSpec

Entry = dict[str, Any]  # {"label": str, "fields": {name: value}}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def when(us: int) -> str:
    """A timestamp in microseconds as UTC text to the millisecond; the ends of time in words."""
    if us <= MIN_TIMESTAMP:
        return "-inf (before any record)"
    if us >= MAX_TIMESTAMP:
        return "+inf (end of input)"
    try:
        t = _EPOCH + timedelta(microseconds=us)
    except OverflowError:  # past year 9999: near the ±2^62 sentinels (a timer at "the end of time")
        return "+inf (end of input)" if us > 0 else "-inf (before any record)"
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def span(start: int, end: int) -> str:
    """``[start, end)`` readable; the end without its date when it is the same day."""
    a, b = when(start), when(end)
    if a[:10] == b[:10] and len(a) == len(b) == 23:
        b = b[11:]
    return f"{a} – {b} UTC"


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _timed(items: Any) -> list[dict[str, Any]]:
    """``[[t, value], ...]`` as ``[{"time", "value"}, ...]``."""
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 and _num(i[0]) for i in items):
        raise ValueError("not [[t, value], ...]")
    return [{"time": when(int(t)), "value": v} for t, v in items]


def _accumulated(agg: str, fields: dict[str, Any], count: Any, total: Any, lo: Any, hi: Any,
                 fired: Any) -> dict[str, Any]:
    """``fields`` plus what window_aggregate and session_window both accumulate: sum, min
    and max (and mean) unless the aggregation is a count, which keeps 0.0 there; fired."""
    if agg != "count":
        fields.update({"sum": total, "min": lo, "max": hi})
        if agg == "mean" and count:
            fields["mean"] = total / count
    fields["fired"] = bool(fired)
    return fields


def _aggregate(spec: ComputationSpec, state: dict[str, Any]) -> list[Entry]:
    size = int(spec.code.params.get("size_us", 0))
    agg = spec.code.params.get("aggregation", "count")
    out = []
    for start_s, acc in state.items():
        count, total, lo, hi, fired = acc
        start = int(start_s)
        fields = _accumulated(agg, {"count": count}, count, total, lo, hi, fired)
        out.append({"label": f"window {span(start, start + size) if size else when(start)}", "fields": fields})
    return out


def _session(spec: ComputationSpec, state: dict[str, Any]) -> list[Entry]:
    agg = spec.code.params.get("aggregation", "count")
    out = []
    for start_s, acc in state.items():
        end, count, total, lo, hi, fired = acc
        fields = _accumulated(agg, {"end": when(int(end)), "count": count}, count, total, lo, hi, fired)
        out.append({"label": f"session {span(int(start_s), int(end))}", "fields": fields})
    return out


def _top(spec: ComputationSpec, state: dict[str, Any]) -> list[Entry]:
    size = int(spec.code.params.get("size_us", 0))
    out = []
    for start_s, acc in state.items():
        top, values, fired = acc
        if not isinstance(values, list):
            raise ValueError("values not a list")
        start = int(start_s)
        out.append({"label": f"window {span(start, start + size) if size else when(start)}",
                    "fields": {"max": top, "top records": values, "fired": bool(fired)}})
    return out


def _sides(spec: ComputationSpec) -> tuple[str, str]:
    """A join's two input streams: its ``left``/``right``, by default its first and second input."""
    streams = [i.stream for i in spec.inputs] + ["left", "right"]
    return str(spec.code.params.get("left", streams[0])), str(spec.code.params.get("right", streams[1]))


def _window_join(spec: ComputationSpec, state: dict[str, Any]) -> list[Entry]:
    size = int(spec.code.params.get("size_us", 0))
    left, right = _sides(spec)
    out = []
    for start_s, acc in state.items():
        lefts, rights, fired = acc
        start = int(start_s)
        out.append({"label": f"window {span(start, start + size) if size else when(start)}",
                    "fields": {f"left ({left})": _timed(lefts), f"right ({right})": _timed(rights),
                               "fired": bool(fired)}})
    return out


def _join(spec: ComputationSpec, state: dict[str, Any]) -> list[Entry]:
    if not set(state) <= {"l", "r"}:
        raise ValueError("not {l, r}")
    left, right = _sides(spec)
    return [{"label": "records kept to join", "fields": {
        f"left ({left})": _timed(state.get("l", [])), f"right ({right})": _timed(state.get("r", []))}}]


_SHAPES: dict[str, tuple[str, Callable[[ComputationSpec, dict[str, Any]], list[Entry]]]] = {
    "window_aggregate": ("window", _aggregate),
    "session_window": ("session", _session),
    "window_top": ("window", _top),
    "window_join": ("window", _window_join),
    "interval_join": ("", _join),
    "stream_join": ("", _join),
}


def labelled(spec: ComputationSpec, state: Any) -> dict[str, Any] | None:
    """``{"operator", "entries": [{"label", "fields"}]}`` for a built-in operator's
    decoded state; None for user code or a state not of the operator's shape."""
    if not spec.code.is_builtin or spec.code.name not in _SHAPES or not isinstance(state, dict):
        return None
    _what, shape = _SHAPES[spec.code.name]
    try:
        entries = shape(spec, state)
    except (ValueError, TypeError, KeyError, OverflowError):
        return None
    if _what:  # oldest window or session first
        entries.sort(key=lambda e: str(e["label"]))
    return {"operator": spec.code.name, "entries": entries}
