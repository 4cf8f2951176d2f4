"""The outbox's hold (oldest pending timestamp, which holds the output watermark) is
kept as entries are added and acked; it must always equal a scan of what is pending."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.runtime.outbox import Outbox
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.sqlite_store import SQLiteStore

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.tuples(st.integers(0, 30), st.integers(0, 1000)), max_size=6)),
    st.tuples(st.just("ack"), st.lists(st.integers(0, 30), max_size=6)),
    st.tuples(st.just("hold"), st.just([])),
), max_size=40)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_hold_equals_a_scan_whatever_the_order(tmp_path_factory: pytest.TempPathFactory,
                                               steps: list[tuple[str, list[Any]]]) -> None:
    tmp: Path = tmp_path_factory.mktemp("outbox")
    store = SQLiteStore(tmp / "s.db")
    token = store.acquire("c", 0)
    box = Outbox(store, "c", 0)
    pending: dict[tuple[str, str], int] = {}
    ts_of: dict[int, int] = {}
    for kind, args in steps:
        if kind == "add":
            prods = []
            for rid, ts in args:
                ts = ts_of.setdefault(rid, ts)  # a record ID always has one timestamp
                prods.append(Production("d", "s", Record("k", b"", ts, f"r{rid}")))
            store.checkpoint(Checkpoint("c", 0, token, 0, productions=prods))
            box.add(prods)
            pending.update({("d", p.record.record_id): p.record.timestamp for p in prods})
        elif kind == "ack":
            acked = [("d", f"r{rid}") for rid in args]
            box.ack(token, acked)
            for entry in acked:
                pending.pop(entry, None)
        assert box.hold() == min(pending.values(), default=MAX_TIMESTAMP)
    store.close()
