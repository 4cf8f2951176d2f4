"""A connector source as an injector's :class:`~millwheel.sources.Source`.

The cursor the injector checkpoints with each batch (atomically, under its token)
holds the source position after the batch, the largest event time seen and the
watermark given, so a restart reopens the source exactly there and the watermark
never goes back. Watermark: the largest event time minus ``max_disorder_us``; while
the source returns nothing for ``idle_timeout_us`` (if set), processing time minus
``idle_timeout_us`` once that is later (a record arriving after a longer silence with
an older event time is late). A finished ``until: end`` source gives the end of time.

Entries that are not records go out as dead letters (:class:`SourceBatch.rejected`),
so one bad entry never blocks the source.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from millwheel.clock import Clock
from millwheel.connectors import SourceConnector, registry
from millwheel.connectors.envelope import BadEntry, entry_record, field_names
from millwheel.errors import ConnectorError, InvalidSpecError
from millwheel.nodes import injector_node
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record, derive_record_id
from millwheel.sources import SourceBatch

log = logging.getLogger("millwheel.sources")
WAIT_S = 0.05  # how long a read waits for the first entry when the source is quiet


class PulledSource:
    def __init__(self, name: str, connector: SourceConnector, settings: dict[str, Any], clock: Clock,
                 wait_s: float = WAIT_S) -> None:
        self.name = name
        self.connector = connector
        self.clock = clock
        self.wait_s = wait_s
        self.names = field_names(settings.get("fields", {}))
        self.disorder = int(settings.get("max_disorder_us", 0))
        idle = settings.get("idle_timeout_us")
        self.idle_us = int(idle) if idle is not None else None
        self._opened = False
        self._last_active = clock.now_us()
        self._failures = 0

    def read(self, cursor: bytes | None, max_records: int) -> SourceBatch:
        state = json.loads(cursor) if cursor else {}
        pos: str | None = state.get("pos")
        max_seen: int = state.get("max", MIN_TIMESTAMP)
        wm: int = state.get("wm", MIN_TIMESTAMP)
        try:
            if not self._opened:
                self.connector.open(pos)
                self._opened = True
            entries = self.connector.read_batch(max_records, self.wait_s)
        except ConnectorError as exc:  # the source is down: nothing read, retried next time
            self._down(exc)
            return SourceBatch([], cursor or b"", wm, False)
        self._failures = 0
        records: list[Record] = []
        rejected: list[tuple[str, str]] = []  # (position, why)
        for entry in entries:
            try:
                record = entry_record(entry, self.names, self.connector.record_id(entry))
            except BadEntry as exc:
                rejected.append((entry.position, str(exc)))
                continue
            records.append(record)
            max_seen = max(max_seen, record.timestamp)
        now = self.clock.now_us()
        if entries:
            self._last_active = now
        if max_seen > MIN_TIMESTAMP:
            wm = max(wm, max_seen - self.disorder)
        if self.idle_us is not None and not entries and now - self._last_active >= self.idle_us:
            wm = max(wm, now - self.idle_us)
        done = self.connector.finished()
        pos = entries[-1].position if entries else pos
        new_cursor = json.dumps({"pos": pos, "max": max_seen, "wm": wm}).encode()
        return SourceBatch(records, new_cursor, MAX_TIMESTAMP if done else wm, done,
                           rejected=self._letters(rejected, now))

    def _letters(self, rejected: list[tuple[str, str]], now: int) -> list[Record]:
        """Dead letters: key = the injector, value = JSON {injector, position, message};
        the ID derived from the position, so a re-read writes the same letter."""
        return [Record(self.name, json.dumps({"injector": self.name, "position": pos, "message": why}).encode(),
                       now, derive_record_id(injector_node(self.name), "dead\x1f" + pos, 0))
                for pos, why in rejected]

    def _down(self, exc: ConnectorError) -> None:
        self._failures += 1
        if self._failures == 1 or self._failures % 100 == 0:
            log.warning("injector %r: source unavailable (%d tries): %s", self.name, self._failures, exc)
        if self._opened:
            self.connector.close()
            self._opened = False
        time.sleep(min(2.0, 0.05 * 2 ** min(self._failures, 6)))

    def close(self) -> None:
        if self._opened:
            self.connector.close()
            self._opened = False


def open_source(name: str, settings: dict[str, Any], clock: Clock, base: str = ".") -> PulledSource:
    """The source an injector's ``source:`` settings name, its class found in
    :mod:`millwheel.connectors.registry` (its client library imported only now)."""
    kind = settings["type"]
    role = registry.sources().get(kind)
    if role is None:
        raise InvalidSpecError(f"injector {name!r}: unknown source type {kind!r}")
    return PulledSource(name, registry.build_source(role, settings, base), settings, clock)

