"""Late records, counted per input stream and by what became of them.

A record is late at a computation when its timestamp is below the computation's input
watermark as the record reaches it. The range worker
(:meth:`millwheel.runtime.range_worker.RangeWorker.process_records`) counts every late
record under the input stream it arrived on and one of :data:`ACTIONS`:

* ``processed``: handed to user code all the same (``late_policy: process``, or no later
  than ``allowed_lateness_us``);
* ``dropped``: dropped by ``late_policy: drop``;
* ``routed``: sent to the ``late_stream`` by ``late_policy: route``.

The counts are durable per key range: error counters named ``late:ACTION:STREAM``
(:func:`counter`), checkpointed with the batch, beside the older total ``late_dropped``
(kept as it was). The stream is ``""`` when the batch did not say (:data:`NO_INPUT`):
a dead letter replayed, or a sender older than the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from millwheel.limits import MAX_NAME_CHARS

ACTIONS = ("dropped", "routed", "processed")  # in the order they are shown
PREFIX = "late:"
#: The action label of ``millwheel_late_records_total`` for each: the late_policy's name
#: (the series' labels before inputs were counted, kept).
SENSOR_ACTION = {"processed": "process", "dropped": "drop", "routed": "route"}
#: How the input ``""`` is shown: records whose stream was not carried with them.
NO_INPUT = "(replay)"

_STREAM = re.compile(r"[A-Za-z0-9_.:-]*")  # a stream name (millwheel.limits), or ""

#: (input stream, action) -> count
Counts = dict[tuple[str, str], int]


def counter(action: str, stream: str) -> str:
    """The durable counter's name of ``action`` on input ``stream``."""
    return f"{PREFIX}{action}:{stream}"


def parse(name: str) -> tuple[str, str] | None:
    """``(stream, action)`` of a counter named by :func:`counter`, else None."""
    if not name.startswith(PREFIX):
        return None
    action, sep, stream = name[len(PREFIX):].partition(":")
    if not sep or action not in ACTIONS or len(stream) > MAX_NAME_CHARS or not _STREAM.fullmatch(stream):
        return None
    return stream, action


def summed(counters: Iterable[Mapping[str, int]]) -> Counts:
    """The late counts of several ranges' counters, summed per (input, action)."""
    out: Counts = {}
    for report in counters:
        for name, n in report.items():
            key = parse(name)
            if key is not None and n:
                out[key] = out.get(key, 0) + n
    return out


def show_input(stream: str) -> str:
    return stream or NO_INPUT


def describe(counts: Mapping[tuple[str, str], int], inputs: Iterable[str] = ()) -> list[str]:
    """One phrase per input, ``clicks 120 dropped, 3 processed``: every input in
    ``inputs`` (the computation's, ``0 late`` when none was), then any other counted."""
    by_input: dict[str, dict[str, int]] = {s: {} for s in inputs}
    for (stream, action), n in sorted(counts.items()):
        by_input.setdefault(stream, {})[action] = n
    out = []
    for stream, actions in by_input.items():
        parts = [f"{actions[a]} {a}" for a in ACTIONS if actions.get(a)]
        out.append(f"{show_input(stream)} {', '.join(parts) if parts else '0 late'}")
    return out
