"""Per-range watermarks as the controller knows them, kept without waiting on the store.

The store holds each range's watermark durably (raised only, by the range's owner's
reports, fenced by its token). The controller answers heartbeats and queries from
``known``, its copy: a report enters it once the store has it (never before, so no
served watermark is ahead of the store), and every node's stored values are read into
it every :data:`REFRESH_S`, :data:`READS_PER_REFRESH` nodes at a time (what a standby,
or a new leader, learns from the store).
Both store calls run on store-work threads (services/controller/store_work.py), one at
a time per range or node: a shard that is away holds back the watermarks of the ranges
whose keys live on it, and nothing else (issue 21, item 4). Stored watermarks only
rise, so the copy takes the larger of what it has and what it reads.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from functools import partial
from typing import Callable

from millwheel.errors import FencedError
from millwheel.record import MIN_TIMESTAMP
from millwheel.runtime.range_worker import HELD_REASON_CHARS
from millwheel.state.protocol import StateStore

from .store_work import StoreWork

log = logging.getLogger("millwheel.controller")

REFRESH_S = 0.2  #: between reads of the nodes' stored watermarks
#: Nodes read per refresh, in turn: every node each REFRESH_S up to this many nodes; at
#: 1,000 computations each is read every ~1.6 s instead of 5,000 reads a second, which
#: kept the leader's threads from its lease renewals on a loaded machine (issue 34 item 9).
#: The leader's own reports enter the copy as they are written, whatever this pace.
READS_PER_REFRESH = 128
Unit = tuple[str, int]
REASON_CHARS = HELD_REASON_CHARS  #: WatermarkReport.held's bound, kept by the controller too (a report is input)


class Watermarks:
    def __init__(self, store: StateStore, work: StoreWork, lock: threading.RLock) -> None:
        self.store = store
        self.work = work
        self.lock = lock
        self.known: dict[str, dict[int, int]] = {}
        self._served: dict[str, int] = {}
        self._read_at = 0.0
        self._next_read = 0  # where the next refresh starts in the registry's nodes
        # Ranges a rescale refilled (services/controller/rescale.py): node -> range -> the
        # value it counts as, its owner's own reports (not the stored value, which never
        # goes below what the range held before the keys moved in) until one reaches it.
        self.held: dict[str, dict[int, int]] = {}
        # What its owner last said holds each range below its input (WatermarkReport.held,
        # for ``held_by``'s rule 5): in memory only, one short string per range.
        self.reasons: dict[str, dict[int, str]] = {}

    # -- answers (under the controller's lock; no store call) --------------------------
    def of(self, node: str) -> dict[int, int]:
        return self.known.get(node, {})

    def node(self, node: str, ranges: int) -> int:
        """The node's watermark: the least of its ranges' once every range has one; never
        backwards from what was served before."""
        stored = self.known.get(node, {})
        value = MIN_TIMESTAMP
        if all(r in stored for r in range(ranges)):
            held = self.held.get(node, {})
            value = min(min(stored[r], held.get(r, stored[r])) for r in range(ranges))
        served = max(self._served.get(node, MIN_TIMESTAMP), value)
        self._served[node] = served
        return served

    def reason(self, node: str, range_id: int) -> str:
        """What the range's owner last said holds it below its input ("" if nothing)."""
        return self.reasons.get(node, {}).get(range_id, "")

    def note_reason(self, node: str, range_id: int, text: str) -> None:
        """An owner's report's ``held`` (under the lock): kept, cut to REASON_CHARS, until the next."""
        if text:
            self.reasons.setdefault(node, {})[range_id] = text[:REASON_CHARS]
        elif range_id in self.reasons.get(node, {}):
            del self.reasons[node][range_id]

    def hold(self, node: str, floor: int, ranges: int) -> None:
        """After a rescale (under the lock): count every range of ``node`` as ``floor``
        (the least watermark of its old ranges) until its new owner reports as much as
        is stored. A key moved into a range that had a higher watermark brings pending
        work (timers, productions) older than it; the stored value cannot go back."""
        self.held[node] = {r: floor for r in range(ranges)}

    def _reported(self, node: str, range_id: int, watermark: int) -> None:
        with self.lock:
            held = self.held.get(node)
            if held is None or range_id not in held:
                return
            if watermark >= self.known.get(node, {}).get(range_id, MIN_TIMESTAMP):
                del held[range_id]  # caught up: the stored value is true again
                if not held:
                    del self.held[node]
            else:
                held[range_id] = max(held[range_id], watermark)

    def _learn(self, node: str, values: dict[int, int]) -> None:
        with self.lock:
            mine = self.known.setdefault(node, {})
            for r, wm in values.items():
                mine[r] = max(mine.get(r, MIN_TIMESTAMP), wm)

    # -- store calls (submitted; never waited for under the lock) ----------------------
    def refresh(self, nodes: dict[str, int], force: bool = False) -> None:
        """Read registered nodes' stored watermarks (at most every REFRESH_S, the next
        READS_PER_REFRESH of them in turn); a node whose read is still under way gets
        one more read queued, not a backlog."""
        now = time.monotonic()
        if not force and now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        with self.lock:
            for gone in [n for n in self.known if n not in nodes]:
                del self.known[gone]
            for gone in [n for n in self.held if n not in nodes]:
                del self.held[gone]
            for gone in [n for n in self.reasons if n not in nodes]:
                del self.reasons[gone]
        names = list(nodes)
        if len(names) > READS_PER_REFRESH:
            start = self._next_read % len(names)
            self._next_read = start + READS_PER_REFRESH
            names = (names[start:] + names[:start])[:READS_PER_REFRESH]
        for node in names:
            self.work.submit(("wm-read", node), partial(self._read, node), replace=True)

    def refresh_now(self, nodes: dict[str, int], timeout_s: float) -> None:
        """Read every node's stored watermarks and wait (up to ``timeout_s``; never under
        the lock): what a controller taking over, or a standby answering a watermark
        query, must know so that it never serves less than the store already holds
        (a watermark another controller served)."""
        futures = [self.work.submit(("wm-read", node), partial(self._read, node), replace=True)
                   for node in nodes]
        wait(futures, timeout=timeout_s)

    def _read(self, node: str) -> None:
        try:
            values = self.store.read_watermarks(node)
        except Exception as exc:
            log.info("watermarks of %r not read: %s", node, exc)
            return
        self._learn(node, values)

    def report(self, node: str, range_id: int, token: int, watermark: int,
               on_fenced: Callable[[], None]) -> Future[int]:
        """Write an owner's report (fenced by its token in the store); on FencedError
        ``on_fenced()`` is called (under the lock) and the error stays in the future. A
        report that fails otherwise is dropped: its worker reports again next heartbeat."""
        def write() -> int:
            try:
                stored = self.store.report_watermark(node, range_id, token, watermark)
            except FencedError:
                with self.lock:
                    on_fenced()
                raise
            except Exception as exc:
                log.warning("watermark report of %s/%d not written: %s", node, range_id, exc)
                raise
            self._learn(node, {range_id: stored})
            self._reported(node, range_id, watermark)
            return stored
        return self.work.submit(("wm", node, range_id), write, replace=True)
