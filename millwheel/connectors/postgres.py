"""PostgreSQL sink, exactly once (psycopg 3, imported only here).

Each batch is one transaction: lock the sink's progress row for (sink, range) in
``millwheel_sink_progress`` (keyed ``SINK@TABLE``), refuse it if it holds a newer sequencer token (a zombie's
transaction fails there and writes nothing), insert the rows past the stored position,
store the new position and token, commit. A retry after any crash (ours, the
database's) starts from the committed position, and ``record_id`` is the primary key,
so no row is written twice.

A writer that stops inside its transaction (a worker paused, its host partitioned) would
hold the progress row's lock, and the sink's new owner would wait on it for as long as
the zombie lives. Each connection therefore sets ``idle_in_transaction_session_timeout``
(:data:`STALLED_TRANSACTION_MS`): PostgreSQL ends a session idle that long inside a
transaction, rolls it back and frees its locks, and the new owner goes on. A healthy
batch sends its statements back to back, far inside that.

The table is created if missing::

    record_id    TEXT PRIMARY KEY
    key          TEXT NOT NULL
    window_start BIGINT NULL      -- for window results (JSON values with start/end)
    window_end   BIGINT NULL
    value        JSONB NOT NULL   -- the value as JSON; text that is not JSON as a JSON string
    ts           BIGINT NOT NULL  -- the record timestamp, microseconds
    position     BIGINT NOT NULL  -- the stream log position it was written from

An existing table with these columns is used as it is. With ``columns`` (record part
-> column: ``{key: user_id, value: payload, ts: event_time}``) the sink writes an
existing table instead (never creating it), only the parts named; with ``upsert_key``
(columns of a unique index) a row whose key is already there is updated, so the table
holds the latest value per key. Without ``record_id`` mapped and without an upsert key
the position in the progress row alone keeps the rows once.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Sequence

import psycopg
from psycopg import sql

from millwheel.connectors.registry import ROW_PARTS, postgres_table
from millwheel.errors import ConnectorError, FencedError
from millwheel.nodes import sink_node
from millwheel.record import Record
from millwheel.state.url_display import redact

PROGRESS_TABLE = "millwheel_sink_progress"
# How long a session may sit idle inside a transaction before PostgreSQL ends it (a
# stalled writer must not hold the progress row's lock for ever); milliseconds.
STALLED_TRANSACTION_MS = 10_000


def row_values(position: int, rec: Record) -> tuple[Any, ...]:
    """(record_id, key, window_start, window_end, value JSON text, ts, position)."""
    try:
        value: Any = json.loads(rec.value)
    except ValueError:
        try:
            value = rec.value.decode("utf-8")
        except UnicodeDecodeError:
            value = {"value_base64": base64.b64encode(rec.value).decode("ascii")}
    start = end = None
    if isinstance(value, dict) and isinstance(value.get("start"), int) and isinstance(value.get("end"), int):
        start, end = value["start"], value["end"]
    return (rec.record_id, rec.key, start, end, json.dumps(value), rec.timestamp, position)


class PostgresSink:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.url = settings["url"]
        table = settings["table"]
        parts = postgres_table(table, "postgres sink")
        self.table = sql.Identifier(*parts)
        self.table_name = table
        mapping = settings.get("columns")
        self.create = mapping is None  # a mapped table must exist
        columns: dict[str, str] = dict(mapping) if mapping else {p: p for p in ROW_PARTS}
        self.parts = [ROW_PARTS.index(p) for p in ROW_PARTS if p in columns]
        names = [columns[ROW_PARTS[i]] for i in self.parts]
        values = [sql.SQL("%s::jsonb" if ROW_PARTS[i] == "value" else "%s") for i in self.parts]
        upsert = settings.get("upsert_key")
        conflict: sql.Composable
        if upsert:
            rest = [c for c in names if c not in upsert]
            conflict = sql.SQL(" ON CONFLICT ({}) DO ").format(sql.SQL(", ").join(map(sql.Identifier, upsert)))
            conflict += sql.SQL("UPDATE SET {}").format(sql.SQL(", ").join(
                sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in rest)) \
                if rest else sql.SQL("NOTHING")
        elif "record_id" in columns:
            conflict = sql.SQL(" ON CONFLICT ({}) DO NOTHING").format(sql.Identifier(columns["record_id"]))
        else:
            conflict = sql.SQL("")
        self.insert = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            self.table, sql.SQL(", ").join(map(sql.Identifier, names)), sql.SQL(", ").join(values)) + conflict
        self.progress_key = ""
        self.conn: Any = None
        self.sink = ""
        self.range_id = 0

    def _where(self) -> str:
        return f"postgres sink {self.sink!r} ({redact(self.url)})"

    def _connect(self) -> Any:
        if self.conn is None or self.conn.closed:
            try:
                conn = psycopg.connect(self.url, connect_timeout=5, autocommit=False)
                try:
                    conn.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                                 (str(STALLED_TRANSACTION_MS),))
                    conn.commit()
                except psycopg.Error:
                    conn.close()
                    raise
                self.conn = conn
            except psycopg.Error as exc:
                raise ConnectorError(f"{self._where()}: cannot connect: {_message(exc, self.url)}") from None
        return self.conn

    def open(self, sink: str, range_id: int, token: int) -> int:
        # The progress row is per (sink, table): another deployment's sink of the same
        # name writing another table keeps its own position.
        self.sink, self.range_id = sink, range_id
        self.progress_key = f"{sink}@{self.table_name}"
        conn = self._connect()
        try:
            with conn.transaction():
                if self.create:
                    conn.execute(sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {} (record_id TEXT PRIMARY KEY, key TEXT NOT NULL, "
                        "window_start BIGINT, window_end BIGINT, value JSONB NOT NULL, ts BIGINT NOT NULL, "
                        "position BIGINT NOT NULL)").format(self.table))
                conn.execute(sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (sink TEXT NOT NULL, range_id INT NOT NULL, "
                    "token BIGINT NOT NULL, position BIGINT NOT NULL, PRIMARY KEY (sink, range_id))"
                ).format(sql.Identifier(PROGRESS_TABLE)))
        except psycopg.errors.UniqueViolation:
            pass  # another owner created them at the same moment (CREATE IF NOT EXISTS races)
        except psycopg.Error as exc:
            self._reset()
            raise ConnectorError(f"{self._where()}: {_message(exc, self.url)}") from None
        return self.write_batch([], token)

    def write_batch(self, records: Sequence[tuple[int, Record]], token: int) -> int:
        conn = self._connect()
        try:
            with conn.transaction():
                conn.execute(sql.SQL(
                    "INSERT INTO {} (sink, range_id, token, position) VALUES (%s, %s, %s, 0) "
                    "ON CONFLICT (sink, range_id) DO NOTHING").format(sql.Identifier(PROGRESS_TABLE)),
                    (self.progress_key, self.range_id, token))
                row = conn.execute(sql.SQL(
                    "SELECT token, position FROM {} WHERE sink = %s AND range_id = %s FOR UPDATE"
                ).format(sql.Identifier(PROGRESS_TABLE)), (self.progress_key, self.range_id)).fetchone()
                stored_token, position = int(row[0]), int(row[1])
                if stored_token > token:
                    raise FencedError(sink_node(self.sink), self.range_id, token, stored_token)
                rows = [row_values(p, r) for p, r in records if p > position]
                if rows:
                    with conn.cursor() as cur:
                        cur.executemany(self.insert, [tuple(row[i] for i in self.parts) for row in rows])
                    position = max(position, records[-1][0])
                conn.execute(sql.SQL("UPDATE {} SET token = %s, position = %s WHERE sink = %s AND range_id = %s"
                                     ).format(sql.Identifier(PROGRESS_TABLE)),
                             (token, position, self.progress_key, self.range_id))
            return position
        except psycopg.Error as exc:
            self._reset()
            raise ConnectorError(f"{self._where()}: {_message(exc, self.url)}") from None

    def _reset(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except psycopg.Error:
                pass
            self.conn = None

    def close(self) -> None:
        self._reset()


def _message(exc: BaseException, url: str) -> str:
    """psycopg's message, never with the URL's password in it."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    password = psycopg.conninfo.conninfo_to_dict(url).get("password") if "://" in url else None
    return text.replace(str(password), "***") if password else text
