"""A worker closes its links to addresses that own no range (a restarted worker comes
back at another port): the link, its gRPC channel and its metric series go, unless a
batch on it still waits for its ack. Real gRPC on loopback: a Worker service that
holds every batch until the test lets it ack."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Iterator

import grpc
import pytest

from services.generated import millwheel_pb2 as pb
from services.metrics import PrometheusSensors
from services.rpc.server import start_server
from services.rpc.worker_link import LinkError, PeerLink
from services.worker.delivery import PeerLinks
from services.worker.failing import RangeFailures
from services.worker.progress import NoProgress
from services.worker.send import Sender
from services.worker.shared import Shared
from services.worker.units import OwnerInfo


class HeldWorker:
    """Acks each batch only once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Deliver(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.DeliverAck]:
        for batch in requests:
            self.release.wait(30)
            yield pb.DeliverAck(batch_id=batch.batch_id, status=pb.DeliverAck.OK)


def Links(owners: dict[tuple[str, int], OwnerInfo]) -> Sender:
    """The part of a worker that keeps links, over its owner table, links and metrics."""
    shared = Shared()
    shared.owners = owners
    sensors = PrometheusSensors("worker")

    def unused(*args: Any) -> Any:
        raise AssertionError("not called by the links")

    return Sender(shared, PeerLinks(4, sensors), store=unused, failures=RangeFailures(), sensors=sensors,
                  crash=unused, progress=NoProgress(), watched=False, stopped=threading.Event(),
                  batch_size=10, max_slices=1, max_injector_outbox=10, delivery_timeout_s=5.0,
                  process=unused, commit=unused, rebuild=unused, fenced=unused)


def test_links_to_addresses_that_own_nothing_are_closed_once_idle() -> None:
    held = HeldWorker()
    server, port, _ = start_server("127.0.0.1:0", {"Worker": held})
    busy, owner, gone = f"127.0.0.1:{port}", "127.0.0.1:1", "127.0.0.1:2"
    w = Links({("count", 0): OwnerInfo("w-owner", owner, 1)})
    try:
        pending = w.peers.link(busy).try_send(pb.DeliverBatch(computation="count", range_id=1))
        assert pending is not None
        w.peers.link(owner)
        w.peers.link(gone)
        w.sensors.retry(gone)
        w.sensors.inflight(gone, 0)
        assert w.sensors.sample("millwheel_delivery_retries_total", {"destination": gone}) == 1

        assert w.sweep_links() == [gone]  # `busy` owns nothing either, but waits for an ack
        assert sorted(w.peers.links) == sorted([busy, owner])
        assert w.sensors.sample("millwheel_delivery_retries_total", {"destination": gone}) is None
        assert w.sensors.sample("millwheel_inflight_batches", {"destination": gone}) is None
        assert w.sensors.sample("millwheel_inflight_batches", {"destination": busy}) == 1

        held.release.set()
        assert pending.result(10).status == pb.DeliverAck.OK
        assert w.sweep_links() == [busy]
        assert list(w.peers.links) == [owner]
    finally:
        held.release.set()
        for link in w.peers.links.values():
            link.close()
        server.stop(0)


def test_a_closed_link_fails_a_batch_instead_of_raising() -> None:
    link = PeerLink("127.0.0.1:1", 2)
    link.close()
    fut: Future[Any] | None = link.try_send(pb.DeliverBatch(computation="count", range_id=0))
    assert fut is not None
    with pytest.raises(LinkError, match="closed"):
        fut.result(0)


def test_the_controllers_inject_links_go_with_the_workers_that_are_gone() -> None:
    """The controller's links to injectors' owners: opening a link closes the idle ones
    to addresses no live worker has (a restarted worker's old port)."""
    from services.controller.assign import WorkerState
    from services.controller.inject import WorkerLinks

    held = HeldWorker()
    server, port, _ = start_server("127.0.0.1:0", {"Worker": held})
    busy, old, new = f"127.0.0.1:{port}", "127.0.0.1:1", "127.0.0.1:2"

    plane = SimpleNamespace(lock=threading.RLock(), sensors=PrometheusSensors("controller"),
                            assigner=SimpleNamespace(workers={"w-new": WorkerState("w-new", new)}))
    links = WorkerLinks(plane)  # type: ignore[arg-type]
    try:
        pending = links.link(busy).try_send(pb.DeliverBatch(computation="count", range_id=0))
        assert pending is not None
        links.link(old)
        assert sorted(links.links) == sorted([busy, old])  # nothing to sweep yet: both were wanted
        links.link(new)  # `old` is idle and no live worker has it; `busy` waits for an ack
        assert sorted(links.links) == sorted([busy, new])
        held.release.set()
        assert pending.result(10).status == pb.DeliverAck.OK
        links.links.pop(new).close()
        links.link(new)
        assert list(links.links) == [new]
    finally:
        held.release.set()
        for link in links.links.values():
            link.close()
        server.stop(0)
