"""A long record-ID cleanup hands the SQLite file's writer lock to the other processes
between its transactions (issue 21, item 4): held for the whole cleanup it kept the
controller's lease renewal waiting past the lease's time to live on a loaded machine.

A real SQLite store opened as the service opens it (services/store_lock.py); between
the cleanup's transactions another descriptor of the lock file (what another process
holds) tries the lock without waiting: it must find it free every time.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from millwheel.state.protocol import Checkpoint
from millwheel.state.sqlite_store import EXPIRE_IDS_PER_TXN
from services.store_lock import open_service_store


def test_expiry_releases_the_writer_lock_between_its_transactions(tmp_path: Path) -> None:
    store: Any = open_service_store(f"sqlite:///{tmp_path}/s.db")
    other = os.open(f"{tmp_path}/s.db.writers", os.O_RDWR)
    try:
        token = store.acquire("c", 0)
        batches = 3
        for b in range(batches):
            store.checkpoint(Checkpoint("c", 0, token, 100 + b, consumed_ids=[
                f"id-{b}-{i}" for i in range(EXPIRE_IDS_PER_TXN)]))
        inner = store._store
        relieve = inner._relieve_wal
        free: list[bool] = []

        def between() -> None:  # runs between two transactions of the cleanup
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                free.append(False)
            else:
                free.append(True)
                fcntl.flock(other, fcntl.LOCK_UN)
            relieve()

        inner._relieve_wal = between
        assert store.expire_ids("c", 0, token, 10**15) == batches * EXPIRE_IDS_PER_TXN
        assert len(free) >= batches - 1 and all(free), free
        assert store.expire_ids("c", 0, token, 10**15) == 0
    finally:
        os.close(other)
        store.close()
