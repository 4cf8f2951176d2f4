"""The controller lease on SQLite (see :mod:`millwheel.state.lease`): three rows of the
``meta`` table, read and written in one ``BEGIN IMMEDIATE`` transaction each, so
claim, renewal and every epoch-fenced write are atomic across the processes of one
machine. Time is this machine's wall clock (every process on the file shares it).

:class:`SQLiteLease` is a mixin of :class:`millwheel.state.sqlite_store.SQLiteStore`.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Callable, TypeVar

from millwheel.state.lease import EPOCH, HOLDER, UNTIL, LeadershipLostError, Lease, check_ttl

T = TypeVar("T")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class SQLiteLease:
    """Lease operations over the store's ``meta`` table (a mixin of SQLiteStore)."""

    _db: sqlite3.Connection
    _lock: threading.RLock
    _write: Callable[[Callable[[], T]], T]

    def _lease_row(self) -> tuple[str, int, int]:
        rows = dict(self._db.execute(
            "SELECT name, value FROM meta WHERE name IN (?, ?, ?)", (HOLDER, EPOCH, UNTIL)).fetchall())
        return (bytes(rows.get(HOLDER, b"")).decode(), int(bytes(rows.get(EPOCH, b"0"))),
                int(bytes(rows.get(UNTIL, b"0"))))

    def _set_lease(self, holder: str, epoch: int, until: int) -> None:
        self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [
            (HOLDER, holder.encode()), (EPOCH, str(epoch).encode()), (UNTIL, str(until).encode())])

    def _check_epoch(self, what: str, epoch: int | None) -> None:
        """Inside a write transaction: raise unless ``epoch`` is the current one."""
        if epoch is None:
            return
        current = self._lease_row()[1]
        if current != epoch:
            raise LeadershipLostError(what, epoch, current)

    def claim_lease(self, holder: str, ttl_ms: int) -> int | None:
        check_ttl(ttl_ms)

        def txn() -> int | None:
            now = _now_ms()
            cur_holder, epoch, until = self._lease_row()
            if cur_holder != holder:
                if cur_holder and until > now:
                    return None
                epoch += 1
            self._set_lease(holder, epoch, now + ttl_ms)
            return epoch

        return self._write(txn)

    def renew_lease(self, holder: str, epoch: int, ttl_ms: int) -> bool:
        check_ttl(ttl_ms)

        def txn() -> bool:
            cur_holder, cur_epoch, _until = self._lease_row()
            if (cur_holder, cur_epoch) != (holder, epoch):
                return False
            self._set_lease(holder, epoch, _now_ms() + ttl_ms)
            return True

        return self._write(txn)

    def release_lease(self, holder: str, epoch: int) -> None:
        def txn() -> None:
            if self._lease_row()[:2] == (holder, epoch):
                self._set_lease(holder, epoch, 0)

        self._write(txn)

    def read_lease(self) -> Lease | None:
        with self._lock:
            holder, epoch, until = self._lease_row()
        if epoch == 0:
            return None
        return Lease(holder, epoch, until - _now_ms())
