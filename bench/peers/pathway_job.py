"""The Pathway side of :mod:`bench.peers.peer_pathway`: run by the peer's own virtualenv.

Standard library and Pathway only (never millwheel). Usage::

    python pathway_job.py SPEC_JSON

SPEC_JSON: the input CSV (``key,event time ms,record ID``), the output JSON file, a
persistence directory (or null for none), the snapshot interval and the commit interval.
The records are read into memory first, then fed by a ``pw.io.python`` connector subject
(Pathway's streaming input: it commits a minibatch every ``commit_ms``); the count is
``windowby(ts, tumbling(10 s), instance=k, behavior=exactly_once_behavior(shift=2 s))``:
one result per window once the operator's time (the largest event time it has processed)
passes its end + 2 s, later records of it ignored. Persistence: the filesystem backend,
snapshots every ``snapshot_ms``. Timed from the subject's first record to the end of
``pw.run`` (every result delivered): Pathway's own start is before that, not counted.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


def main(spec: dict[str, Any]) -> dict[str, Any]:
    import pathway as pw

    rows = [line.split(",") for line in Path(spec["input"]).read_text().splitlines()]
    marks: dict[str, float] = {}

    class Schema(pw.Schema):
        k: str
        ts: int
        rid: str

    class Feed(pw.io.python.ConnectorSubject):  # type: ignore[misc]
        def run(self) -> None:
            marks["first"] = time.perf_counter()
            for k, ts, rid in rows:
                self.next(k=k, ts=int(ts), rid=rid)

    t = pw.io.python.read(Feed(), schema=Schema, autocommit_duration_ms=spec["commit_ms"], name="events")
    counted = t.windowby(
        t.ts, window=pw.temporal.tumbling(duration=10_000), instance=t.k,
        behavior=pw.temporal.exactly_once_behavior(shift=2_000),
    ).reduce(k=pw.this._pw_instance, start=pw.this._pw_window_start, n=pw.reducers.count())
    counts: Counter[tuple[str, int]] = Counter()

    def on_change(key: Any, row: dict[str, Any], time: int, is_addition: bool) -> None:
        counts[(row["k"], row["start"])] += row["n"] if is_addition else -row["n"]

    pw.io.subscribe(counted, on_change=on_change)
    kwargs: dict[str, Any] = {"monitoring_level": pw.MonitoringLevel.NONE}
    if spec.get("persistence"):
        kwargs["persistence_config"] = pw.persistence.Config(
            pw.persistence.Backend.filesystem(spec["persistence"]), snapshot_interval_ms=spec["snapshot_ms"])
    started = time.perf_counter()
    pw.run(**kwargs)
    ended = time.perf_counter()
    Path(spec["output"]).write_text(json.dumps([[k, s, n] for (k, s), n in counts.items() if n]))
    return {"seconds": ended - marks.get("first", started), "startup_s": marks.get("first", started) - started,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
