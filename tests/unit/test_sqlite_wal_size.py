"""The SQLite store's write-ahead log stays small through a large record-ID cleanup and
shrinks back after any large transaction (issue 27: the log reached 79 MB as
record-ID expiry started, and never shrank).

Sizes are the log file's as a user sees it (``PATH-wal`` on disk); the bounds are
the store's documented ones (millwheel/state/sqlite_schema.py)."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

from millwheel.state.protocol import Checkpoint
from millwheel.state.sqlite_schema import JOURNAL_SIZE_LIMIT
from millwheel.state.sqlite_store import SQLiteStore

MB = 1024 * 1024
IDS = 300_000  # one 1-minute expiry of a range at ~5k records/s


def consume_ids(store: SQLiteStore, token: int, n: int, per_checkpoint: int = 2000) -> None:
    for b in range(n // per_checkpoint):
        ids = [f"injector/c{b:05d}/{j:05d}/0123456789abcdef" for j in range(per_checkpoint)]
        store.checkpoint(Checkpoint("c", 0, token, 100 + b, consumed_ids=ids))


def wal_size(path: Path) -> int:
    try:
        return os.path.getsize(f"{path}-wal")
    except FileNotFoundError:
        return 0


def empty_log(path: Path) -> None:
    """Copy the log into the database and truncate it (retried while the store's
    checkpointer thread is busy with it)."""
    db = sqlite3.connect(path, timeout=10)
    try:
        deadline = time.monotonic() + 20
        while db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] or wal_size(path):
            assert time.monotonic() < deadline, "could not empty the log"
            time.sleep(0.05)
    finally:
        db.close()


def test_a_large_record_id_cleanup_keeps_the_log_small(tmp_path: Path) -> None:
    path = tmp_path / "ids.db"
    store = SQLiteStore(path)
    token = store.acquire("c", 0)
    consume_ids(store, token, IDS)
    empty_log(path)  # start the cleanup from an empty log
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, wal_size(path))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert store.expire_ids("c", 0, token, 10**12) == IDS
    finally:
        done.set()
        watcher.join()
    peak = max(peak, wal_size(path))
    # One transaction wrote ~12 MB of log here (every page of the IDs' table); small ones
    # let the log start over (its soft limit is 4 MiB, plus one transaction).
    assert peak <= 6 * MB, f"the log reached {peak / MB:.1f} MiB"
    assert store.contains_ids("c", 0, ["injector/c00000/00000/0123456789abcdef"]) == set()
    store.close()


def test_the_log_shrinks_back_after_a_large_transaction(tmp_path: Path) -> None:
    path = tmp_path / "big.db"
    store = SQLiteStore(path)
    token = store.acquire("c", 0)
    consume_ids(store, token, 2 * IDS, per_checkpoint=2 * IDS)  # one transaction: a ~32 MB log
    grown = wal_size(path)
    assert grown > JOURNAL_SIZE_LIMIT
    deadline = time.monotonic() + 20
    while wal_size(path) > JOURNAL_SIZE_LIMIT and time.monotonic() < deadline:
        time.sleep(0.2)  # a quiet moment: the checkpointer copies the log ...
        store.put_meta("tick", str(time.monotonic()).encode())  # ... and a write starts it over
    assert wal_size(path) <= JOURNAL_SIZE_LIMIT, f"the log stayed at {wal_size(path) / MB:.1f} MiB"
    store.close()
