"""The SQLite store's file: schema, migrations of older files, opening the connection
(pragmas), the fence check and the write transaction, and multi-row INSERT building.

:class:`SQLiteFile` is the base of :class:`millwheel.state.sqlite_store.SQLiteStore`,
which holds the StateStore operations (some in its mixins: sqlite_errors, sqlite_shared,
sqlite_lease).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence, TypeVar

from millwheel.errors import FencedError, StoreError
from millwheel.state.sqlite_checkpointer import Checkpointer

T = TypeVar("T")
log = logging.getLogger("millwheel.store")

# Why the schema is shaped this way (each b-tree written per record costs; docs/bench.md):
# * outbox ``seq`` is a plain rowid, not AUTOINCREMENT (no sqlite_sequence write per
#   insert): a new row still gets max(seq) + 1, so ``ORDER BY seq`` is checkpoint order.
# * consumed IDs are one row each, keyed by (range, generation, ID): a checkpoint's IDs
#   go into its generation (``Checkpoint.ids_generation``, a span of processing time
#   the range worker picks, 1/16 of the retention), and expiry deletes whole
#   generations, one key range of the b-tree each, instead of looking every ID up
#   again (issue 31: per-ID expiry cost as much as the insert and halved a soak's
#   sustained capacity). ``consumed_gens`` lists each range's generations with the
#   time of their newest ID, so a lookup probes only the live generations (~17).
# * window buffers (``buffers``) are one row per appended chunk, keyed by (range,
#   name, seq) through the index; ``seq`` is a plain rowid, so appending costs one
#   index insert whatever the buffer holds, and ``ORDER BY seq`` is append order.
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
CREATE TABLE IF NOT EXISTS consumed_ids (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, gen INTEGER NOT NULL,
    record_id TEXT NOT NULL, PRIMARY KEY (computation, range_id, gen, record_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS consumed_gens (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, gen INTEGER NOT NULL,
    last_at INTEGER NOT NULL, PRIMARY KEY (computation, range_id, gen)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS stream_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, record_id TEXT NOT NULL,
    key TEXT NOT NULL, value BLOB NOT NULL, ts INTEGER NOT NULL,
    UNIQUE (stream, record_id));
CREATE INDEX IF NOT EXISTS stream_log_by_stream ON stream_log (stream, seq);
CREATE TABLE IF NOT EXISTS log_starts (stream TEXT PRIMARY KEY, through_seq INTEGER NOT NULL);
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
CREATE TABLE IF NOT EXISTS buffers (
    seq INTEGER PRIMARY KEY, computation TEXT NOT NULL, range_id INTEGER NOT NULL,
    name TEXT NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS buffers_by_name ON buffers (computation, range_id, name, seq);
"""


def _json_list(items: Sequence[str]) -> str | None:
    """``items`` as a JSON array SQLite's ``json_each`` returns verbatim, or None when it
    would not (``json_each`` cuts a string at an escaped NUL)."""
    text = json.dumps(items if isinstance(items, list) else list(items), ensure_ascii=False)
    return None if "\\u0000" in text else text


#: The generation width given to consumed IDs of a file written before generations
#: existed (their exact times are grouped by the minute; each is kept that much longer
#: at most).
MIGRATED_GENERATION_US = 60_000_000


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a file written by an older version to this schema (idempotent, and safe
    with several processes opening the file at once)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        old = db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='seen_ids'").fetchone()
        if old:  # consumed IDs by (range, ID) with their time -> by (range, generation, ID)
            g = MIGRATED_GENERATION_US
            db.execute(
                "INSERT OR IGNORE INTO consumed_ids SELECT computation, range_id, "
                f"seen_at - (seen_at % {g}), record_id FROM seen_ids"
            )
            db.execute(
                "INSERT INTO consumed_gens SELECT computation, range_id, seen_at - (seen_at % "
                f"{g}), max(seen_at) FROM seen_ids WHERE true GROUP BY 1, 2, 3 "
                "ON CONFLICT DO UPDATE SET last_at = max(last_at, excluded.last_at)"
            )
            db.execute("DROP TABLE seen_ids")
            db.execute("DROP TABLE IF EXISTS seen_batches")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


#: The write-ahead log file is cut back to this after it restarts (journal_size_limit).
JOURNAL_SIZE_LIMIT = 16 * 1024 * 1024
#: Past this, a long cleanup copies the log between its transactions (SQLiteStore.expire_ids).
WAL_SOFT_LIMIT = 4 * 1024 * 1024

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


