"""A sink: follows one stream's durable log and writes it to an external system.

The sink's node (``sink:NAME``, one range) is owned like any range: its owner holds a
sequencer token and hands it to the connector with every batch, and the connector
keeps the last position it wrote together with the rows (the external system's own
transaction), so after a crash or a move the new owner resumes from there and a
zombie's write is refused by the system itself (millwheel.connectors.postgres).

Positions are the log's as the sink knows them: the store's, or, in a service restored
from a savepoint on another store, translated (millwheel/savepoint/logmap.py) so that the
position the external system kept from before the restore still means the same records.

A sink that is down holds its stream: the log keeps every record until the log's
retention (docs/service.md), reads resume where the sink's position is, and
:attr:`SinkRunner.down_since` says since when it fails (the worker's metric).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from millwheel.connectors import SinkConnector, registry
from millwheel.connectors.spec import SinkSpec
from millwheel.errors import ConnectorError, InvalidSpecError, StoreError
from millwheel.record import MIN_TIMESTAMP
from millwheel.savepoint.logmap import LogMap
from millwheel.savepoint.logmap import load as load_logmap
from millwheel.state.protocol import StateStore

log = logging.getLogger("millwheel.sinks")


def open_sink(settings: dict[str, Any]) -> SinkConnector:
    """The connector a sink's settings name, its class found in
    :mod:`millwheel.connectors.registry` (its client library imported only now)."""
    kind = settings["type"]
    role = registry.sinks().get(kind)
    if role is None:
        raise InvalidSpecError(f"unknown sink type {kind!r}")
    return registry.build_sink(role, settings)


class SinkRunner:
    def __init__(self, spec: SinkSpec, store: StateStore, token: int, connector: SinkConnector | None = None,
                 batch_size: int = 1000) -> None:
        self.spec = spec
        self.store = store
        self.token = token
        self.connector = connector or open_sink(spec.connector.settings)
        self.batch_size = batch_size
        self.position: int | None = None  # None until opened; as the sink knows it (logmap.py)
        self.logmap: LogMap | None = None
        # The last position of the store's log the external system is known to hold (read
        # back at open or returned by a committed write; through the logmap after a
        # restore): kept across a failure, unlike ``position`` (which forces a reopen), so
        # a drain can say how far a sink that is down got.
        self.committed: int | None = None
        self.written = 0
        self.down_since: float | None = None
        self.caught_up = False  # the last step found nothing new in the log
        #: What the external system is known to hold: every record of the stream below
        #: this is written (the producers' watermark as it was before a read that found
        #: the log written out). MIN_TIMESTAMP until the first such read.
        self.watermark = MIN_TIMESTAMP
        self.dropped = False  # no longer ours (service mode): closed, never written again
        self._retry_at = 0.0
        self._failures = 0

    def step(self, input_watermark: int = MIN_TIMESTAMP) -> int:
        """Write the next batch of the log, if any; returns how many records were read.
        A failing external system is retried with backoff (FencedError propagates).

        ``input_watermark``: the least watermark of the stream's producers, known before
        this call. Every record below it was in the log then (a producer's watermark
        holds back until its records are appended), so a read that finds nothing more to
        write makes it the sink's watermark."""
        if time.monotonic() < self._retry_at:
            return 0
        try:
            if self.position is None:
                self.logmap = load_logmap(self.store, self.spec.stream)
                self.position = self.connector.open(self.spec.name, 0, self.token)
                self._commit(self.position)
            m = self.logmap
            got = self.store.read_log(self.spec.stream, self.position if m is None else m.to_store(self.position),
                                      self.batch_size)
            if got:
                if m is not None:
                    got = [(m.to_sink(seq), rec) for seq, rec in got]
                self.position = self.connector.write_batch(got, self.token)
                self._commit(self.position)
                self.written += len(got)
        except (ConnectorError, StoreError) as exc:
            self.failed(exc)
            return 0
        self._failures, self.down_since = 0, None
        self.caught_up = not got
        if self.caught_up and input_watermark > self.watermark:
            self.watermark = input_watermark
        return len(got)

    def _commit(self, position: int) -> None:
        """``committed`` from a position the sink holds, in the store's numbering."""
        at = position if self.logmap is None else self.logmap.to_store(position)
        self.committed = max(self.committed or 0, at)

    def failed(self, exc: Exception, quiet: bool = False) -> None:
        """The last step failed: down since now (if it was not), the next step only after
        a back-off (doubling to 5 s), reopened then. Logged at the start of a streak
        (unless ``quiet``: the caller logs it), never once per retry."""
        self._failures += 1
        self.caught_up = False
        if self.down_since is None:
            self.down_since = time.monotonic()
            if not quiet:
                log.warning("sink %r: %s; retrying", self.spec.name, exc)
        delay = min(5.0, 0.05 * 2 ** min(self._failures, 10))
        self._retry_at = time.monotonic() + delay * random.uniform(0.5, 1.5)
        self.position = None  # reopen: the connection may be gone, the position moved

    def close(self) -> None:
        self.connector.close()
