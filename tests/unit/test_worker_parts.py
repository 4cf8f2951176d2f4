"""The worker's receiving and sending parts, each alone: no gRPC server, no worker
process, over a real SQLite store (services/worker/receive.py, services/worker/send.py).

The receiver refuses what a range's owner must not take (a range not owned here, a
stale token, records routed under another key-range count, an Inject session's
messages out of order); the sender sends each outbox entry to the owner of its
consumer range, deletes entries only once they are acked, and holds back a consumer
range in backoff while the others go on.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

from millwheel.clock import SystemClock
from millwheel.errors import FencedError
from millwheel.keys import key_range
from millwheel.operators import build_computation
from millwheel.record import Record
from millwheel.runtime.outbox import Outbox
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router
from millwheel.sensors import NullSensors
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.generated import millwheel_pb2 as pb
from services.metrics import PrometheusSensors
from services.rpc import convert
from services.worker.failing import RangeFailures
from services.worker.progress import NoProgress
from services.worker.receive import DeliverServicer, Receiver
from services.worker.send import Sender
from services.worker.shared import Shared
from services.worker.units import OwnedRange, OwnerInfo

ME = "w-me"
RANGES = 2
COUNT = ComputationSpec("count", (InputSpec("events"),), ("out",), CodeRef("map", {"key": "key"}),
                        Options(key_ranges=RANGES))
TOPOLOGY = Topology((COUNT,), (InjectorSpec("src", "events"),))


def keys_in(range_id: int, n: int = 3) -> list[str]:
    """``n`` keys of ``count``'s key range ``range_id``."""
    keys = (f"k{i}" for i in range(1000))
    return [k for k in keys if key_range(k, RANGES) == range_id][:n]


def records(keys: list[str], tag: str = "") -> list[Record]:
    return [Record(k, f"v{i}".encode(), 1_000 + i, f"{tag}r{i}-{k}") for i, k in enumerate(keys)]


def shared_view(version: int = 1) -> Shared:
    shared = Shared()
    shared.worker_id = ME
    shared.topology, shared.version = TOPOLOGY, version
    shared.router = Router(TOPOLOGY)
    return shared


class Calls:
    """Records the calls a part makes back into range ownership."""

    def __init__(self) -> None:
        self.fenced: list[tuple[OwnedRange, FencedError]] = []
        self.dropped: list[tuple[OwnedRange, str]] = []

    def on_fenced(self, owned: OwnedRange, exc: FencedError) -> None:
        self.fenced.append((owned, exc))

    def on_drop(self, owned: OwnedRange, reason: str) -> None:
        self.dropped.append((owned, reason))


def not_called(*args: Any) -> Any:
    raise AssertionError(f"not expected here: {args}")


def receiver(shared: Shared, store: SQLiteStore, calls: Calls) -> Receiver:
    return Receiver(shared, peers=not_called, store=store, failures=RangeFailures(),  # type: ignore[arg-type]
                    clock=SystemClock(), crash=lambda point: None, progress=NoProgress(), watched=False,
                    batch_size=100, max_injector_outbox=1_000, weak_wait_s=1.0,
                    fenced=calls.on_fenced, drop=calls.on_drop, new_range_worker=not_called)


def own_count(shared: Shared, store: SQLiteStore, range_id: int) -> OwnedRange:
    """Take ``count``'s range under a fresh token, as the worker process does."""
    rw = RangeWorker(COUNT, range_id, store, build_computation(COUNT), shared.router, SystemClock(),
                     NullSensors())
    owned = shared.units[("count", range_id)] = OwnedRange("count", range_id, rw.token, store, worker=rw)
    return owned


def own_injector(shared: Shared, store: SQLiteStore) -> OwnedRange:
    node = "injector:src"
    owned = shared.units[(node, 0)] = OwnedRange(node, 0, store.acquire(node, 0), store)
    return owned


