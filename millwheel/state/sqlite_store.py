"""The embedded default store: one SQLite file in WAL mode.

Every token-fenced write is one ``BEGIN IMMEDIATE`` transaction that first reads the
range's token and only then writes, so the fence check and the write are atomic with
respect to every other process using the same file. ``synchronous=NORMAL`` (the
default here) survives a process crash (kill -9) without losing a committed
checkpoint; ``?synchronous=FULL`` in the URL also survives power loss.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from millwheel.errors import CorruptDataError, FencedError, StoreError
from millwheel.record import Record, TimeDomain, Timer
from millwheel.state.protocol import RECENT_ERRORS, Checkpoint, ErrorReport, Production

T = TypeVar("T")

# Why the schema is shaped this way (each b-tree written per record costs; docs/bench.md):
# * outbox ``seq`` is a plain rowid, not AUTOINCREMENT (no sqlite_sequence write per
#   insert): a new row still gets max(seq) + 1, so ``ORDER BY seq`` is checkpoint order.
# * consumed IDs are one row each (the dedup lookup), but their expiry goes through
#   ``seen_batches``, one row per checkpoint listing its IDs (a JSON array), instead
#   of a second index entry per ID.
# Files written by older versions are migrated when opened (:func:`_migrate`).

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, token INTEGER NOT NULL,
    PRIMARY KEY (computation, range_id));
CREATE TABLE IF NOT EXISTS state (
    computation TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,
    PRIMARY KEY (computation, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS timers (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, key TEXT NOT NULL,
    tag TEXT NOT NULL, time INTEGER NOT NULL, domain TEXT NOT NULL, hold INTEGER NOT NULL,
    PRIMARY KEY (computation, key, tag));
CREATE INDEX IF NOT EXISTS timers_by_range ON timers (computation, range_id);
CREATE TABLE IF NOT EXISTS outbox (
    producer TEXT NOT NULL, range_id INTEGER NOT NULL, seq INTEGER PRIMARY KEY,
    consumer TEXT NOT NULL, stream TEXT NOT NULL, record_id TEXT NOT NULL,
    key TEXT NOT NULL, value BLOB NOT NULL, ts INTEGER NOT NULL,
    UNIQUE (producer, range_id, consumer, record_id));
CREATE TABLE IF NOT EXISTS seen_ids (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, record_id TEXT NOT NULL,
    seen_at INTEGER NOT NULL, PRIMARY KEY (computation, range_id, record_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS seen_batches (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, seen_at INTEGER NOT NULL,
    ids TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS seen_batches_by_time ON seen_batches (computation, range_id, seen_at);
CREATE TABLE IF NOT EXISTS stream_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, record_id TEXT NOT NULL,
    key TEXT NOT NULL, value BLOB NOT NULL, ts INTEGER NOT NULL,
    UNIQUE (stream, record_id));
CREATE INDEX IF NOT EXISTS stream_log_by_stream ON stream_log (stream, seq);
CREATE TABLE IF NOT EXISTS watermarks (
    node TEXT NOT NULL, range_id INTEGER NOT NULL, watermark INTEGER NOT NULL,
    PRIMARY KEY (node, range_id));
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS attempts (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, item_id TEXT NOT NULL,
    attempts INTEGER NOT NULL, error BLOB NOT NULL,
    PRIMARY KEY (computation, range_id, item_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS error_counts (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, name TEXT NOT NULL,
    count INTEGER NOT NULL, PRIMARY KEY (computation, range_id, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS error_log (
    seq INTEGER PRIMARY KEY, computation TEXT NOT NULL, range_id INTEGER NOT NULL,
    error BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS error_log_by_range ON error_log (computation, range_id, seq);
"""


