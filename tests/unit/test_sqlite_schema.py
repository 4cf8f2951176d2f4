"""The SQLite store's storage choices: files of the previous schema keep working after
an upgrade, and record IDs SQLite's JSON functions cannot carry take the slow path."""

import sqlite3
from pathlib import Path

from millwheel.record import Record
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.sqlite_store import SQLiteStore

# The consumed-ID and outbox tables as the previous version created them.
OLD_SCHEMA = """
CREATE TABLE tokens (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, token INTEGER NOT NULL,
    PRIMARY KEY (computation, range_id));
CREATE TABLE outbox (
    producer TEXT NOT NULL, range_id INTEGER NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer TEXT NOT NULL, stream TEXT NOT NULL, record_id TEXT NOT NULL,
    key TEXT NOT NULL, value BLOB NOT NULL, ts INTEGER NOT NULL,
    UNIQUE (producer, range_id, consumer, record_id));
CREATE TABLE seen_ids (
    computation TEXT NOT NULL, range_id INTEGER NOT NULL, record_id TEXT NOT NULL,
    seen_at INTEGER NOT NULL, PRIMARY KEY (computation, range_id, record_id)) WITHOUT ROWID;
CREATE INDEX seen_ids_by_time ON seen_ids (computation, range_id, seen_at);
INSERT INTO tokens VALUES ('c', 0, 3);
INSERT INTO seen_ids VALUES ('c', 0, 'a', 100000000), ('c', 0, 'b', 110000000), ('c', 0, 'c', 200000000),
    ('c', 1, 'd', 100000000);
INSERT INTO outbox (producer, range_id, consumer, stream, record_id, key, value, ts)
    VALUES ('c', 0, 'down', 's', 'p1', 'k', x'00ff', 5);
"""


def prod(record_id: str) -> Production:
    return Production("down", "s", Record("k", b"v", 7, record_id))


def test_a_file_of_the_previous_schema_is_migrated(tmp_path: Path) -> None:
    """IDs of the per-ID layout come over into generations of a minute (by the time
    they were consumed): each is kept at least as long as before, at most a minute more."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.close()
    store = SQLiteStore(path)
    assert sorted(store.iter_ids("c", 0)) == ["a", "b", "c"]
    assert store.contains_ids("c", 0, ["a", "c", "d"]) == {"a", "c"}
    store.checkpoint(Checkpoint("c", 0, 3, 300_000_000, consumed_ids=["e"], productions=[prod("p2")]))
    assert [p.record.record_id for p in store.read_outbox("c", 0)] == ["p1", "p2"]
    assert store.expire_ids("c", 0, 3, 105_000_000) == 0  # b (110 s) shares a's minute
    assert store.expire_ids("c", 0, 3, 150_000_000) == 2  # a and b, not range 1's d
    assert sorted(store.iter_ids("c", 0)) == ["c", "e"]
    assert list(store.iter_ids("c", 1)) == ["d"]
    store.close()
    store = SQLiteStore(path)  # opening again changes nothing
    assert store.expire_ids("c", 0, 3, 250_000_000) == 1
    assert sorted(store.iter_ids("c", 0)) == ["e"]
    store.close()


def test_ids_with_nul_and_json_escapes_are_kept_exactly(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    token = store.acquire("c", 0)
    odd = ["a\x00b", 'q"u', "back\\slash", "\\u0000", "ünï", "tab\t"]
    store.checkpoint(Checkpoint("c", 0, token, 100, consumed_ids=odd[:3]))
    store.checkpoint(Checkpoint("c", 0, token, 200, consumed_ids=odd[3:], productions=[prod(i) for i in odd]))
    assert store.contains_ids("c", 0, [*odd, "a", "a\x00"]) == set(odd)
    store.ack("c", 0, token, [("down", i) for i in odd[:2]])
    assert [p.record.record_id for p in store.read_outbox("c", 0)] == odd[2:]
    assert store.expire_ids("c", 0, token, 150) == 3
    assert sorted(store.iter_ids("c", 0)) == sorted(odd[3:])
    assert store.expire_ids("c", 0, token, 250) == 3
    assert list(store.iter_ids("c", 0)) == []
    store.close()
