"""Stream-log retention: which records a logged stream keeps, and trimming the rest in
the background in small batches (docs/service.md, "Log retention").

Each logged stream keeps its records for ``log_retention_us`` of processing time and
at most ``log_retention_bytes`` of them (the options of the computations writing it:
:func:`retention_of`). One :class:`LogTrimmer` per deployment applies it: the leading
controller's thread in the service (services/controller/retention.py), the runner in
local mode (millwheel.runtime.local_runner).

Why the trimmer keeps marks instead of the log keeping a time per entry: appending to
the log is on the path of every sink record, and neither backend stores a time per
entry; a time and a byte count per entry would cost every append, for the benefit of
a pass every second. So the trimmer measures what was appended since its last pass
(:meth:`~millwheel.state.protocol.StateStore.log_stats`, a batch at a time) and
notes a *mark*: the last sequence number measured, the bytes measured so far, and
the time it saw them. A record's age is taken from the mark that covers it, which
was made after the record was appended: records are removed late (by up to a pass
and a mark's span, ``log_retention_us / 128``), never early. Marks are kept in the
store's metadata (``log-retention/STREAM``), saved every few seconds; after a restart
records measured since the last save are measured again and count as new (later
removal, never earlier). Marks are merged so a stream has a few hundred at most.

Size: a stream keeps at most ``log_retention_bytes`` of measured records (whole
marks are removed, at most ``1/64`` of the limit each), except that no record younger
than :data:`MIN_TRIM_AGE_US` (or ``log_retention_us`` if shorter) is removed by size:
a producer that crashed between appending and acknowledging appends again (by record
ID, a no-op while the entry is there), and that must not find it gone.

Readers never see a silent gap: :meth:`~millwheel.state.protocol.StateStore.trim_log`
raises the log's start in the same atomic step, and :func:`read_retained` refuses a
read from before it (:class:`~millwheel.errors.LogTrimmedError`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

from millwheel.clock import Clock
from millwheel.errors import LogTrimmedError
from millwheel.nodes import is_injector
from millwheel.record import Record
from millwheel.state.protocol import StateStore
from millwheel.topology import DEFAULT_LOG_RETENTION_BYTES, DEFAULT_LOG_RETENTION_US, Topology

log = logging.getLogger("millwheel.retention")

BATCH_ROWS = 1000  #: log entries per store call (a measure, or one trim transaction)
PASS_BATCHES = 20  #: store calls per stream and pass for each of measuring and trimming
MIN_TRIM_AGE_US = 60_000_000  #: records younger than this are not removed by size
AGE_SLICES = 128  #: a mark spans at most log_retention_us / AGE_SLICES of time
BYTES_SLICES = 64  #: and at most log_retention_bytes / BYTES_SLICES of bytes
SAVE_EVERY_US = 10_000_000  #: how often changed marks are written to the store
META_PREFIX = "log-retention/"  #: + stream: the stream's marks, as JSON


@dataclass(frozen=True)
class Retention:
    """A logged stream's limits; 0 is no limit of that kind."""

    age_us: int = DEFAULT_LOG_RETENTION_US
    bytes: int = DEFAULT_LOG_RETENTION_BYTES


def _widest(values: list[int]) -> int:
    return 0 if 0 in values else max(values)


def retention_of(topology: Topology) -> dict[str, Retention]:
    """Every logged stream's retention: the widest of its writers' options (a stream
    written by several computations keeps what the most demanding of them asks for);
    a stream only injectors write has the defaults."""
    out: dict[str, Retention] = {}
    for stream in topology.logged_streams():  # writers looked up, not scanned for: O(registry), not O(n^2)
        writers = [topology.computation(n).options for n in topology.producers(stream) if not is_injector(n)]
        out[stream] = Retention(_widest([o.log_retention_us for o in writers]),
                                _widest([o.log_retention_bytes for o in writers])) if writers else Retention()
    return out


def trimmed_message(stream: str, after_seq: int, oldest: int) -> str:
    return (f"stream {stream!r}: position {after_seq} is no longer in the stream log: its "
            f"retention (log_retention_us / log_retention_bytes of the computation writing it) "
            f"removed every record through position {oldest}, the oldest available position. "
            f"Read on after {oldest} (after_seq={oldest}; millwheel subscribe {stream} --after "
            f"{oldest}) to get every record still kept, or set from_oldest (--from-oldest) to "
            f"skip what was removed")


def read_retained(store: StateStore, stream: str, after_seq: int, limit: int,
                  skip_removed: bool = False) -> tuple[int, list[tuple[int, Record]]]:
    """``(position read after, entries)``: the log's entries after ``after_seq``, as
    :meth:`~millwheel.state.protocol.StateStore.read_log`, but never with a silent gap.
    If retention removed records after ``after_seq`` (before or during the read),
    :class:`LogTrimmedError` names the oldest available position; with
    ``skip_removed`` the read starts there instead (and says so in the position)."""
    pos = after_seq
    while True:
        entries = store.read_log(stream, pos, limit)
        start = store.log_start(stream)  # read after: a trim during the read shows here
        if start == 0 or start <= pos:  # nothing removed, or only what was before ``pos``
            return pos, entries
        if not skip_removed:
            raise LogTrimmedError(trimmed_message(stream, after_seq, start), start)
        pos = start


