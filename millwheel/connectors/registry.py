"""Every connector kind in one table: the source and/or sink it provides, the class that
runs each, and the settings each accepts (its schema), as ``BUILTINS`` is for operators
(millwheel/operators/buildable.py). Adding a kind is one entry here and its module.

Classes are named by ``"module:Class"`` and imported only when a connector is built
(:func:`build_source`, :func:`build_sink`), never when the table is read: the controller
validates specs from the schemas alone (millwheel/connectors/spec.py) and must not need
psycopg or nats installed, and each client library stays imported by its own module
only (tests/unit/test_code_quality.py). A string also keeps the table out of an import
cycle: a connector's module may import spec.py, which imports this table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from millwheel.connectors import SinkConnector, SourceConnector
from millwheel.errors import InvalidSpecError

#: What a PostgreSQL sink writes of a record, each to a column (``columns:`` renames them).
ROW_PARTS = ("record_id", "key", "window_start", "window_end", "value", "ts", "position")

#: A kind's own check of its structured settings: (the settings, where in the spec).
Check = Callable[[Mapping[str, Any], str], None]


@dataclass(frozen=True)
class Schema:
    """The settings a source or sink of one kind accepts beyond the common ones (its
    ``type``; a source's ``until``, ``max_disorder_us``, ``idle_timeout_us``, ``fields``)."""

    schemes: tuple[str, ...]  #: the schemes its ``url`` may start with (none: it takes no URL)
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    #: Settings that are not one string (a number, a mapping, a list): ``check`` judges
    #: them, every other setting must be a non-empty string of bounded length.
    structured: frozenset[str] = frozenset()
    check: Check | None = None


@dataclass(frozen=True)
class Role:
    """A kind's source or its sink: its schema, and the class built from its settings."""

    schema: Schema
    path: str  #: ``"module:Class"``, imported by the first build
    #: A source built with the spec file's directory too (``Class(settings, base)``):
    #: paths in its settings are relative to the spec, as a local run reads them.
    takes_base: bool = False

    def load(self) -> Any:
        """The class (its module, and so its client library, imported now)."""
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ConnectorKind:
    source: Role | None = None
    sink: Role | None = None


def _maxlen(settings: Mapping[str, Any], where: str) -> None:
    """A Redis stream sink's ``maxlen``: the stream is trimmed to about that many entries."""
    maxlen = settings.get("maxlen")
    if maxlen is not None and (isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1):
        raise InvalidSpecError(f"{where}.maxlen: must be a positive integer")


def postgres_table(table: Any, where: str) -> list[str]:
    """A PostgreSQL sink's ``table``: NAME or SCHEMA.NAME, each part 1..63 characters;
    its parts. Checked at registration as the worker's connector checks it, so a sink
    no worker could build is refused there, not accepted and left failing (issue 34)."""
    parts = table.split(".") if isinstance(table, str) else []
    if not 1 <= len(parts) <= 2 or not all(0 < len(p) <= 63 for p in parts):
        raise InvalidSpecError(f"{where}: table {str(table)[:100]!r}: expected NAME or SCHEMA.NAME "
                               "(each 1..63 characters)")
    return parts


def _postgres_settings(settings: Mapping[str, Any], where: str) -> None:
    """A PostgreSQL sink's ``table`` (:func:`postgres_table`), ``columns`` (record part ->
    an existing table's column) and ``upsert_key`` (columns of a unique index: a row with
    the same key is updated)."""
    postgres_table(settings.get("table"), where)
    columns = settings.get("columns")
    if columns is not None:
        if not isinstance(columns, Mapping) or not columns or set(columns) - set(ROW_PARTS):
            raise InvalidSpecError(f"{where}.columns: maps some of {list(ROW_PARTS)} to column names")
        for part, column in columns.items():
            if not isinstance(column, str) or not 0 < len(column) <= 63:
                raise InvalidSpecError(f"{where}.columns.{part}: a column name of 1..63 characters")
    upsert = settings.get("upsert_key")
    if upsert is not None:
        mapped = set((columns or {}).values())
        if columns is None or not isinstance(upsert, list) or not upsert or not all(
                isinstance(c, str) and c in mapped for c in upsert):
            raise InvalidSpecError(f"{where}.upsert_key: a list of columns named in 'columns'")


_REDIS = ("redis", "rediss")
_NATS = ("nats", "tls")

CONNECTORS: dict[str, ConnectorKind] = {
    "redis-stream": ConnectorKind(
        source=Role(Schema(_REDIS, frozenset({"url", "stream"})),
                    "millwheel.connectors.redis_stream:RedisStreamSource"),
        # (`stream` of a sink entry is the millwheel stream it follows; the target is named apart)
        sink=Role(Schema(_REDIS, frozenset({"url", "redis_stream"}), frozenset({"maxlen"}),
                         structured=frozenset({"maxlen"}), check=_maxlen),
                  "millwheel.connectors.redis_stream:RedisStreamSink"),
    ),
    "nats-jetstream": ConnectorKind(
        source=Role(Schema(_NATS, frozenset({"url", "stream", "subject"})),
                    "millwheel.connectors.nats_jetstream:JetStreamSource"),
        sink=Role(Schema(_NATS, frozenset({"url", "subject"}), frozenset({"jetstream"})),
                  "millwheel.connectors.nats_jetstream:JetStreamSink"),
    ),
    "files": ConnectorKind(
        source=Role(Schema((), frozenset({"path"})), "millwheel.connectors.files:FilesSource", takes_base=True),
    ),
    "postgres": ConnectorKind(
        sink=Role(Schema(("postgresql", "postgres"), frozenset({"url", "table"}), frozenset({"columns", "upsert_key"}),
                         structured=frozenset({"columns", "upsert_key"}), check=_postgres_settings),
                  "millwheel.connectors.postgres:PostgresSink"),
    ),
}


def sources() -> dict[str, Role]:
    """Every kind that provides a source, with its source."""
    return {kind: c.source for kind, c in CONNECTORS.items() if c.source is not None}


def sinks() -> dict[str, Role]:
    """Every kind that provides a sink, with its sink."""
    return {kind: c.sink for kind, c in CONNECTORS.items() if c.sink is not None}


def build_source(role: Role, settings: dict[str, Any], base: str) -> SourceConnector:
    cls = role.load()
    connector: SourceConnector = cls(settings, base) if role.takes_base else cls(settings)
    return connector


def build_sink(role: Role, settings: dict[str, Any]) -> SinkConnector:
    connector: SinkConnector = role.load()(settings)
    return connector
