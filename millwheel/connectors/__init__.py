"""Connectors: sources an injector pulls from, sinks a stream's records go to.

One small protocol for each side, and one module per external system, each the only
importer of its client library (``redis`` through :mod:`millwheel.state.redis_connection`,
``psycopg`` in :mod:`.postgres`, ``nats`` in :mod:`.nats_jetstream`); the runtime
(:mod:`millwheel.runtime.injector`, :mod:`millwheel.runtime.sink_runner`) knows only
the protocol. A Kafka connector would be one more module of this shape: a source whose
position is (partition, offset), a sink writing transactionally with the token in its
transactional ID (docs/connectors.md).

Positions are text: a source's are opaque and totally ordered within the source (a
Redis entry ID, a JetStream sequence, a file and byte offset); a sink's is the
sequence number of the stream log it follows, so a retry after any crash starts at
the last position the external system itself committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from millwheel.record import Record


@dataclass(frozen=True)
class Entry:
    """One item read from a source at ``position``: its fields as the source holds them
    (Redis fields, a NATS message's JSON envelope or headers, a JSON line)."""

    position: str
    fields: dict[str, bytes]


class SourceConnector(Protocol):
    """Reads an external source from a position. Not thread-safe: one reader each."""

    def open(self, position: str | None) -> None:
        """Connect and get ready to read the entries after ``position`` (None: from
        the start)."""

    def read_batch(self, max_records: int, wait_s: float) -> list[Entry]:
        """Up to ``max_records`` entries after the last one returned, waiting up to
        ``wait_s`` for the first; [] if none came."""

    def record_id(self, entry: Entry) -> str:
        """The record ID of an entry without an ``id`` field: derived from its position,
        so reading it again after a crash gives the same ID and consumers drop it."""

    def finished(self) -> bool:
        """True once every entry present when the source was opened was returned
        (``until: end``); a following source never finishes."""

    def close(self) -> None: ...


class SinkConnector(Protocol):
    """Writes a stream's records to an external system, exactly once where the system
    allows (each module says its guarantee)."""

    def open(self, sink: str, range_id: int, token: int) -> int:
        """Connect, take over (sink, range) under ``token`` (a writer holding an older
        token is refused from then on) and return the last position written (0: none)."""

    def write_batch(self, records: Sequence[tuple[int, Record]], token: int) -> int:
        """Write ``(position, record)`` pairs in position order, the records and the new
        position together; positions already written are skipped. Returns the position
        now written. Raises :class:`~millwheel.errors.FencedError` if a newer token
        took the sink over."""

    def close(self) -> None: ...