def _wal_mode(db: sqlite3.Connection, timeout_s: float) -> None:
    """``PRAGMA journal_mode=WAL``, retried while another connection holds the file's
    lock: switching the mode does not wait on the busy handler, so a process opening the
    file while another opens it or checkpoints it (two controllers started together)
    failed at once with "database is locked"."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _private_file(path: str) -> None:
    """Create the store's file readable and writable by its owner alone (0600, whatever
    the umask) before SQLite opens it: SQLite gives the -wal and -shm files it creates
    beside a database the database file's mode, so they are 0600 too. The file holds
    every key's state, the records in flight and the registry. A file that exists keeps
    its mode (an operator may have chosen one, e.g. for a backup group); one that other
    users can read is reported each time it is opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            log.warning("store file %s has mode %04o: other users may read all of its state; "
                        "chmod 600 %s (SQLite gives new -wal and -shm files the same mode)", path, mode, path)
        return
    except OSError:
        return  # SQLite's own open says what is wrong
    try:
        os.fchmod(fd, 0o600)  # a umask such as 0277 would leave it unwritable
    finally:
        os.close(fd)


class SQLiteFile:
    """One SQLite file opened for the store: connection, lock, fence and transactions."""


    def __init__(self, path: str | Path, *, synchronous: str = "NORMAL", url: str = "",
                 wal_checkpointer: bool = True) -> None:
        self.url = url or f"sqlite:///{path}"
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            _private_file(self.path)
        if synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise StoreError(f"{self.url}: synchronous must be OFF, NORMAL, FULL or EXTRA")
        self._lock = threading.RLock()
        self._grouped = False  # inside write_group
        self._db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        _wal_mode(self._db, 30.0)
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.execute("PRAGMA busy_timeout=30000")
        # Checkpoint the WAL into the database every 64 MB instead of every 4 MB: hot
        # pages (outbox, seen IDs) are rewritten by every commit, and each checkpoint
        # writes and fsyncs them again. Durability is unchanged (docs/bench.md).
        self._db.execute("PRAGMA wal_autocheckpoint=16384")
        # The log file is reused, not shrunk, after a checkpoint: one large transaction
        # left it large for good (issue 27). With a limit, the first commit after the log
        # starts over cuts the file back to it (an ftruncate, only when it is larger).
        # 16 MiB is above what a backlog run's log reaches between restarts (~10 MB), so
        # the hot path never pays it.
        self._db.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
        self._db.execute("PRAGMA cache_size=-32768")  # 32 MB page cache (default 2 MB)
        # Some builds (Debian's, this machine's) zero deleted content by default, so every
        # ack rewrote the outbox pages it freed. That is privacy, not durability; it is
        # off in SQLite's own default build.
        self._db.execute("PRAGMA secure_delete=OFF")
        self._db.executescript(_SCHEMA)
        _migrate(self._db)
        # The log is copied into the database beside the writer, not inside its commits
        # (sqlite_checkpointer.py: those copies were the p95 of record latency).
        # Off (``?wal_checkpointer=off``): the commit that fills the log copies it, as
        # SQLite does by default (a little more backlog rate, a longer tail).
        on = wal_checkpointer and self.path != ":memory:"
        self._checkpointer = Checkpointer(self.path) if on else None

    # -- helpers -------------------------------------------------------------
    def _relieve_wal(self) -> None:
        """Between the transactions of a long cleanup (``expire_ids``): once the log is
        past :data:`WAL_SOFT_LIMIT`, copy it into the database now (PASSIVE: waits for no
        one), so the next transaction starts the log over instead of growing it."""
        if self.path == ":memory:":
            return
        try:
            if os.path.getsize(self.path + "-wal") <= WAL_SOFT_LIMIT:
                return
            # A copy that could not finish (the checkpointer thread's own copy running, a
            # reader on an old snapshot: both slower on a loaded machine) is tried again
            # for up to ~0.1 s, the store's lock released in between.
            for _ in range(20):
                with self._lock:
                    busy, frames, copied = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if not busy and copied >= frames:
                    return
                time.sleep(0.005)
        except (OSError, sqlite3.Error):
            pass  # the next transaction's commit, or the checkpointer, copies it instead

    def _fence(self, computation: str, range_id: int, token: int) -> None:
        row = self._db.execute(
            "SELECT token FROM tokens WHERE computation=? AND range_id=?", (computation, range_id)
        ).fetchone()
        current = row[0] if row else 0
        if token != current or token <= 0:
            raise FencedError(computation, range_id, token, current)

    def _write(self, fn: Callable[[], T]) -> T:
        """``fn`` in a write transaction of its own, or in the open write group's."""
        with self.write_group():
            return fn()

    @contextmanager
    def write_group(self) -> Iterator[None]:
        """Make the writes of the block one transaction: all of them or, if the block
        raises, none. The local runner groups the writes of a step (runtime/grouped.py):
        one commit, and outbox rows written and acked within the group never written."""
        with self._lock:
            if self._grouped:
                yield
                return
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"{self.url}: cannot begin a transaction: {exc}") from exc
            self._grouped = True
            try:
                yield
            except BaseException:
                self._grouped = False
                self._db.execute("ROLLBACK")
                raise
            self._grouped = False
            self._db.execute("COMMIT")
            if self._checkpointer is not None:
                self._checkpointer.poke()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
        with self._lock:
            self._db.close()
