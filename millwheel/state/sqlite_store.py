"""The embedded default store: one SQLite file in WAL mode.

Every token-fenced write is one ``BEGIN IMMEDIATE`` transaction that first reads the
range's token and only then writes, so the fence check and the write are atomic with
respect to every other process using the same file. ``synchronous=NORMAL`` (the
default here) survives a process crash (kill -9) without losing a committed
checkpoint; ``?synchronous=FULL`` in the URL also survives power loss.

The file itself (schema, migrations, pragmas, the fence check, the write
transaction, multi-row INSERTs) is :mod:`millwheel.state.sqlite_schema`; this module
holds the StateStore operations on a key range's data (ownership, the checkpoint,
acks, the reads for recovery). Its mixins hold the rest: the error policy's tables
(:mod:`millwheel.state.sqlite_errors`), the stream log, watermarks and metadata
(:mod:`millwheel.state.sqlite_shared`) and the controller lease
(:mod:`millwheel.state.sqlite_lease`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence

from millwheel.errors import CorruptDataError
from millwheel.record import Record, TimeDomain, Timer
from millwheel.state.protocol import ID_PAGE, Checkpoint, Production
from millwheel.state.sqlite_errors import SQLiteErrors
from millwheel.state.sqlite_lease import SQLiteLease
from millwheel.state.sqlite_schema import SQLiteFile, _insert_rows, _json_list
from millwheel.state.sqlite_shared import SQLiteShared

#: Consumed IDs forgotten per transaction of ``expire_ids``: about 60 pages of the log.
EXPIRE_IDS_PER_TXN = 5000


class SQLiteStore(SQLiteLease, SQLiteErrors, SQLiteShared, SQLiteFile):
    """A :class:`~millwheel.state.protocol.StateStore` in one SQLite file."""

    #: Taken around each transaction of a long cleanup (``expire_ids``), not around the
    #: whole call: a service process's cross-process writer lock (services/store_lock.py)
    #: is handed to the others between its transactions, so a controller's lease
    #: renewal waits for one transaction at most, not for the whole cleanup.
    txn_guard: Callable[[], AbstractContextManager[Any]] = nullcontext
    # -- ownership -----------------------------------------------------------
    def acquire(self, computation: str, range_id: int, epoch: int | None = None) -> int:
        def txn() -> int:
            self._check_epoch(f"acquire of {computation!r} range {range_id}", epoch)
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
        6. Append to and delete window buffers.
        All six in one transaction: a crash leaves all or nothing.
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
            if cp.consumed_ids:  # 5: into the checkpoint's generation
                gen = cp.now_us if cp.ids_generation is None else cp.ids_generation
                ids = _json_list(cp.consumed_ids)
                if ids is None:
                    db.executemany(
                        "INSERT OR IGNORE INTO consumed_ids VALUES (?, ?, ?, ?)",
                        [(comp, rid, gen, i) for i in cp.consumed_ids],
                    )
                else:  # one statement: no per-ID round trip through the sqlite3 module
                    db.execute(
                        "INSERT OR IGNORE INTO consumed_ids SELECT ?, ?, ?, value FROM json_each(?)",
                        (comp, rid, gen, ids),
                    )
                db.execute(
                    "INSERT INTO consumed_gens VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE "
                    "SET last_at = max(last_at, excluded.last_at)",
                    (comp, rid, gen, cp.now_us),
                )
            if cp.resolved or cp.counters or cp.errors:
                self._apply_errors(cp)
            if cp.buffer_appends:  # 6: window buffers, one row per chunk
                db.executemany(
                    "INSERT INTO buffers (computation, range_id, name, data) VALUES (?, ?, ?, ?)",
                    [(comp, rid, name, data) for name, data in cp.buffer_appends],
                )
            if cp.buffer_deletes:
                db.executemany(
                    "DELETE FROM buffers WHERE computation=? AND range_id=? AND name=?",
                    [(comp, rid, name) for name in cp.buffer_deletes],
                )

        self._write(txn)

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

    def _generations(self, computation: str, range_id: int) -> list[int]:
        return [row[0] for row in self._db.execute(
            "SELECT gen FROM consumed_gens WHERE computation=? AND range_id=? ORDER BY gen",
            (computation, range_id),
        )]

    def contains_ids(self, computation: str, range_id: int, ids: Sequence[str]) -> set[str]:
        """One probe per ID and live generation (~17 with the range worker's widths):
        this runs for Bloom filter hits only."""
        found: set[str] = set()
        with self._lock:
            gens = self._generations(computation, range_id)
            for g in range(0, len(gens), 64):
                in_gens = gens[g : g + 64]
                for start in range(0, len(ids), 500):
                    chunk = list(ids[start : start + 500])
                    found.update(
                        row[0]
                        for row in self._db.execute(
                            "SELECT record_id FROM consumed_ids WHERE computation=? AND range_id=? "
                            f"AND gen IN ({','.join('?' * len(in_gens))}) "
                            f"AND record_id IN ({','.join('?' * len(chunk))})",
                            (computation, range_id, *in_gens, *chunk),
                        )
                    )
        return found

    def iter_ids(self, computation: str, range_id: int) -> Iterator[str]:
        for _gen, page in self.iter_id_generations(computation, range_id):
            yield from page

    def iter_id_generations(self, computation: str, range_id: int) -> Iterator[tuple[int | None, list[str]]]:
        # Pages in primary-key order (a range scan of the table's b-tree), each read
        # under the connection's lock and released between pages, split where the
        # generation changes. An ID consumed in two generations comes once per generation.
        sql = ("SELECT gen, record_id FROM consumed_ids WHERE computation=? AND range_id=? "
               "{}ORDER BY gen, record_id LIMIT ?")
        args: tuple[object, ...] = (computation, range_id, ID_PAGE)
        while True:
            with self._lock:
                rows = self._db.execute(
                    sql.format("" if len(args) == 3 else "AND (gen, record_id) > (?, ?) "), args
                ).fetchall()
            start = 0
            for i in range(1, len(rows) + 1):
                if i == len(rows) or rows[i][0] != rows[start][0]:
                    yield int(rows[start][0]), [row[1] for row in rows[start:i]]
                    start = i
            if len(rows) < ID_PAGE:
                return
            args = (computation, range_id, rows[-1][0], rows[-1][1], ID_PAGE)

    def id_generations(self, computation: str, range_id: int) -> list[int]:
        with self._lock:
            return self._generations(computation, range_id)

    def expire_ids(self, computation: str, range_id: int, token: int, older_than_us: int) -> int:
        """Forgets every generation whose newest ID is older than ``older_than_us``, in
        transactions of about :data:`EXPIRE_IDS_PER_TXN` IDs each (each fenced), each a
        range delete of one generation's b-tree keys: one transaction deleting a long
        retention's worth of IDs grew the write-ahead log by every page it touched
        (issue 27: 79 MB). Between them, once the log has grown past
        :data:`~millwheel.state.sqlite_schema.WAL_SOFT_LIMIT`, it is copied into the
        database here, so the next transaction starts it over instead of growing it
        (the checkpointer thread cannot catch up with back-to-back deletes)."""
        removed = 0
        while True:
            with self.txn_guard() if not self._grouped else nullcontext():
                n, more = self._write(partial(self._expire_some, computation, range_id, token, older_than_us))
            removed += n
            if not more:
                return removed
            self._relieve_wal()

    def _expire_some(self, computation: str, range_id: int, token: int, older_than_us: int) -> tuple[int, bool]:
        """One transaction of :meth:`expire_ids`: (IDs removed, whether more may be due).
        A generation larger than the transaction's share goes in slices of its keys
        (by ID order), its ``consumed_gens`` row last, so a cut-short expiry resumes."""
        self._fence(computation, range_id, token)
        db = self._db
        removed = 0
        where = "computation=? AND range_id=? AND gen=?"
        for (gen,) in db.execute(
            "SELECT gen FROM consumed_gens WHERE computation=? AND range_id=? AND last_at < ? ORDER BY gen",
            (computation, range_id, older_than_us),
        ).fetchall():
            args = (computation, range_id, gen)
            while True:
                budget = EXPIRE_IDS_PER_TXN - removed
                cut = db.execute(
                    f"SELECT record_id FROM consumed_ids WHERE {where} ORDER BY record_id LIMIT 1 OFFSET ?",
                    (*args, budget - 1),
                ).fetchone() if budget > 0 else None
                if cut is None and budget > 0:  # the rest of the generation fits
                    removed += max(db.execute(f"DELETE FROM consumed_ids WHERE {where}", args).rowcount, 0)
                    db.execute(f"DELETE FROM consumed_gens WHERE {where}", args)
                    break
                if cut is not None:
                    removed += max(db.execute(
                        f"DELETE FROM consumed_ids WHERE {where} AND record_id <= ?", (*args, cut[0])
                    ).rowcount, 0)
                return removed, True
            if removed >= EXPIRE_IDS_PER_TXN:
                return removed, True
        return removed, False

    def list_keys(self, computation: str, after: str | None, limit: int) -> list[str]:
        # ``after`` None means from the very first key, the empty key "" included.
        bound, args = ("", (computation, limit)) if after is None else ("AND key > ? ", (computation, after, limit))
        with self._lock:
            rows = self._db.execute(
                f"SELECT key FROM state WHERE computation=? {bound}ORDER BY key LIMIT ?", args
            ).fetchall()
        return [row[0] for row in rows]

    def read_buffer(self, computation: str, range_id: int, name: str) -> list[bytes]:
        with self._lock:
            rows = self._db.execute(
                "SELECT data FROM buffers WHERE computation=? AND range_id=? AND name=? ORDER BY seq",
                (computation, range_id, name),
            ).fetchall()
        return [bytes(row[0]) for row in rows]

    def list_buffers(self, computation: str, range_id: int) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT name FROM buffers WHERE computation=? AND range_id=? ORDER BY name",
                (computation, range_id),
            ).fetchall()
        return [row[0] for row in rows]
