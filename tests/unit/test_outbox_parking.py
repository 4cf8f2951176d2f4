"""One failing consumer range's share of a producer's outbox waits in the store, not in
memory, and nothing of it is lost, reordered or held back from the others
(millwheel/runtime/outbox.py, services/worker/parking.py), over a real SQLite store."""

from __future__ import annotations

from pathlib import Path

from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.runtime.outbox import Outbox
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Topology
from services.worker.parking import UNKNOWN, ConsumerBackoff, UnitOf, park_failing, plan


def topology(bad_ranges: int = 1) -> Topology:
    def comp(name: str, ranges: int) -> ComputationSpec:
        from millwheel.topology import Options

        return ComputationSpec(name, (InputSpec("s"),), (f"{name}-out",), CodeRef("map", {"key": "key"}),
                               Options(key_ranges=ranges))
    return Topology((comp("good", 1), comp("bad", bad_ranges)))


def checkpoint(store: SQLiteStore, token: int, box: Outbox, start: int, n: int) -> list[Production]:
    prods = [Production(c, "s", Record(f"k{i}", b"v", 1000 + i, f"r{i}"))
             for i in range(start, start + n) for c in ("good", "bad")]
    store.checkpoint(Checkpoint("injector:x", 0, token, 0, productions=prods))
    box.add(prods)
    return prods


def test_a_failing_share_is_parked_in_the_store_and_comes_back_in_order(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    token = store.acquire("injector:x", 0)
    box = Outbox(store, "injector:x", 0)
    unit_of = UnitOf(topology())
    consumers = ConsumerBackoff()
    checkpoint(store, token, box, 0, 100)
    consumers.failed(("bad", 0), "its checkpoints fail")
    assert park_failing(box, consumers, unit_of, keep=10) == 90  # its oldest 10 stay, to retry
    assert box.in_memory() == 110 and len(box) == 200 and box.hold() == 1000
    checkpoint(store, token, box, 100, 50)  # new entries of the parked share go to the store alone
    assert box.in_memory() == 160 and len(box) == 300

    # The healthy consumer's entries are all planned (the failing one is in backoff).
    sent = plan(box, consumers, 1000, unit_of, keep=10, chunk=40)
    assert {p.consumer for p in sent} == {"good"} and len(sent) == 150
    box.ack(token, [(p.consumer, p.record.record_id) for p in sent])
    assert box.in_memory() == 10 and len(box) == 150
    assert box.hold() == 1000  # the parked share still holds the watermark

    # It recovers: its probes are acked, then its share comes back a chunk at a time,
    # oldest first, and every entry exactly once.
    consumers.succeeded(("bad", 0))
    got: list[str] = []
    for _ in range(20):
        batch = plan(box, consumers, 15, unit_of, keep=10, chunk=40)
        if not batch:
            break
        assert box.in_memory() <= 2 * 40
        got += [p.record.record_id for p in batch]
        box.ack(token, [(p.consumer, p.record.record_id) for p in batch])
    assert got == [f"r{i}" for i in range(150)]
    assert len(box) == 0 and box.in_memory() == 0 and not box.parked and box.hold() == MAX_TIMESTAMP
    assert store.read_outbox("injector:x", 0) == []
    store.close()


def test_an_unregistered_consumer_is_parked_and_returns_when_registered_again(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    token = store.acquire("injector:x", 0)
    box = Outbox(store, "injector:x", 0)
    checkpoint(store, token, box, 0, 60)
    only_good = UnitOf(Topology((topology().computations[0],)))
    consumers = ConsumerBackoff()
    consumers.failed(("bad", UNKNOWN), "not a registered computation")
    sent = plan(box, consumers, 100, only_good, keep=5, chunk=20)
    assert {p.consumer for p in sent} == {"good"} and box.in_memory() == 65 and len(box) == 120
    box.ack(token, [(p.consumer, p.record.record_id) for p in sent])

    # Registered again with three key ranges: its share is found under the old mapping
    # and comes back into memory, to be routed to its new ranges.
    again = UnitOf(topology(bad_ranges=3))
    consumers.parked_under = only_good  # what the worker sets when the registry changes
    batch = plan(box, consumers, 100, again, keep=5, chunk=20)
    assert not box.parked and not consumers.failing
    assert len(batch) == 60 and {p.consumer for p in batch} == {"bad"}
    assert {again(p) for p in batch} == {("bad", 0), ("bad", 1), ("bad", 2)}
    store.close()