def _json_list(items: Sequence[str]) -> str | None:
    """``items`` as a JSON array SQLite's ``json_each`` returns verbatim, or None when it
    would not (``json_each`` cuts a string at an escaped NUL)."""
    text = json.dumps(items if isinstance(items, list) else list(items), ensure_ascii=False)
    return None if "\\u0000" in text else text


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a file written by an older version to this schema (idempotent, and safe
    with several processes opening the file at once)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        old_index = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='index' AND name='seen_ids_by_time'"
        ).fetchone()
        if old_index:  # consumed IDs indexed by time -> a seen_batches row per (range, time)
            db.execute(
                "INSERT INTO seen_batches SELECT computation, range_id, seen_at, "
                "json_group_array(record_id) FROM seen_ids GROUP BY computation, range_id, seen_at"
            )
            db.execute("DROP INDEX seen_ids_by_time")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


_MAX_ROWS = 128  # rows per multi-row INSERT: at most 2 + 128 * 6 parameters (< 999)


@functools.lru_cache(maxsize=256)
def _insert_sql(head: str, n_fixed: int, width: int, rows: int) -> str:
    """``head`` + ``VALUES`` for ``rows`` rows: the first ``n_fixed`` columns of every row
    are the shared parameters ?1..?n_fixed, the next ``width`` are the row's own."""
    fixed = ",".join(f"?{i + 1}" for i in range(n_fixed))
    tuples = []
    for r in range(rows):
        base = n_fixed + r * width
        own = ",".join(f"?{base + i + 1}" for i in range(width))
        tuples.append(f"({fixed},{own})" if fixed else f"({own})")
    return f"{head} VALUES {','.join(tuples)}"


def _insert_rows(
    db: sqlite3.Connection, head: str, fixed: tuple[object, ...], width: int, flat: list[object]
) -> None:
    """Insert ``len(flat) // width`` rows, many per statement.

    ``executemany`` runs one statement per row through the sqlite3 module, which cost
    more than the b-tree insert itself; a statement of up to ``_MAX_ROWS`` rows does not.
    Rows go in in order (so rowids follow it); chunk sizes are powers of two, so a few
    prepared statements per table serve every batch size.
    """
    n = len(flat) // width
    done = 0
    while done < n:
        rows = min(_MAX_ROWS, 1 << ((n - done).bit_length() - 1))
        db.execute(
            _insert_sql(head, len(fixed), width, rows),
            (*fixed, *flat[done * width : (done + rows) * width]),
        )
        done += rows


