"""Taking from the outbox (millwheel/runtime/outbox.py, "Taking") returns exactly what a
walk of the pending entries in checkpoint order, skipping those in flight, would: the
order each consumer key sees a producer's records in depends on it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.runtime.outbox import Outbox
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.sqlite_store import SQLiteStore

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 8)),
    st.tuples(st.just("take"), st.integers(1, 10), st.integers(0, 3)),  # limit, skip keys % 4 == n (0: none)
    st.tuples(st.just("release"), st.lists(st.integers(0, 60), max_size=8)),
    st.tuples(st.just("ack"), st.lists(st.integers(0, 60), max_size=8)),
    st.tuples(st.just("ack_first"), st.integers(1, 8)),  # the oldest pending, taken or not
    st.tuples(st.just("release_all"),),
), max_size=50)


@settings(max_examples=80, deadline=None)
@given(ops)
@example(steps=[("add", 8), ("ack_first", 6), ("add", 1), ("take", 10, 0)])  # renumbered, then taken
@example(steps=[("add", 6), ("take", 2, 0), ("take", 2, 0), ("release", [3, 2]), ("release", [0]),
                ("take", 3, 1), ("add", 2), ("take", 9, 0)])  # released in any order, taken in theirs
def test_take_equals_a_walk_that_skips_what_is_in_flight(tmp_path_factory: pytest.TempPathFactory,
                                                          steps: list[tuple[Any, ...]]) -> None:
    store = SQLiteStore(tmp_path_factory.mktemp("outbox") / "s.db")
    token = store.acquire("c", 0)
    box = Outbox(store, "c", 0)
    box.renumber_slack = 0  # renumbered often: the order must survive it
    pending: list[str] = []  # the model: record ids in checkpoint order
    inflight: set[str] = set()
    n = 0
    for step in steps:
        if step[0] == "add":
            prods = [Production("d", "s", Record(f"k{i % 4}", b"", i, f"r{i}")) for i in range(n, n + step[1])]
            n += step[1]
            store.checkpoint(Checkpoint("c", 0, token, 0, productions=prods))
            box.add(prods)
            pending += [p.record.record_id for p in prods]
        elif step[0] == "take":
            limit, skip = step[1], step[2]

            def skipped(rid: str, skip: int = skip) -> bool:
                return skip != 0 and int(rid[1:]) % 4 == skip
            want = [r for r in pending if r not in inflight and not skipped(r)][:limit]
            got = [p.record.record_id for p in box.take(limit, (lambda p: skipped(p.record.record_id))
                                                        if skip else None)]
            assert got == want
            inflight.update(got)
        elif step[0] == "release":
            keys = [f"r{i}" for i in step[1]]
            box.release(("d", k) for k in keys)
            inflight.difference_update(keys)
        elif step[0] in ("ack", "ack_first"):
            keys = [f"r{i}" for i in step[1]] if step[0] == "ack" else pending[:step[1]]
            box.ack(token, [("d", k) for k in keys])
            pending = [r for r in pending if r not in keys]
            inflight.difference_update(keys)
        else:
            box.release_all()
            inflight.clear()
        assert box.taken() == len(inflight)
        assert box.hold() == min((int(r[1:]) for r in pending), default=MAX_TIMESTAMP)  # a record's time: its number
    assert [p.record.record_id for p in box.take(1 << 30)] == [r for r in pending if r not in inflight]
    assert Outbox(store, "c", 0).take(1 << 30) == box.pending(1 << 30)  # a new mirror: the store's order
    store.close()
