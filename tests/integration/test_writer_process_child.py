"""The writer process (runtime/writer_process.py) on its own, a real child process on a
real SQLite file: it applies a group only when it received all of it, and a fenced
group (an orphaned writer after a new runner took the ranges) is refused, reported and
nothing after it is applied."""

from __future__ import annotations

import pickle
import socket
import struct
from pathlib import Path

import pytest

from millwheel.errors import FencedError
from millwheel.runtime.writer_process import decode_error, encode, start_writer
from millwheel.state.protocol import Checkpoint
from millwheel.state.sqlite_store import SQLiteStore


def group(token: int, key: str) -> bytes:
    cp = Checkpoint("count", 0, token, 1, state_writes={key: b"v" * 50_000},
                    consumed_ids=[f"{key}-{i}" for i in range(2000)])
    encoded = encode([cp], SQLiteStore(":memory:"))
    assert encoded is not None
    return pickle.dumps(encoded)


@pytest.fixture()
def store(tmp_path: Path) -> SQLiteStore:
    s = SQLiteStore(tmp_path / "s.db")
    assert s.acquire("count", 0) == 1
    return s


def test_a_whole_group_is_applied_and_acknowledged(store: SQLiteStore) -> None:
    conn, child = start_writer(store.url)
    conn.send_bytes(group(1, "a"))
    assert conn.recv_bytes() == b""
    conn.close()
    assert child.wait(timeout=30) == 0
    assert set(store.read_state("count", ["a"])) == {"a"}
    assert store.contains_ids("count", 0, ["a-0", "a-1999"]) == {"a-0", "a-1999"}


def test_a_partly_sent_group_is_never_applied(store: SQLiteStore) -> None:
    """The runner dies (its end of the socket closes) in the middle of a group."""
    conn, child = start_writer(store.url)
    data = group(1, "a")
    raw = socket.socket(fileno=conn.fileno())
    raw.sendall(struct.pack("!i", len(data)) + data[: len(data) // 2])
    raw.detach()
    conn.close()
    assert child.wait(timeout=30) == 0
    assert store.read_state("count", ["a"]) == {}
    assert store.contains_ids("count", 0, ["a-0", "a-1999"]) == set()


def test_an_orphaned_writers_group_is_fenced_and_nothing_after_it_applied(store: SQLiteStore) -> None:
    conn, child = start_writer(store.url)
    conn.send_bytes(group(1, "a"))
    assert conn.recv_bytes() == b""
    assert store.acquire("count", 0) == 2  # a new runner on the same store
    conn.send_bytes(group(1, "b"))  # the old runner's next group
    error = decode_error(conn.recv_bytes())
    assert isinstance(error, FencedError) and error.current == 2
    try:
        conn.send_bytes(group(2, "c"))  # even a current token: the child has stopped
    except OSError:
        pass
    assert child.wait(timeout=30) == 0
    conn.close()
    assert set(store.read_state("count", ["a", "b", "c"])) == {"a"}


def test_a_read_after_flush_sees_the_steps_held_while_the_child_was_busy(store: SQLiteStore) -> None:
    """Step 1's big group keeps the child busy, so step 2's writes stay held; a flush
    (what every read does first) must still apply them, after step 1's."""
    from millwheel.runtime.writer_process import PipelinedStore

    pipe = PipelinedStore(store)
    with pipe.deferring():
        pipe.checkpoint(Checkpoint("count", 0, 1, 1, state_writes={"a": b"1"},
                                   consumed_ids=[f"id-{i}" for i in range(300_000)]))
    pipe.end_step()
    with pipe.deferring():
        pipe.checkpoint(Checkpoint("count", 0, 1, 2, state_writes={"a": b"2", "b": b"2"}))
    pipe.end_step()
    assert pipe._steps_held == 1, "the child finished a 300k-ID group at once?"
    assert pipe.contains_ids("count", 0, ["id-0", "id-299999", "nope"]) == {"id-0", "id-299999"}
    assert pipe.read_state("count", ["a", "b"]) == {"a": b"2", "b": b"2"}
    pipe.stop()