# -- the receiver ------------------------------------------------------------------------
def test_a_batch_for_a_range_not_owned_here_is_refused_and_not_consumed(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    shared, calls = shared_view(), Calls()
    own_count(shared, store, 0)
    batch = records(keys_in(1))

    ack = receiver(shared, store, calls).process("count", 1, batch)

    assert ack.status == pb.DeliverAck.NOT_OWNER
    assert ack.message == f"{ME} does not own count/1"
    assert store.contains_ids("count", 1, [r.record_id for r in batch]) == set()
    store.close()


def test_a_batch_under_a_superseded_token_is_refused_and_nothing_of_it_is_written(tmp_path: Path) -> None:
    """A zombie: the range moved (a newer token) while this worker still holds it. Its
    checkpoint is fenced, the batch is refused NOT_OWNER (the sender sends it to the
    new owner), and the range is handed back to ownership to be dropped."""
    store = SQLiteStore(tmp_path / "s.db")
    shared, calls = shared_view(), Calls()
    owned = own_count(shared, store, 0)
    store.acquire("count", 0)  # the new owner's token
    batch = records(keys_in(0))

    ack = receiver(shared, store, calls).process("count", 0, batch)

    assert ack.status == pb.DeliverAck.NOT_OWNER
    assert [o for o, _ in calls.fenced] == [owned]
    assert store.contains_ids("count", 0, [r.record_id for r in batch]) == set()
    store.close()


def test_a_batch_under_the_current_token_is_consumed_once(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    shared, calls = shared_view(), Calls()
    own_count(shared, store, 0)
    batch = records(keys_in(0))
    recv = receiver(shared, store, calls)

    assert recv.process("count", 0, batch).status == pb.DeliverAck.OK
    ids = [r.record_id for r in batch]
    assert store.contains_ids("count", 0, ids) == set(ids)
    assert recv.process("count", 0, batch).status == pb.DeliverAck.OK  # resent: a duplicate, acked
    assert calls.fenced == []
    store.close()


def test_records_routed_under_another_key_range_count_are_not_taken(tmp_path: Path) -> None:
    """A sender under another registry (a rescale) routed records of range 1 to range 0:
    refused FAILED (sent again once both registries agree), nothing consumed."""
    store = SQLiteStore(tmp_path / "s.db")
    shared, calls = shared_view(version=7), Calls()
    own_count(shared, store, 0)
    stray = records(keys_in(1))

    ack = receiver(shared, store, calls).process("count", 0, stray)

    assert ack.status == pb.DeliverAck.FAILED
    assert "version 7" in ack.message
    assert store.contains_ids("count", 0, [r.record_id for r in stray]) == set()
    assert calls.fenced == []
    store.close()


def inject_batch(seq: int, keys: list[str], *, session: str = "s1", version: int = 1) -> pb.DeliverBatch:
    b = pb.DeliverBatch(computation="injector:src", range_id=0, topology_version=version,
                        inject_session=session, inject_seq=seq)
    convert.add_records(b.records, records(keys, tag=f"m{seq}-"))
    return b


def deliver(servicer: DeliverServicer, batches: list[pb.DeliverBatch]) -> list[pb.DeliverAck]:
    for i, b in enumerate(batches):
        b.batch_id = i + 1
    return list(servicer.Deliver(iter(batches), context=None))  # type: ignore[arg-type]


def test_an_inject_sessions_messages_are_taken_in_order_only(tmp_path: Path) -> None:
    """Message 3 arriving before 2 is refused (the controller resends from the first
    refused one); 2 and then 3 are taken, and the injector's outbox holds the records
    in message order. Another session has its own order."""
    store = SQLiteStore(tmp_path / "s.db")
    shared, calls = shared_view(), Calls()
    owned = own_injector(shared, store)
    servicer = DeliverServicer(receiver(shared, store, calls), shared)

    acks = deliver(servicer, [inject_batch(1, ["a"]), inject_batch(3, ["c"]), inject_batch(2, ["b"]),
                              inject_batch(3, ["c"]), inject_batch(1, ["x"], session="s2")])

    assert [(a.batch_id, a.status) for a in acks] == [
        (1, pb.DeliverAck.OK), (2, pb.DeliverAck.FAILED), (3, pb.DeliverAck.OK), (4, pb.DeliverAck.OK),
        (5, pb.DeliverAck.OK)]
    assert "out of order" in acks[1].message
    assert owned.outbox is not None
    assert [p.record.key for p in owned.outbox.pending(10)] == ["a", "b", "c", "x"]
    assert [p.record.key for p in Outbox(store, "injector:src", 0).pending(10)] == ["a", "b", "c", "x"]
    store.close()


def test_a_batch_of_a_newer_registry_waits_until_it_is_known_here(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    shared, calls = shared_view(version=1), Calls()
    owned = own_injector(shared, store)
    servicer = DeliverServicer(receiver(shared, store, calls), shared)

    [ack] = deliver(servicer, [inject_batch(1, ["a"], version=2)])

    assert ack.status == pb.DeliverAck.FAILED
    assert "registry version 2 not yet known here (have 1)" in ack.message
    assert owned.outbox is not None and len(owned.outbox) == 0
    store.close()


def test_an_injection_under_a_superseded_token_is_refused(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    shared, calls = shared_view(), Calls()
    owned = own_injector(shared, store)
    store.acquire("injector:src", 0)  # moved on

    ack = receiver(shared, store, calls).inject("injector:src", 0, records(["a", "b"]), None)

    assert ack.status == pb.DeliverAck.NOT_OWNER
    assert [o for o, _ in calls.fenced] == [owned]
    assert len(Outbox(store, "injector:src", 0)) == 0
    store.close()


# -- the sender --------------------------------------------------------------------------
class Link:
    """A peer link that keeps what it is sent; each batch's ack is the test's to give."""

    def __init__(self) -> None:
        self.sent: list[tuple[pb.DeliverBatch, Future[pb.DeliverAck]]] = []

    def try_send(self, batch: pb.DeliverBatch) -> Future[pb.DeliverAck]:
        fut: Future[pb.DeliverAck] = Future()
        self.sent.append((batch, fut))
        return fut

    def ack_all(self, status: int = pb.DeliverAck.OK) -> None:
        for _, fut in self.sent:
            if not fut.done():
                fut.set_result(pb.DeliverAck(status=status))


class Peers:
    """Links by address, opened on first use."""

    def __init__(self) -> None:
        self.links: dict[str, Link] = {}

    def link(self, address: str) -> Link:
        return self.links.setdefault(address, Link())


class Local:
    """The receiving side's ``process`` for consumer ranges owned here."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, int, list[str]]] = []
        self.streams: list[tuple[list[str], list[int]]] = []  # what each batch came on

    def __call__(self, computation: str, range_id: int, batch: list[Record],
                 streams: Sequence[str] = (), stream_of: Sequence[int] = ()) -> pb.DeliverAck:
        self.batches.append((computation, range_id, [r.key for r in batch]))
        self.streams.append((list(streams), list(stream_of)))
        return pb.DeliverAck(status=pb.DeliverAck.OK)


def sender(shared: Shared, store: SQLiteStore, peers: Peers, local: Local, calls: Calls) -> Sender:
    return Sender(shared, peers, store, RangeFailures(), sensors=PrometheusSensors("worker"),  # type: ignore[arg-type]
                  crash=lambda point: None, progress=NoProgress(), watched=False, stopped=threading.Event(),
                  batch_size=100, max_slices=4, max_injector_outbox=1_000, delivery_timeout_s=60.0,
                  process=local, commit=not_called, rebuild=not_called, fenced=calls.on_fenced)


@pytest.fixture
def injected(tmp_path: Path) -> Iterator[tuple[SQLiteStore, Shared, OwnedRange, dict[int, list[str]]]]:
    """An injector range owned here with records of both of ``count``'s ranges in its outbox."""
    store = SQLiteStore(tmp_path / "s.db")
    shared = shared_view()
    owned = own_injector(shared, store)
    keys = {0: keys_in(0), 1: keys_in(1)}
    with owned.lock:
        owned.inject([p for r in records(keys[0] + keys[1]) for p in shared.router.fan_out("events", r)], None, 1)
    yield store, shared, owned, keys
    store.close()


def stored(store: SQLiteStore) -> list[str]:
    """The keys of the injector's outbox as the store holds it (what a restart resends)."""
    return sorted(p.record.key for p in store.read_outbox("injector:src", 0))


def test_each_entry_goes_to_the_owner_of_its_key_range_and_is_deleted_once_acked(
        injected: tuple[SQLiteStore, Shared, OwnedRange, dict[int, list[str]]]) -> None:
    store, shared, owned, keys = injected
    shared.owners = {("count", 0): OwnerInfo("w-a", "a:1", 5), ("count", 1): OwnerInfo("w-b", "b:1", 6)}
    peers, calls = Peers(), Calls()
    send = sender(shared, store, peers, Local(), calls)

    assert send._pump(owned) == len(keys[0]) + len(keys[1])

    sent = {address: [b for b, _ in link.sent] for address, link in peers.links.items()}
    assert sorted(sent) == ["a:1", "b:1"]
    for address, range_id in (("a:1", 0), ("b:1", 1)):
        [batch] = sent[address]
        assert (batch.producer, batch.computation, batch.range_id, batch.topology_version) == \
            ("injector:src", "count", range_id, shared.version)
        assert [r.key for r in convert.records_from_proto(batch.records)] == keys[range_id]
        assert (list(batch.streams), list(batch.stream_of)) == (["events"], [])  # the input, once
    assert stored(store) == sorted(keys[0] + keys[1])  # sent is not delivered: still in the store

    peers.links["a:1"].ack_all()
    send._pump(owned)
    assert stored(store) == sorted(keys[0] + keys[1])  # the slice waits for all its acks
    peers.links["b:1"].ack_all(pb.DeliverAck.FAILED)
    send._pump(owned)
    assert stored(store) == sorted(keys[1])  # deleted: what its consumer acked; a refused batch stays
    assert ("count", 1) in owned.consumers.failing  # and its consumer range backs off alone
    assert calls.fenced == []


def test_a_consumer_range_owned_here_is_processed_in_place(
        injected: tuple[SQLiteStore, Shared, OwnedRange, dict[int, list[str]]]) -> None:
    store, shared, owned, keys = injected
    shared.owners = {("count", 0): OwnerInfo(ME, "me:1", 5), ("count", 1): OwnerInfo(ME, "me:1", 6)}
    peers, local = Peers(), Local()
    send = sender(shared, store, peers, local, Calls())

    send._pump(owned)
    assert local.batches == [("count", 0, keys[0]), ("count", 1, keys[1])]
    assert local.streams == [(["events"], []), (["events"], [])]
    assert peers.links == {}  # nothing went over a link
    send._pump(owned)  # finishes the slice
    assert stored(store) == []  # processed here: acked without a round trip


def test_a_consumer_range_in_backoff_is_held_back_while_the_others_are_sent(
        injected: tuple[SQLiteStore, Shared, OwnedRange, dict[int, list[str]]]) -> None:
    store, shared, owned, keys = injected
    shared.owners = {("count", 0): OwnerInfo("w-a", "a:1", 5), ("count", 1): OwnerInfo("w-b", "b:1", 6)}
    owned.consumers.failed(("count", 1), "its checkpoints fail")  # in backoff now
    peers = Peers()
    send = sender(shared, store, peers, Local(), Calls())

    send._pump(owned)

    assert list(peers.links) == ["a:1"]
    assert owned.outbox is not None and owned.outbox.taken() == len(keys[0])  # range 1's: not taken
    peers.links["a:1"].ack_all()
    send._pump(owned)
    assert stored(store) == sorted(keys[1])


def test_a_consumer_range_without_an_owner_is_not_sent_to(
        injected: tuple[SQLiteStore, Shared, OwnedRange, dict[int, list[str]]]) -> None:
    store, shared, owned, keys = injected
    shared.owners = {("count", 0): OwnerInfo("w-a", "a:1", 5)}  # range 1: nobody, for now
    peers = Peers()
    send = sender(shared, store, peers, Local(), Calls())

    send._pump(owned)

    assert list(peers.links) == ["a:1"]
    assert ("count", 1) in owned.consumers.failing  # it waits for an owner, alone
    assert stored(store) == sorted(keys[0] + keys[1])
