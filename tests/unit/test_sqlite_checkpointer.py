"""The SQLite store copies its write-ahead log into the database file on a thread of
its own (millwheel/state/sqlite_checkpointer.py): committed writes reach the database
file itself soon after their commit, without the writer doing it, and closing the
store stops the thread."""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path

from millwheel.state.protocol import Checkpoint
from millwheel.state.sqlite_store import SQLiteStore


def write_some(store: SQLiteStore, n: int) -> None:
    token = store.acquire("c", 0)
    for i in range(n):
        store.checkpoint(Checkpoint(computation="c", range_id=0, token=token, now_us=i,
                                    state_writes={f"k{i}": b"v" * 100}))


def test_committed_writes_reach_the_database_file_without_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    write_some(store, 50)
    deadline = time.monotonic() + 10
    copy = tmp_path / "copy.db"
    while True:
        # the database file alone, without its log: what a checkpoint has copied
        shutil.copyfile(path, copy)
        db = sqlite3.connect(copy)
        try:
            rows = db.execute("SELECT count(*) FROM state WHERE computation = 'c'").fetchone()[0]
        except sqlite3.DatabaseError:
            rows = 0  # the schema itself is still only in the log
        db.close()
        if rows == 50 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert rows == 50
    store.close()


def test_close_stops_the_checkpointer_and_the_data_stays(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SQLiteStore(path)
    write_some(store, 5)
    checkpointer = store._checkpointer
    assert checkpointer is not None
    store.close()
    assert not checkpointer._thread.is_alive()
    reopened = SQLiteStore(path)
    assert len(reopened.read_state("c", [f"k{i}" for i in range(5)])) == 5
    reopened.close()


def test_an_in_memory_store_has_no_checkpointer() -> None:
    store = SQLiteStore(":memory:")
    assert store._checkpointer is None
    write_some(store, 3)
    store.close()


def test_the_url_turns_it_off_and_refuses_other_values(tmp_path: Path) -> None:
    import pytest

    from millwheel.errors import InvalidSpecError
    from millwheel.state import open_store

    off = open_store(f"sqlite:///{tmp_path}/off.db?wal_checkpointer=off")
    assert isinstance(off, SQLiteStore) and off._checkpointer is None
    write_some(off, 3)  # the commits copy the log themselves, as SQLite does by default
    off.close()
    on = open_store(f"sqlite:///{tmp_path}/on.db")
    assert isinstance(on, SQLiteStore) and on._checkpointer is not None
    on.close()
    with pytest.raises(InvalidSpecError, match="wal_checkpointer must be on or off, got 'no'"):
        open_store(f"sqlite:///{tmp_path}/bad.db?wal_checkpointer=no")
    assert not (tmp_path / "bad.db").exists()  # refused before anything was created