@dataclass
class _Marks:
    """What the trimmer knows of one stream's log (see the module docstring)."""

    seen: int = 0  # the last sequence number measured
    total: int = 0  # bytes measured so far, cumulative
    base: int = 0  # ``total`` as it was at the last mark removed
    # [last sequence number, ``total`` through it, newest time, oldest time], oldest first
    marks: list[list[int]] = field(default_factory=list)
    saved_us: int = 0
    dirty: bool = False


class LogTrimmer:
    """Applies :class:`Retention` to a store's logs: :meth:`run` is one pass over every
    stream, a bounded number of small store calls each; it returns True when work is
    left over (call again soon). Not thread-safe: one caller at a time."""

    def __init__(self, store: StateStore, clock: Clock, *, batch_rows: int = BATCH_ROWS,
                 pass_batches: int = PASS_BATCHES, min_trim_age_us: int = MIN_TRIM_AGE_US) -> None:
        self.store = store
        self.clock = clock
        self.batch_rows = batch_rows
        self.pass_batches = pass_batches
        self.min_trim_age_us = min_trim_age_us
        self.removed = 0  # entries removed so far (a sensor for tests and logs)
        self._logs: dict[str, _Marks] = {}

    def run(self, policies: Mapping[str, Retention], stopping: Callable[[], bool] = lambda: False) -> bool:
        """One pass (``stopping`` is asked between streams: a shutdown waits for one)."""
        busy = False
        for stream in [s for s in self._logs if s not in policies]:
            del self._logs[stream]
        for stream, policy in policies.items():
            if stopping():
                return busy
            if policy.age_us or policy.bytes:
                busy |= self._pass(stream, policy)
        return busy

    def save(self, force: bool = False) -> None:
        """Write changed marks to the store (every SAVE_EVERY_US, or now if ``force``)."""
        for stream, m in self._logs.items():
            self._save(stream, m, force)

    def _save(self, stream: str, m: _Marks, force: bool = False) -> None:
        now = self.clock.now_us()
        if m.dirty and (force or now - m.saved_us >= SAVE_EVERY_US):
            self.store.put_meta(META_PREFIX + stream, json.dumps(
                {"seen": m.seen, "total": m.total, "base": m.base, "marks": m.marks}).encode())
            m.saved_us, m.dirty = now, False

    # -- one stream ---------------------------------------------------------------------
    def _load(self, stream: str) -> _Marks:
        m = self._logs.get(stream)
        if m is not None:
            return m
        raw = self.store.get_meta(META_PREFIX + stream)
        try:
            if raw is None:
                raise ValueError("none saved")
            d = json.loads(raw)
            m = _Marks(int(d["seen"]), int(d["total"]), int(d["base"]),
                       [[int(x) for x in mark][:4] for mark in d["marks"]])
            if any(len(mark) != 4 for mark in m.marks):
                raise ValueError("a mark of the wrong shape")
        except (ValueError, KeyError, TypeError) as exc:
            if raw is not None:
                log.warning("log retention of %r: saved marks unreadable (%s): measuring anew", stream, exc)
            m = _Marks(seen=self.store.log_start(stream))
        m.saved_us = self.clock.now_us()
        self._logs[stream] = m
        return m

    def _pass(self, stream: str, policy: Retention) -> bool:
        m = self._load(stream)
        busy = self._measure(stream, m, policy)
        busy |= self._trim(stream, m, policy)
        self._save(stream, m)
        return busy

    def _measure(self, stream: str, m: _Marks, policy: Retention) -> bool:
        age_span = policy.age_us // AGE_SLICES if policy.age_us else None
        bytes_span = policy.bytes // BYTES_SLICES if policy.bytes else None
        for _ in range(self.pass_batches):
            rows, size, last = self.store.log_stats(stream, m.seen, self.batch_rows)
            if not rows:
                return False
            now = self.clock.now_us()
            m.seen, m.total, m.dirty = last, m.total + size, True
            mark = m.marks[-1] if m.marks else None
            before = m.marks[-2][1] if len(m.marks) > 1 else m.base
            if mark is not None and (age_span is None or now - mark[3] < age_span) and (
                    bytes_span is None or m.total - before <= bytes_span):
                mark[0], mark[1], mark[2] = last, m.total, now  # the newest mark grows
            else:
                m.marks.append([last, m.total, now, now])
            if rows < self.batch_rows:
                return False
        return True

    def _trim(self, stream: str, m: _Marks, policy: Retention) -> bool:
        """Remove the oldest marks that are over a limit; True if it ran out of batches."""
        now = self.clock.now_us()
        floor = min(self.min_trim_age_us, policy.age_us) if policy.age_us else self.min_trim_age_us
        upto = -1
        for i, (_seq, _cum, newest, _oldest) in enumerate(m.marks):
            before = m.marks[i - 1][1] if i else m.base
            age = now - newest
            if (policy.age_us and age >= policy.age_us) or (
                    policy.bytes and m.total - before > policy.bytes and age >= floor):
                upto = i
            else:
                break
        if upto < 0:
            return False
        through = m.marks[upto][0]
        for _ in range(self.pass_batches):
            removed = self.store.trim_log(stream, through, self.batch_rows)
            self.removed += removed
            if removed < self.batch_rows:
                m.base = m.marks[upto][1]
                del m.marks[: upto + 1]
                m.dirty = True
                return False
        return True
