"""The error policy's tables in the SQLite store (see :mod:`millwheel.runtime.poison`):
``attempts`` (failed attempts per item, with the last error), ``error_counts``
(durable counters: dead-lettered, skipped, late-dropped, late records per input stream:
:mod:`millwheel.late`) and ``error_log`` (the last
:data:`~millwheel.state.protocol.RECENT_ERRORS` given-up errors per range).

They are written by the policy's part of a checkpoint (inside its transaction) and by
the token-fenced :meth:`SQLiteErrors.bump_attempts`: bookkeeping about a range's data
rather than the data itself, so it stands apart from the checkpoint's state, timer,
outbox and consumed-ID writes in :mod:`millwheel.state.sqlite_store`.

:class:`SQLiteErrors` is a mixin of :class:`millwheel.state.sqlite_store.SQLiteStore`.
"""

from __future__ import annotations

import sqlite3
import threading
from typing import Callable, TypeVar

from millwheel.state.protocol import RECENT_ERRORS, Checkpoint, ErrorReport

T = TypeVar("T")


class SQLiteErrors:
    """Failing user code: attempts, counters and given-up errors (a mixin of SQLiteStore)."""

    _db: sqlite3.Connection
    _lock: threading.RLock
    _write: Callable[[Callable[[], T]], T]
    _fence: Callable[[str, int, int], None]

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
