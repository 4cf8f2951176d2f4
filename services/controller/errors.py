"""The controller's view of failing user code.

:func:`error_info` fills ``ComputationInfo``'s error fields from what the error policy
(:mod:`millwheel.runtime.poison`) keeps per range in the store: durable counts (late
records per input stream among them, :mod:`millwheel.late`), the last given-up errors
and the items being retried now; and the ranges failing as a
whole, as their owners report them. Handing dead letters back
(``ReplayDeadLetters``) is :mod:`services.controller.replay`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Sequence

from millwheel import late
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, ErrorPolicy

from ..generated import millwheel_pb2 as pb


def _error_proto(raw: bytes, range_id: int, attempts: int | None = None, outcome: str = "") -> pb.ErrorInfo:
    try:
        e: dict[str, Any] = json.loads(raw)
    except ValueError:
        e = {"message": raw.decode("utf-8", "replace")}
    return pb.ErrorInfo(
        range_id=int(e.get("range_id", range_id)), key=str(e.get("key", "")),
        record_id=str(e.get("record_id", "")), time=int(e.get("time", 0)),
        attempts=int(e.get("attempts", 0) if attempts is None else attempts),
        exception_type=str(e.get("exception_type", "")), message=str(e.get("message", "")),
        outcome=outcome or str(e.get("outcome", "")), where=_where(e.get("traceback")))


def _where(frames: Any) -> str:
    """``FILE:LINE`` of the innermost frame (frames read "FILE:LINE in FUNCTION")."""
    if not isinstance(frames, list) or not frames:
        return ""
    return str(frames[-1]).split(" in ", 1)[0][-200:]


#: ``errors/ranges/NAME`` -> the most key ranges the computation has had (a rescale notes it)
RANGES_EVER = "errors/ranges/"


def note_ranges(store: StateStore, name: str, ranges: int) -> None:
    """Note that ``name`` has had ``ranges`` key ranges (a rescale, before its data moves).
    Error counts and recent errors stay in the range that counted them (they only rise,
    and a rescale moves neither): a range a shrink left behind still holds its counts,
    and a later grow finds them again, so the totals are the sum over every range the
    computation ever had. Idempotent (a redone rescale notes the same)."""
    if ranges > ranges_ever(store, name):
        store.put_meta(RANGES_EVER + name, str(ranges).encode())


def ranges_ever(store: StateStore, name: str) -> int:
    raw = store.get_meta(RANGES_EVER + name)
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def error_info(store: StateStore, spec: ComputationSpec,
               failing_ranges: Sequence[pb.RangeFailure] = ()) -> dict[str, Any]:
    """``ComputationInfo`` fields 5-11 for ``spec``, summed over every range it ever had
    (:func:`note_ranges`: counts survive a rescale); the ranges failing as a whole are
    what their owners report (services/controller/failing.py)."""
    counters: dict[str, int] = defaultdict(int)
    reports: list[dict[str, int]] = []
    recent: list[pb.ErrorInfo] = []
    retrying: list[pb.ErrorInfo] = []
    failing = "failing" if spec.options.on_error is ErrorPolicy.FAIL else "retrying"
    for r in range(max(spec.options.key_ranges, ranges_ever(store, spec.name))):
        report = store.read_errors(spec.name, r)
        for name, n in report.counters.items():
            counters[name] += n
        reports.append(report.counters)
        recent += [_error_proto(e, r) for e in report.recent]
        retrying += [_error_proto(err, r, n, failing) for _item, (n, err) in sorted(report.attempts.items())]
    recent.sort(key=lambda e: -e.time)
    return {"dead_lettered": counters["dead_lettered"], "skipped": counters["skipped"],
            "late_dropped": counters["late_dropped"], "recent_errors": recent[:20], "retrying": retrying,
            "failing_ranges": list(failing_ranges),
            "late": [pb.LateCount(input=stream, action=action, count=n)
                     for (stream, action), n in sorted(late.summed(reports).items())]}
