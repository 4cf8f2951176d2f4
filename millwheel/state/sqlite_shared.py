"""The SQLite store's tables that are not one key range's data: the durable stream
log (``stream_log``: sinks, Subscribe, backfill; ``log_starts``: how far retention
removed it, millwheel.runtime.retention), the watermark reports
(``watermarks``, per node and range, token-fenced) and the small metadata (``meta``:
the service's registry, epoch-fenced by the controller lease).

They are not a key range's data, so they stand apart from
:mod:`millwheel.state.sqlite_store`, which holds what a range's owner does to its
range (ownership, the checkpoint, acks, the reads for recovery).

:class:`SQLiteShared` is a mixin of :class:`millwheel.state.sqlite_store.SQLiteStore`.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Callable, Mapping, Sequence, TypeVar

from millwheel.record import Record
from millwheel.state.lease import check_meta_name
from millwheel.state.sqlite_schema import _insert_rows

_MAX_SEQ = 2**63 - 1

T = TypeVar("T")


class SQLiteShared:
    """Stream log, watermarks and metadata (a mixin of SQLiteStore)."""

    _db: sqlite3.Connection
    _lock: threading.RLock
    _write: Callable[[Callable[[], T]], T]
    _fence: Callable[[str, int, int], None]
    _check_epoch: Callable[[str, int | None], None]

    # -- stream log ------------------------------------------------------------
    def append_log(self, stream: str, records: Sequence[Record]) -> int:
        def txn() -> int:
            before = self._db.total_changes
            rows: list[object] = []
            for r in records:
                rows += (r.record_id, r.key, r.value, r.timestamp)
            _insert_rows(
                self._db, "INSERT OR IGNORE INTO stream_log (stream, record_id, key, value, ts)",
                (stream,), 4, rows,
            )
            return self._db.total_changes - before

        return self._write(txn)

    def read_log(self, stream: str, after_seq: int, limit: int) -> list[tuple[int, Record]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, record_id, key, value, ts FROM stream_log "
                "WHERE stream=? AND seq > ? ORDER BY seq LIMIT ?",
                (stream, after_seq, limit),
            ).fetchall()
        return [(seq, Record(k, v, ts, rid)) for seq, rid, k, v, ts in rows]

    def log_end(self, stream: str, after_seq: int = 0, upto_seq: int | None = None) -> tuple[int, int]:
        upto = _MAX_SEQ if upto_seq is None else upto_seq
        with self._lock:
            last, count = self._db.execute(
                "SELECT max(seq), count(*) FROM stream_log WHERE stream=? AND seq > ? AND seq <= ?",
                (stream, after_seq, upto),
            ).fetchone()
        return (int(last) if last is not None else after_seq), int(count)

    def log_stats(self, stream: str, after_seq: int, limit: int) -> tuple[int, int, int]:
        with self._lock:
            rows, size, last = self._db.execute(
                "SELECT count(*), total(length(CAST(key AS BLOB)) + length(value) "
                "+ length(CAST(record_id AS BLOB)) + 8), max(seq) FROM (SELECT seq, key, value, "
                "record_id FROM stream_log WHERE stream=? AND seq > ? ORDER BY seq LIMIT ?)",
                (stream, after_seq, limit),
            ).fetchone()
        return int(rows), int(size), int(last) if rows else after_seq

    def trim_log(self, stream: str, through_seq: int, max_rows: int) -> int:
        def txn() -> int:
            row = self._db.execute(
                "SELECT count(*), max(seq) FROM (SELECT seq FROM stream_log WHERE stream=? "
                "AND seq <= ? ORDER BY seq LIMIT ?)", (stream, through_seq, max_rows),
            ).fetchone()
            if not row[0]:
                return 0
            last = int(row[1])
            self._db.execute("DELETE FROM stream_log WHERE stream=? AND seq <= ?", (stream, last))
            self._db.execute(
                "INSERT INTO log_starts VALUES (?, ?) ON CONFLICT (stream) "
                "DO UPDATE SET through_seq = max(through_seq, excluded.through_seq)",
                (stream, last),
            )
            return int(row[0])

        return self._write(txn)

    def log_start(self, stream: str) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT through_seq FROM log_starts WHERE stream=?", (stream,)
            ).fetchone()
        return int(row[0]) if row else 0

    # -- watermarks ----------------------------------------------------------
    def report_watermark(self, node: str, range_id: int, token: int, watermark: int) -> int:
        def txn() -> int:
            self._fence(node, range_id, token)
            self._db.execute(
                "INSERT INTO watermarks VALUES (?, ?, ?) ON CONFLICT (node, range_id) "
                "DO UPDATE SET watermark = max(watermark, excluded.watermark)",
                (node, range_id, watermark),
            )
            row = self._db.execute(
                "SELECT watermark FROM watermarks WHERE node=? AND range_id=?", (node, range_id)
            ).fetchone()
            return int(row[0])

        return self._write(txn)

    def read_watermarks(self, node: str) -> dict[int, int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT range_id, watermark FROM watermarks WHERE node=?", (node,)
            ).fetchall()
        return {int(r): int(w) for r, w in rows}

    # -- metadata ------------------------------------------------------------
    def put_meta(self, name: str, value: bytes | None, epoch: int | None = None) -> None:
        check_meta_name(name)

        def txn() -> None:
            self._check_epoch(f"put_meta {name[:100]!r}", epoch)
            if value is None:
                self._db.execute("DELETE FROM meta WHERE name=?", (name,))
            else:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

        self._write(txn)

    def put_metas(self, entries: Mapping[str, bytes | None], epoch: int | None = None) -> None:
        items = list(entries.items())
        for name, _value in items:
            check_meta_name(name)
        deletes = [(name,) for name, value in items if value is None]
        sets = [(name, value) for name, value in items if value is not None]

        def txn() -> None:
            self._check_epoch(f"put_metas of {len(items)} entries", epoch)
            if deletes:
                self._db.executemany("DELETE FROM meta WHERE name=?", deletes)
            if sets:
                self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", sets)

        self._write(txn)

    def insert_meta(self, name: str, value: bytes) -> bool:
        check_meta_name(name)

        def txn() -> bool:
            cur = self._db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT (name) DO NOTHING", (name, value))
            if cur.rowcount == 1:
                return True
            row = self._db.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()
            return row is not None and bytes(row[0]) == value

        return self._write(txn)

    def get_meta(self, name: str) -> bytes | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE name=?", (name,)).fetchone()
        return bytes(row[0]) if row else None

    def list_meta(self, prefix: str) -> dict[str, bytes]:
        with self._lock:
            rows = self._db.execute(
                "SELECT name, value FROM meta WHERE substr(name, 1, ?) = ? ORDER BY name",
                (len(prefix), prefix),
            ).fetchall()
        return {name: bytes(value) for name, value in rows}
