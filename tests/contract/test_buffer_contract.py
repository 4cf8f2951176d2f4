"""Window buffers in the store contract (what the Spark stage relies on), every backend.

A range's buffers are append-only lists of opaque chunks, written only through the
atomic, token-fenced checkpoint: appended in order, read back whole and in order,
deleted whole, separate per range and per computation, and untouched by a fenced or
failed write.
"""

from __future__ import annotations

import pytest

from millwheel.errors import FencedError
from millwheel.record import Timer
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint, StateStore

C = "spark"


def cp(token: int, range_id: int = 0, **changes: object) -> Checkpoint:
    return Checkpoint(C, range_id, token, 1_000, **changes)  # type: ignore[arg-type]


def test_appends_read_back_in_order_and_are_listed(store: StateStore) -> None:
    t = store.acquire(C, 0)
    assert store.read_buffer(C, 0, "60") == []
    assert store.list_buffers(C, 0) == []
    store.checkpoint(cp(t, buffer_appends=[("60", b"a\n"), ("120", b"x\n"), ("60", b"b\n")]))
    store.checkpoint(cp(t, buffer_appends=[("60", b"")]))
    store.checkpoint(cp(t, buffer_appends=[("60", b"c\x00\xff\n")]))
    assert store.read_buffer(C, 0, "60") == [b"a\n", b"b\n", b"", b"c\x00\xff\n"]
    assert store.read_buffer(C, 0, "120") == [b"x\n"]
    assert store.list_buffers(C, 0) == ["120", "60"]


def test_buffers_go_with_state_timers_and_ids_in_one_checkpoint(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, state_writes={"k": b"meta"}, timer_sets=[Timer("k", "fire:0:0", 59)],
                        consumed_ids=["r1"], buffer_appends=[("0", b"r1\n")]))
    assert store.read_state(C, ["k"]) == {"k": b"meta"}
    assert store.contains_ids(C, 0, ["r1"]) == {"r1"}
    assert store.read_buffer(C, 0, "0") == [b"r1\n"]


def test_delete_removes_the_whole_buffer_after_the_appends(store: StateStore) -> None:
    t = store.acquire(C, 0)
    store.checkpoint(cp(t, buffer_appends=[("0", b"1"), ("60", b"2")]))
    store.checkpoint(cp(t, buffer_appends=[("0", b"3")], buffer_deletes=["0", "never-there"]))
    assert store.read_buffer(C, 0, "0") == []
    assert store.list_buffers(C, 0) == ["60"]
    store.checkpoint(cp(t, buffer_appends=[("0", b"again")]))  # a name can be reused
    assert store.read_buffer(C, 0, "0") == [b"again"]


def test_buffers_are_per_range_and_per_computation(store: StateStore) -> None:
    t0, t1 = store.acquire(C, 0), store.acquire(C, 1)
    other = store.acquire("other", 0)
    store.checkpoint(cp(t0, 0, buffer_appends=[("w", b"r0")]))
    store.checkpoint(cp(t1, 1, buffer_appends=[("w", b"r1")]))
    store.checkpoint(Checkpoint("other", 0, other, 1, buffer_appends=[("w", b"o")]))
    store.checkpoint(cp(t1, 1, buffer_deletes=["w"]))
    assert store.read_buffer(C, 0, "w") == [b"r0"]
    assert store.read_buffer(C, 1, "w") == []
    assert store.read_buffer("other", 0, "w") == [b"o"]


def test_fenced_checkpoint_appends_and_deletes_nothing(store: StateStore) -> None:
    old = store.acquire(C, 0)
    store.checkpoint(cp(old, buffer_appends=[("w", b"kept")]))
    store.acquire(C, 0)  # a new owner: the old one is a zombie
    with pytest.raises(FencedError):
        store.checkpoint(cp(old, buffer_appends=[("w", b"zombie"), ("z", b"zombie")]))
    with pytest.raises(FencedError):
        store.checkpoint(cp(old, buffer_deletes=["w"]))
    assert store.read_buffer(C, 0, "w") == [b"kept"]
    assert store.list_buffers(C, 0) == ["w"]


def test_a_large_buffer_reads_back_whole(store: StateStore) -> None:
    """More entries than one read page (Redis pages LRANGE), and big chunks."""
    t = store.acquire(C, 0)
    chunks = [f"{i}\n".encode() * (1 + i % 7) for i in range(2_500)]
    for start in range(0, len(chunks), 500):
        store.checkpoint(cp(t, buffer_appends=[("w", c) for c in chunks[start:start + 500]]))
    big = b"x" * (4 << 20)
    store.checkpoint(cp(t, buffer_appends=[("w", big)]))
    assert store.read_buffer(C, 0, "w") == chunks + [big]


def test_buffers_survive_reopening(store_url: str) -> None:
    first = open_store(store_url)
    t = first.acquire(C, 0)
    first.checkpoint(cp(t, buffer_appends=[("w", b"durable")]))
    first.close()
    again = open_store(store_url)
    try:
        assert again.read_buffer(C, 0, "w") == [b"durable"]
    finally:
        again.close()


def test_write_group_applies_buffers_all_or_nothing(store: StateStore) -> None:
    """Inside a write group (the local runner's step), a fenced write refuses the
    whole group on Redis and rolls it back on SQLite: no buffer entry of it stays."""
    group = getattr(store, "write_group", None)
    if group is None:
        pytest.skip("this backend has no write group (Redis Cluster)")
    t = store.acquire(C, 0)
    store.acquire(C, 1)
    stale = store.acquire(C, 1) - 1
    with group():
        store.checkpoint(cp(t, buffer_appends=[("w", b"1")]))
        store.checkpoint(cp(t, buffer_appends=[("w", b"2")]))
    assert store.read_buffer(C, 0, "w") == [b"1", b"2"]
    with pytest.raises(FencedError):
        with group():
            store.checkpoint(cp(t, buffer_appends=[("w", b"3")], buffer_deletes=["w"]))
            store.checkpoint(cp(stale, 1, buffer_appends=[("w", b"zombie")]))
    assert store.read_buffer(C, 0, "w") == [b"1", b"2"]
    assert store.read_buffer(C, 1, "w") == []