class SQLiteStore:
    """A :class:`~millwheel.state.protocol.StateStore` in one SQLite file."""

    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL", url: str = "") -> None:
        self.url = url or f"sqlite:///{path}"
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        if synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise StoreError(f"{self.url}: synchronous must be OFF, NORMAL, FULL or EXTRA")
        self._lock = threading.RLock()
        self._db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.execute("PRAGMA busy_timeout=30000")
        # Checkpoint the WAL into the database every 64 MB instead of every 4 MB: hot
        # pages (outbox, seen IDs) are rewritten by every commit, and each checkpoint
        # writes and fsyncs them again. Durability is unchanged (docs/bench.md).
        self._db.execute("PRAGMA wal_autocheckpoint=16384")
        self._db.execute("PRAGMA cache_size=-32768")  # 32 MB page cache (default 2 MB)
        # Some builds (Debian's, this machine's) zero deleted content by default, so every
        # ack rewrote the outbox pages it freed. That is privacy, not durability; it is
        # off in SQLite's own default build.
        self._db.execute("PRAGMA secure_delete=OFF")
        self._db.executescript(_SCHEMA)
        _migrate(self._db)

    # -- helpers -------------------------------------------------------------
    def _fence(self, computation: str, range_id: int, token: int) -> None:
        row = self._db.execute(
            "SELECT token FROM tokens WHERE computation=? AND range_id=?", (computation, range_id)
        ).fetchone()
        current = row[0] if row else 0
        if token != current or token <= 0:
            raise FencedError(computation, range_id, token, current)

    def _write(self, fn: Callable[[], T]) -> T:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"{self.url}: cannot begin a transaction: {exc}") from exc
            try:
                result = fn()
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return result

    # -- ownership -----------------------------------------------------------
    def acquire(self, computation: str, range_id: int) -> int:
        def txn() -> int:
            self._db.execute(
                "INSERT INTO tokens VALUES (?, ?, 1) ON CONFLICT (computation, range_id) "
                "DO UPDATE SET token = token + 1",
                (computation, range_id),
            )
            return self.current_token(computation, range_id)

        return self._write(txn)

    def current_token(self, computation: str, range_id: int) -> int:
        with self._lock:
            row = self._db.execute(
                "SELECT token FROM tokens WHERE computation=? AND range_id=?",
                (computation, range_id),
            ).fetchone()
        return int(row[0]) if row else 0

    # -- the checkpoint --------------------------------------------------------
    def checkpoint(self, cp: Checkpoint) -> None:
        """Apply one batch atomically.

        1. Check the range's sequencer token (fenced writers stop here).
        2. Write and delete per-key state.
        3. Apply timer clears, then timer sets.
        4. Append strong productions to the range's outbox.
        5. Remember the consumed record IDs.
        All five in one transaction: a crash leaves all or nothing.
        """
        db = self._db
        comp, rid = cp.computation, cp.range_id

        def txn() -> None:
            self._fence(comp, rid, cp.token)  # 1
            writes: list[object] = []  # 2
            deletes = []
            for k, v in cp.state_writes.items():
                if v is None:
                    deletes.append((comp, k))
                else:
                    writes += (k, v)
            if writes:
                _insert_rows(db, "INSERT OR REPLACE INTO state", (comp,), 2, writes)
            if deletes:
                db.executemany("DELETE FROM state WHERE computation=? AND key=?", deletes)
            if cp.timer_clears:  # 3
                db.executemany(
                    "DELETE FROM timers WHERE computation=? AND key=? AND tag=?",
                    [(comp, k, t) for k, t in cp.timer_clears],
                )
            if cp.timer_sets:
                timers: list[object] = []
                for t in cp.timer_sets:
                    timers += (t.key, t.tag, t.time, t.domain.value, int(t.hold))
                _insert_rows(db, "INSERT OR REPLACE INTO timers", (comp, rid), 5, timers)
            if cp.productions:  # 4
                rows: list[object] = []
                for p in cp.productions:
                    r = p.record
                    rows += (p.consumer, p.stream, r.record_id, r.key, r.value, r.timestamp)
                _insert_rows(
                    db,
                    "INSERT OR IGNORE INTO outbox "
                    "(producer, range_id, consumer, stream, record_id, key, value, ts)",
                    (comp, rid), 6, rows,
                )
            if cp.consumed_ids:  # 5
                ids = _json_list(cp.consumed_ids)
                if ids is None:
                    db.executemany(
                        "INSERT OR IGNORE INTO seen_ids VALUES (?, ?, ?, ?)",
                        [(comp, rid, i, cp.now_us) for i in cp.consumed_ids],
                    )
                    ids = json.dumps(list(cp.consumed_ids), ensure_ascii=False)
                else:  # one statement: no per-ID round trip through the sqlite3 module
                    db.execute(
                        "INSERT OR IGNORE INTO seen_ids SELECT ?, ?, value, ? FROM json_each(?)",
                        (comp, rid, cp.now_us, ids),
                    )
                db.execute("INSERT INTO seen_batches VALUES (?, ?, ?, ?)", (comp, rid, cp.now_us, ids))
            if cp.resolved or cp.counters or cp.errors:
                self._apply_errors(cp)

        self._write(txn)

    def _apply_errors(self, cp: Checkpoint) -> None:
        """The error policy's part of a checkpoint (inside its transaction)."""
        db, comp, rid = self._db, cp.computation, cp.range_id
        db.executemany(
            "DELETE FROM attempts WHERE computation=? AND range_id=? AND item_id=?",
            [(comp, rid, i) for i in cp.resolved],
        )
        db.executemany(
            "INSERT INTO error_counts VALUES (?, ?, ?, ?) ON CONFLICT (computation, range_id, name) "
            "DO UPDATE SET count = count + excluded.count",
            [(comp, rid, name, n) for name, n in cp.counters.items()],
        )
        if cp.errors:
            db.executemany("INSERT INTO error_log (computation, range_id, error) VALUES (?, ?, ?)",
                           [(comp, rid, e) for e in cp.errors])
            db.execute(
                "DELETE FROM error_log WHERE computation=?1 AND range_id=?2 AND seq <= ("
                "SELECT seq FROM error_log WHERE computation=?1 AND range_id=?2 "
                "ORDER BY seq DESC LIMIT 1 OFFSET ?3)",
                (comp, rid, RECENT_ERRORS),
            )

    # -- failing user code ---------------------------------------------------------
    def bump_attempts(
        self, computation: str, range_id: int, token: int, item_id: str, error: bytes
    ) -> int:
        def txn() -> int:
            self._fence(computation, range_id, token)
            self._db.execute(
                "INSERT INTO attempts VALUES (?, ?, ?, 1, ?) ON CONFLICT "
                "(computation, range_id, item_id) DO UPDATE SET attempts = attempts + 1, "
                "error = excluded.error",
                (computation, range_id, item_id, error),
            )
            row = self._db.execute(
                "SELECT attempts FROM attempts WHERE computation=? AND range_id=? AND item_id=?",
                (computation, range_id, item_id),
            ).fetchone()
            return int(row[0])

        return self._write(txn)

    def read_errors(self, computation: str, range_id: int) -> ErrorReport:
        with self._lock:
            db = self._db
            attempts = db.execute(
                "SELECT item_id, attempts, error FROM attempts WHERE computation=? AND range_id=?",
                (computation, range_id),
            ).fetchall()
            counters = db.execute(
                "SELECT name, count FROM error_counts WHERE computation=? AND range_id=?",
                (computation, range_id),
            ).fetchall()
            recent = db.execute(
                "SELECT error FROM error_log WHERE computation=? AND range_id=? "
                "ORDER BY seq DESC LIMIT ?",
                (computation, range_id, RECENT_ERRORS),
            ).fetchall()
        return ErrorReport(
            attempts={i: (int(n), bytes(e)) for i, n, e in attempts},
            counters={name: int(n) for name, n in counters},
            recent=[bytes(row[0]) for row in recent],
        )

    def ack(
        self, producer: str, range_id: int, token: int, acked: Sequence[tuple[str, str]]
    ) -> None:
        by_consumer: dict[str, list[str]] = {}
        for consumer, record_id in acked:
            same = by_consumer.get(consumer)
            if same is None:
                by_consumer[consumer] = [record_id]
            else:
                same.append(record_id)

        def txn() -> None:
            self._fence(producer, range_id, token)
            for consumer, record_ids in by_consumer.items():
                ids = _json_list(record_ids)
                if ids is None:
                    self._db.executemany(
                        "DELETE FROM outbox WHERE producer=? AND range_id=? AND consumer=? "
                        "AND record_id=?",
                        [(producer, range_id, consumer, r) for r in record_ids],
                    )
                else:
                    self._db.execute(
                        "DELETE FROM outbox WHERE producer=? AND range_id=? AND consumer=? "
                        "AND record_id IN (SELECT value FROM json_each(?))",
                        (producer, range_id, consumer, ids),
                    )

        self._write(txn)

    # -- reads ---------------------------------------------------------------
    def read_state(
        self, computation: str, keys: Iterable[str], range_id: int | None = None
    ) -> dict[str, bytes]:
        keys = list(keys)
        out: dict[str, bytes] = {}
        with self._lock:
            for start in range(0, len(keys), 500):
                chunk = keys[start : start + 500]
                marks = ",".join("?" * len(chunk))
                for key, value in self._db.execute(
                    f"SELECT key, value FROM state WHERE computation=? AND key IN ({marks})",
                    (computation, *chunk),
                ):
                    if not isinstance(value, bytes):
                        raise CorruptDataError(
                            f"{self.url}: state of {computation!r} key {key!r} is "
                            f"{type(value).__name__}, not bytes"
                        )
                    out[key] = value
        return out

    def _timers(self, sql: str, args: tuple[object, ...]) -> list[Timer]:
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        timers = []
        for key, tag, time, domain, hold in rows:
            try:
                timers.append(Timer(key, tag, int(time), TimeDomain(domain), bool(hold)))
            except ValueError as exc:
                raise CorruptDataError(f"{self.url}: timer {key!r}/{tag!r}: {exc}") from None
        return timers

    def read_timers(self, computation: str, range_id: int) -> list[Timer]:
        return self._timers(
            "SELECT key, tag, time, domain, hold FROM timers WHERE computation=? AND range_id=?",
            (computation, range_id),
        )

    def read_key_timers(
        self, computation: str, key: str, range_id: int | None = None
    ) -> list[Timer]:
        return self._timers(
            "SELECT key, tag, time, domain, hold FROM timers WHERE computation=? AND key=? "
            "ORDER BY time",
            (computation, key),
        )

    def read_outbox(self, producer: str, range_id: int) -> list[Production]:
        with self._lock:
            rows = self._db.execute(
                "SELECT consumer, stream, record_id, key, value, ts FROM outbox "
                "WHERE producer=? AND range_id=? ORDER BY seq",
                (producer, range_id),
            ).fetchall()
        return [Production(c, s, Record(k, v, ts, r)) for c, s, r, k, v, ts in rows]

    def contains_ids(self, computation: str, range_id: int, ids: Sequence[str]) -> set[str]:
        found: set[str] = set()
        with self._lock:
            for start in range(0, len(ids), 500):
                chunk = list(ids[start : start + 500])
                marks = ",".join("?" * len(chunk))
                found.update(
                    row[0]
                    for row in self._db.execute(
                        "SELECT record_id FROM seen_ids WHERE computation=? AND range_id=? "
                        f"AND record_id IN ({marks})",
                        (computation, range_id, *chunk),
                    )
                )
        return found

    def iter_ids(self, computation: str, range_id: int) -> Iterator[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record_id FROM seen_ids WHERE computation=? AND range_id=?",
                (computation, range_id),
            ).fetchall()
        return (row[0] for row in rows)

    def expire_ids(self, computation: str, range_id: int, token: int, older_than_us: int) -> int:
        def txn() -> int:
            self._fence(computation, range_id, token)
            db = self._db
            batches = db.execute(
                "SELECT rowid, ids FROM seen_batches WHERE computation=? AND range_id=? "
                "AND seen_at < ?",
                (computation, range_id, older_than_us),
            ).fetchall()
            removed = 0
            for rowid, ids in batches:
                # seen_at < bound as well: an ID consumed again keeps its first time
                sql = "DELETE FROM seen_ids WHERE computation=? AND range_id=? AND seen_at < ? AND "
                listed = json.loads(ids)
                if _json_list(listed) is None:
                    cur = db.executemany(
                        sql + "record_id=?",
                        [(computation, range_id, older_than_us, i) for i in listed],
                    )
                else:
                    cur = db.execute(
                        sql + "record_id IN (SELECT value FROM json_each(?))",
                        (computation, range_id, older_than_us, ids),
                    )
                removed += max(cur.rowcount, 0)
                db.execute("DELETE FROM seen_batches WHERE rowid=?", (rowid,))
            return removed

        return self._write(txn)

    def list_keys(self, computation: str, after: str | None, limit: int) -> list[str]:
        # ``after`` None means from the very first key, the empty key "" included.
        bound, args = ("", (computation, limit)) if after is None else ("AND key > ? ", (computation, after, limit))
        with self._lock:
            rows = self._db.execute(
                f"SELECT key FROM state WHERE computation=? {bound}ORDER BY key LIMIT ?", args
            ).fetchall()
        return [row[0] for row in rows]

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
    def put_meta(self, name: str, value: bytes | None) -> None:
        def txn() -> None:
            if value is None:
                self._db.execute("DELETE FROM meta WHERE name=?", (name,))
            else:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

        self._write(txn)

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

    def close(self) -> None:
        with self._lock:
            self._db.close()

