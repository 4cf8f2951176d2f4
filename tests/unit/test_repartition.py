"""A rescale's data moves (millwheel/savepoint/repartition.py) on a real SQLite store,
and the controller's watermark hold after one (services/controller/watermarks.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from millwheel.keys import key_range, misrouted
from millwheel.record import Record, TimeDomain, Timer
from millwheel.savepoint import repartition
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint, Production, StateStore
from services.controller.store_work import StoreWork
from services.controller.watermarks import Watermarks

KEYS = [f"key{i}" for i in range(40)]


def _tokens(store: StateStore) -> Callable[[str, int], int]:
    known: dict[tuple[str, int], int] = {}

    def token(node: str, r: int) -> int:
        if (node, r) not in known:
            known[(node, r)] = store.acquire(node, r)
        return known[(node, r)]
    return token


def test_copy_moves_every_item_by_key_and_clear_removes_them(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/s.db")
    token = _tokens(store)
    for r in range(2):
        mine = [k for k in KEYS if key_range(k, 2) == r]
        store.checkpoint(Checkpoint(
            "c", r, token("c", r), 1, state_writes={k: k.encode() for k in mine},
            timer_sets=[Timer(k, "end:1", 100 + i, TimeDomain.EVENT, True) for i, k in enumerate(mine)],
            productions=[Production("log:out", "out", Record(f"x{r}{i}", b"v", 5, f"p{r}-{i}")) for i in range(3)],
            consumed_ids=[f"id{r}-{i}" for i in range(4)] + (["id0-0"] if r else [])))  # one in both
    moved = repartition.copy(store, "c", 2, "rescale:c", 5, token, 7)
    # An ID held by two old ranges (after an earlier rescale: all of them) is written once per new range.
    assert (moved.keys, moved.timers, moved.productions, moved.ids) == (40, 40, 6, 8 * 5)
    for k in KEYS:
        r = key_range(k, 5)
        assert store.read_state("rescale:c", [k], r) == {k: k.encode()}
        assert [t.key for t in store.read_key_timers("rescale:c", k, r)] == [k]
    # Each old range's pending productions kept once, where range s is still a range.
    assert [p.record.record_id for p in store.read_outbox("rescale:c", 1)] == ["p1-0", "p1-1", "p1-2"]
    assert sum(len(store.read_outbox("rescale:c", r)) for r in range(5)) == 6
    every = [f"id{r}-{i}" for r in range(2) for i in range(4)]
    for r in range(5):  # a redelivered record may reach any new range
        assert store.contains_ids("rescale:c", r, every) == set(every)

    repartition.clear(store, "rescale:c", range(5), (5,), token, 8)
    assert store.list_keys("rescale:c", None, 100) == []
    for r in range(5):
        assert not store.read_timers("rescale:c", r) and not store.read_outbox("rescale:c", r)
        assert not list(store.iter_ids("rescale:c", r))
    store.close()


def test_a_batch_routed_under_another_range_count_is_named() -> None:
    recs = [Record(k, b"", 0, f"i{k}") for k in KEYS]
    mine = [r for r in recs if key_range(r.key, 3) == 1]
    assert misrouted(mine, 1, 3) is None
    problem = misrouted(mine, 1, 8)  # a sender still routing under 3 ranges, the receiver at 8
    assert problem is not None and "of 8, not 1" in problem


def test_a_rescaled_computation_is_held_at_its_old_least_until_each_range_catches_up(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/w.db")
    work = StoreWork()
    try:
        wms = Watermarks(store, work, threading.RLock())
        wms.known["c"] = {0: 500, 1: 100}  # range 0 kept its stored 500; range 1 is new, given the floor
        wms.hold("c", 100, 2)
        assert wms.node("c", 2) == 100
        wms._reported("c", 1, 150)  # caught up with its stored 100: true again
        wms.known["c"][1] = 150
        assert wms.node("c", 2) == 100  # range 0 is still held: a moved key's timer at 120 pends there
        wms._reported("c", 0, 120)
        assert wms.node("c", 2) == 120
        wms._reported("c", 0, 600)
        assert "c" not in wms.held and wms.node("c", 2) == 150
    finally:
        work.close()
        store.close()


def test_ids_staged_once_then_spread_into_every_range(tmp_path: Path) -> None:
    """A rescale stages each consumed ID once (the staging node's range 0) and writes it
    into every range only when the staged layout is copied in: the same IDs end in
    every new range as with ``every``, and the staging node holds N times fewer."""
    store = open_store(f"sqlite:///{tmp_path}/s.db")
    token = _tokens(store)
    for r in range(2):
        store.checkpoint(Checkpoint("c", r, token("c", r), 1, state_writes={f"k{r}": b"v"},
                                    consumed_ids=[f"id{r}-{i}" for i in range(5)] + ["both"]))
    staged = repartition.copy(store, "c", 2, "rescale:c", 4, token, 7, ids="once")
    every = sorted([f"id{r}-{i}" for r in range(2) for i in range(5)] + ["both"])
    assert staged.ids == len(every) and sorted(store.iter_ids("rescale:c", 0)) == every
    assert all(not list(store.iter_ids("rescale:c", r)) for r in range(1, 4))
    moved = repartition.copy(store, "rescale:c", 4, "d", 4, token, 8, ids="none")
    assert moved.ids == 0 and moved.keys == 2
    assert repartition.spread_ids(store, "rescale:c", 0, "d", 4, token, 8) == 4 * len(every)
    for r in range(4):
        assert sorted(store.iter_ids("d", r)) == every
    store.close()
