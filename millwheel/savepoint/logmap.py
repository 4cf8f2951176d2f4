"""A restored stream log's positions as the sinks know them.

An external sink (PostgreSQL, a Redis stream, NATS JetStream) keeps, in the external
system, the last log position it wrote, and only ever raises it. A restore appends a
stream's retained entries into a store that numbers them its own way (SQLite numbers
the entries of all streams in one sequence, Redis each stream from 1), so the position
a sink kept in the source service would name other entries in the restored one: read
as it is, it would skip records (or write some again where nothing else deduplicates).

So the restore records, per restored stream whose numbering changed, the map from the
new store's positions to the file's (:class:`LogMap`, metadata ``savepoint/logmap/S``):
a restored entry keeps its old number as the sink sees it, and entries appended after
the restore continue above the old last one (``new + offset``). The sink runner
(millwheel/runtime/sink_runner.py) reads the log at :meth:`LogMap.to_store` of the
position its connector returns and hands the connector :meth:`LogMap.to_sink` of each
entry's, so sink positions stay one increasing sequence across restores. A savepoint of
a restored service writes the sink positions (millwheel/savepoint/capture.py), so a
second restore composes.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field

from millwheel.errors import StoreError
from millwheel.state.protocol import StateStore

META = "savepoint/logmap/"  #: metadata: savepoint/logmap/STREAM -> the map (JSON)


@dataclass
class LogMap:
    """Runs ``(new_first, old_first, count)`` of restored entries numbered one by one on
    both sides; ``new_last`` the new position of the last restored entry (0: none);
    ``old_last`` the old position of the stream's end at the cut."""

    new_last: int = 0
    old_last: int = 0
    runs: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def offset(self) -> int:
        return self.old_last - self.new_last

    def add(self, new: int, old: int) -> None:
        """The next restored entry (both positions rise from one call to the next)."""
        if self.runs:
            n0, o0, c = self.runs[-1]
            if new == n0 + c and old == o0 + c:
                self.runs[-1] = (n0, o0, c + 1)
                self.new_last = new
                return
        self.runs.append((new, old, 1))
        self.new_last = new

    def identity(self) -> bool:
        """Whether every position is the same on both sides (nothing to record)."""
        return self.offset == 0 and all(n == o for n, o, _c in self.runs)

    def to_sink(self, new: int) -> int:
        """A position of the restored store as the sinks number it."""
        if new > self.new_last:
            return new + self.offset
        i = bisect.bisect_right([n for n, _o, _c in self.runs], new) - 1
        if i < 0:
            return 0 if not self.runs else max(0, self.runs[0][1] - 1)
        n0, o0, c = self.runs[i]
        return o0 + min(new - n0, c - 1)

    def to_store(self, pos: int) -> int:
        """The restored store's position to read after, for a sink's position ``pos``:
        the last restored entry the sink has (0: none of them)."""
        if pos >= self.old_last:
            return max(0, pos - self.offset)
        olds = [o for _n, o, _c in self.runs]
        i = bisect.bisect_right(olds, pos) - 1
        if i < 0:
            return 0
        n0, o0, c = self.runs[i]
        return n0 + min(pos - o0, c - 1)

    def dumps(self) -> bytes:
        return json.dumps({"new_last": self.new_last, "old_last": self.old_last,
                           "runs": [x for run in self.runs for x in run]}).encode()


def load(store: StateStore, stream: str) -> LogMap | None:
    """The stream's map, None if its numbering was never changed by a restore."""
    raw = store.get_meta(META + stream)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        flat = [int(x) for x in data["runs"]]
        return LogMap(int(data["new_last"]), int(data["old_last"]),
                      [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat) - 2, 3)])
    except (ValueError, TypeError, KeyError, IndexError):
        raise StoreError(f"store metadata {META + stream!r}: not a log position map") from None


def save(store: StateStore, stream: str, m: LogMap) -> None:
    """Record ``m`` for ``stream`` (nothing if it changes no position)."""
    store.put_meta(META + stream, None if m.identity() else m.dumps())
