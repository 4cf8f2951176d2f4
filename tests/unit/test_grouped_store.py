"""The local runner's step writes applied as one transaction (millwheel/runtime/grouped.py):
same store contents as applying them one by one, all or nothing, reads see them."""

from __future__ import annotations

from pathlib import Path

import pytest

from millwheel.errors import FencedError
from millwheel.record import Record
from millwheel.runtime.grouped import GroupedStore
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.sqlite_store import SQLiteStore


def _records(prefix: str, n: int) -> list[Record]:
    return [Record(f"k{i % 3}", f"v{i}".encode(), 1000 + i, f"{prefix}{i}") for i in range(n)]


def _writes(store: SQLiteStore | GroupedStore, tokens: dict[str, int]) -> None:
    """An injector step: its checkpoint (cursor + outbox), the consumer's checkpoint of
    the records, then the injector's ack of all but the last two (and of one entry
    written by an earlier step)."""
    recs = _records("r", 10)
    store.checkpoint(Checkpoint("inj", 0, tokens["inj"], 5, state_writes={"__cursor__": b"10"},
                                productions=[Production("count", "events", r) for r in recs]))
    store.checkpoint(Checkpoint("count", 0, tokens["count"], 5, state_writes={"k0": b"4"},
                                consumed_ids=[r.record_id for r in recs[:8]]))
    store.ack("inj", 0, tokens["inj"], [("count", r.record_id) for r in recs[:8]] + [("count", "old0")])


def _contents(store: SQLiteStore) -> tuple[object, ...]:
    return (
        [(p.consumer, p.record) for p in store.read_outbox("inj", 0)],
        store.read_state("inj", ["__cursor__"]), store.read_state("count", ["k0"]),
        sorted(store.iter_ids("count", 0)),
    )


def _fresh(path: Path) -> tuple[SQLiteStore, dict[str, int]]:
    store = SQLiteStore(path)
    tokens = {name: store.acquire(name, 0) for name in ("inj", "count")}
    old = Production("count", "events", Record("k", b"x", 1, "old0"))
    store.checkpoint(Checkpoint("inj", 0, tokens["inj"], 1, productions=[old]))
    return store, tokens


def test_a_group_leaves_what_the_writes_one_by_one_leave(tmp_path: Path) -> None:
    plain, tokens = _fresh(tmp_path / "plain.db")
    _writes(plain, tokens)
    inner, tokens = _fresh(tmp_path / "grouped.db")
    grouped = GroupedStore(inner)
    with grouped.deferring():
        _writes(grouped, tokens)
        assert [p.record.record_id for p in inner.read_outbox("inj", 0)] == ["old0"]  # held
        # the dedup confirmation sees IDs of held checkpoints
        assert grouped.contains_ids("count", 0, ["r1", "r9"]) == {"r1"}
    grouped.flush()
    assert _contents(inner) == _contents(plain)
    assert [p.record.record_id for p in inner.read_outbox("inj", 0)] == ["r8", "r9"]
    assert grouped.cancelled == 8  # written and acked in the group: never inserted


def test_a_fenced_write_rolls_back_the_whole_group(tmp_path: Path) -> None:
    inner, tokens = _fresh(tmp_path / "s.db")
    before = _contents(inner)
    grouped = GroupedStore(inner)
    SQLiteStore(tmp_path / "s.db").acquire("count", 0)  # a new owner of the consumer range
    with pytest.raises(FencedError):
        with grouped.deferring():
            _writes(grouped, tokens)
        grouped.flush()
    assert _contents(inner) == before


def test_a_read_applies_the_held_writes_first(tmp_path: Path) -> None:
    inner, tokens = _fresh(tmp_path / "s.db")
    grouped = GroupedStore(inner)
    with grouped.deferring():
        _writes(grouped, tokens)
        assert grouped.read_state("count", ["k0"]) == {"k0": b"4"}
        assert inner.read_state("count", ["k0"]) == {"k0": b"4"}


def test_outside_deferring_writes_are_applied_at_once(tmp_path: Path) -> None:
    inner, tokens = _fresh(tmp_path / "s.db")
    grouped = GroupedStore(inner)
    _writes(grouped, tokens)
    assert sorted(inner.iter_ids("count", 0)) == [f"r{i}" for i in range(8)]
    assert grouped.cancelled == 0
