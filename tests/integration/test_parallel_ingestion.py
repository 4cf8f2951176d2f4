"""Parallel ingestion (docs/service.md, "Parallel ingestion"): writers send an injector's
records straight to the workers owning its key ranges, each writer with its own
watermark; the injector's watermark is the least of its live writers'.

Real controller and worker processes on loopback (tests/support/service_cluster.py),
written to with :class:`services.inject_writer.InjectWriter` as a user's program would.
Exactly-once is checked record by record against the failure-free local run, also with a
worker killed -9 while the writers write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc
import pytest

from millwheel.errors import MillWheelError
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record
from millwheel.topology import InjectorSpec, Topology
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.inject_writer import InjectWriter
from services.rpc.server import channel
from tests.support import pipelines
from tests.support.service_cluster import (
    PIPELINE_CODE,
    ROOT,
    Cluster,
    expected_outputs,
    start_cluster,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)
SECOND = 1_000_000
DISORDER = 2 * SECOND


def keyed(records: list[Record]) -> list[Record]:
    """The workload with each record keyed by its user (spread over the injector's ranges)."""
    return [Record(json.loads(r.value)["user"], r.value, r.timestamp, r.record_id) for r in records]


def topology(injector_ranges: int = 4) -> Topology:
    base = pipelines.topology(key_ranges=3)
    return Topology(base.computations, (InjectorSpec("events", "events", key_ranges=injector_ranges),),
                    base.log_streams)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, workers=2, allow_code=PIPELINE_CODE, controller_args=["--writer-expiry", "3"])
    try:
        yield c
    finally:
        c.stop()


def write_share(c: Cluster, name: str, records: list[Record], *, done: bool = True, batch: int = 60,
                pause_s: float = 0.01) -> None:
    """One writer: its records message by message, its watermark the newest time it has
    sent minus the disorder bound after each."""
    with InjectWriter(c.client, "events", stream="events", writer=name, timeout_s=60) as w:
        newest = MIN_TIMESTAMP
        for i in range(0, len(records), batch):
            chunk = records[i:i + batch]
            w.write(chunk)
            newest = max(newest, *(r.timestamp for r in chunk))
            w.advance(newest - DISORDER)
            time.sleep(pause_s)
        if done:
            w.done()


def test_two_writers_feed_one_injector_across_workers_exactly_once(cluster: Cluster, tmp_path: Path) -> None:
    topo = topology()
    cluster.register(topo)
    records = keyed(pipelines.workload(n=1200))
    shares = [records[0::2], records[1::2]]
    threads = [threading.Thread(target=write_share, args=(cluster, f"w{i}", share)) for i, share in enumerate(shares)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cluster.wait_watermark("totals", MAX_TIMESTAMP, timeout=90)
    want = expected_outputs(tmp_path, topo, pipelines.sources(records, DISORDER), ("counts", "totals"))
    assert cluster.outputs("counts") == want["counts"]
    assert cluster.outputs("totals") == want["totals"]
    # the injector's four ranges were spread over both workers: both took records
    owners = {r.worker_id for r in cluster.client.status().ranges if r.node == "injector:events"}
    assert len(owners) == 2


def writers_with_a_fault(cluster: Cluster, tmp_path: Path, fault: Callable[[], None]) -> None:
    """Two writers write the workload over ~6 s; ``fault()`` runs a second in; then the
    output must equal the failure-free run's, record by record."""
    topo = topology()
    records = keyed(pipelines.workload(n=1500))
    shares = [records[0::2], records[1::2]]
    threads = [threading.Thread(target=write_share, args=(cluster, f"w{i}", share),
                                kwargs={"batch": 30, "pause_s": 0.25}) for i, share in enumerate(shares)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    fault()
    for t in threads:
        t.join(180)
        assert not t.is_alive()
    cluster.wait_watermark("totals", MAX_TIMESTAMP, timeout=120)
    want = expected_outputs(tmp_path, topo, pipelines.sources(records, DISORDER), ("counts", "totals"))
    assert cluster.outputs("counts") == want["counts"]
    assert cluster.outputs("totals") == want["totals"]


def test_a_worker_killed_while_writers_write_loses_and_repeats_nothing(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(topology())
    cluster.start_worker()
    cluster.wait_balanced()
    # the first worker owns some of the injector's ranges
    writers_with_a_fault(cluster, tmp_path, lambda: os.kill(cluster.workers[0].pid, signal.SIGKILL))


def test_a_paused_worker_coming_back_as_a_zombie_writes_nothing_twice(cluster: Cluster, tmp_path: Path) -> None:
    """SIGSTOP a worker that owns injector ranges while writers write: their batches to it
    time out, its ranges move (new tokens), the writers send the batches to the new owners;
    then SIGCONT: what it still holds (Write batches read before the pause, its outboxes)
    is fenced or dropped downstream by record ID. The output equals the failure-free run."""
    cluster.register(topology())
    cluster.wait_balanced()
    paused = cluster.workers[0]

    def pause() -> None:
        os.kill(paused.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: all(r.worker_id and not r.worker_id.endswith(f"/{paused.pid}")
                                 for r in cluster.client.status().ranges), 30, "the paused worker's ranges to move")
            time.sleep(2.0)
        finally:
            os.kill(paused.pid, signal.SIGCONT)

    writers_with_a_fault(cluster, tmp_path, pause)


def injector_wm(c: Cluster) -> int:
    return c.client.watermarks("injector:events")[0].low_watermark


def test_the_injector_watermark_is_the_least_of_its_live_writers(cluster: Cluster) -> None:
    cluster.register(topology())
    a = InjectWriter(cluster.client, "events", writer="a")
    b = InjectWriter(cluster.client, "events", writer="b")
    c = InjectWriter(cluster.client, "events", writer="c")
    try:
        a.advance(5_000 * SECOND, now=True)
        c.advance(4_000 * SECOND, now=True)
        b.advance(3_000 * SECOND, now=True)
        wait_for(lambda: injector_wm(cluster) == 3_000 * SECOND, 20, "the least writer's watermark")
        time.sleep(1.0)
        assert injector_wm(cluster) == 3_000 * SECOND  # b holds it: not past
        a.done()  # done for itself alone: b and c still hold the injector
        time.sleep(1.0)
        assert injector_wm(cluster) == 3_000 * SECOND
        b.close()  # b vanishes (no done): after the expiry (3 s here) it holds nothing
        wait_for(lambda: injector_wm(cluster) == 4_000 * SECOND, 30, "b to expire")
        # a writer joining later starts at the injector's watermark: it cannot pull it back
        d = InjectWriter(cluster.client, "events", writer="d")
        d.advance(3_500 * SECOND, now=True)
        time.sleep(1.0)
        assert injector_wm(cluster) == 4_000 * SECOND
        d.done()
        c.done()  # every live writer done: the injector is closed
        wait_for(lambda: injector_wm(cluster) == MAX_TIMESTAMP, 20, "the injector to close")
        late = InjectWriter(cluster.client, "events", writer="late")
        with pytest.raises(MillWheelError) as err:
            late.write([Record("k", b"{}", 9_000 * SECOND, "late-1")])
            late.flush()
        assert getattr(err.value, "status", None) == grpc.StatusCode.FAILED_PRECONDITION
        assert "injector 'events' is closed" in str(err.value)
    finally:
        for w in (a, b, c):
            w._closed.set()


def test_a_new_controller_knows_the_writers_a_lagging_one_still_holds_the_injector(cluster: Cluster) -> None:
    """The writers' names are kept in the store: after the controller is killed -9 and
    started again, a writer that has not spoken since still holds the injector back, where
    a controller knowing only the writers that spoke would move it past that writer."""
    cluster.register(topology())
    a = InjectWriter(cluster.client, "events", writer="a")
    b = InjectWriter(cluster.client, "events", writer="b")
    try:
        a.advance(5_000 * SECOND, now=True)
        b.advance(3_000 * SECOND, now=True)
        wait_for(lambda: injector_wm(cluster) == 3_000 * SECOND, 20, "the least writer's watermark")
        assert cluster.controller is not None
        os.kill(cluster.controller.pid, signal.SIGKILL)
        cluster.controller.wait(10)
        cluster.start_controller()
        a.advance(6_000 * SECOND, now=True)  # b has not spoken to the new controller
        time.sleep(1.0)
        assert injector_wm(cluster) == 3_000 * SECOND
        b.advance(4_000 * SECOND, now=True)
        wait_for(lambda: injector_wm(cluster) == 4_000 * SECOND, 20, "b's watermark")
    finally:
        for w in (a, b):
            w._closed.set()


def test_a_stuck_watermark_says_what_holds_it(cluster: Cluster) -> None:
    """GetWatermark's held_by (and ``millwheel watermark --why``): a computation waiting for
    its input names its slowest upstream node, and the injector names its slowest live
    writer; when that writer advances, the answer follows."""
    cluster.register(topology())
    fast = InjectWriter(cluster.client, "events", writer="fast")
    slow = InjectWriter(cluster.client, "events", writer="slow")
    try:
        fast.advance(5_000 * SECOND, now=True)
        slow.advance(2_000 * SECOND, now=True)
        wait_for(lambda: injector_wm(cluster) == 2_000 * SECOND, 20, "the slow writer's watermark")
        wait_for(lambda: cluster.client.watermarks("totals")[0].low_watermark >= 2_000 * SECOND, 20,
                 "the watermark to reach the last stage")
        held = {w.node: w.held_by for w in cluster.client.watermarks()}
        assert held["parse"] == "input: injector:events"
        assert held["counts"] == "input: parse" and held["totals"] == "input: counts"
        assert held["injector:events"].startswith("writer 'slow' at 1970-01-01T00:33:20.000Z (heard ")
        why = subprocess.run([sys.executable, "-m", "services.cli", "watermark", "totals", "--why", "--json",
                              "--controller", cluster.address], capture_output=True, text=True, timeout=60,
                             cwd=ROOT)
        chain = [(w["node"], w["held_by"]) for w in json.loads(why.stdout)]
        assert [n for n, _ in chain] == ["totals", "counts", "parse", "injector:events"], why.stdout + why.stderr
        assert "writer 'slow'" in chain[-1][1]
        slow.done()
        fast.done()
        wait_for(lambda: cluster.client.watermarks("injector:events")[0].held_by == "", 20, "done: nothing holds it")
    finally:
        for w in (fast, slow):
            w._closed.set()


def test_write_refuses_what_is_not_an_injector_range(cluster: Cluster) -> None:
    """The client token opens Ingest.Write, and it reaches injector ranges only: a batch for
    an unknown injector or a range it does not have, or records without IDs, is refused
    and changes nothing."""
    cluster.register(topology())
    routes = cluster.client.inject_routes(pb.InjectRoutesRequest(injector="events"))
    address = next(o.worker_address for o in routes.ranges if o.worker_address)
    stub = pb_grpc.IngestStub(channel(address))

    def one(req: pb.WriteRequest) -> pb.WriteAck:
        return next(iter(stub.Write(iter([req]), timeout=10)))

    r = next(o.range_id for o in routes.ranges if o.worker_address == address)
    # (the worker learns the registry at its next heartbeat: until then it knows no injector)
    wait_for(lambda: one(pb.WriteRequest(injector="events", range_id=r)).status == pb.WriteAck.OK, 20,
             "the worker to know the injector")
    ack = one(pb.WriteRequest(injector="parse", range_id=0, records=[pb.Record(key="k", value=b"{}", id="x")]))
    assert ack.status == pb.WriteAck.NOT_OWNER and "no injector" in ack.message
    with pytest.raises(grpc.RpcError) as err:
        one(pb.WriteRequest(injector="events", range_id=9, records=[pb.Record(key="k", value=b"{}", id="x")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "range_id 9" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        one(pb.WriteRequest(injector="events", range_id=r, records=[pb.Record(key="k", value=b"{}")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs an 'id'" in err.value.details()
    assert cluster.outputs("counts") == []


def test_a_client_holding_write_streams_open_stops_no_pipeline(cluster: Cluster, tmp_path: Path) -> None:
    """Writers reach a worker on a listener of its own, admitted per client: a client that
    opens Write streams and sends nothing holds at most its share of that listener (past
    it: RESOURCE_EXHAUSTED naming the limit), while records between workers, the
    controller's Inject and the heartbeats go on (before, the streams took the threads of
    the worker's one server, Deliver's included, and the pipeline stopped)."""
    topo = topology()
    cluster.register(topo)
    routes = cluster.client.inject_routes(pb.InjectRoutesRequest(injector="events"))
    ingest = sorted({o.worker_address for o in routes.ranges if o.worker_address})
    assert ingest and not set(ingest) & {w.address for w in cluster.client.status().workers}
    held: list[threading.Event] = []
    calls: dict[str, list[grpc.Future]] = {}
    for address in ingest:
        stub = pb_grpc.IngestStub(channel(address))
        for _ in range(40):  # more than a client's 32 streams
            stop = threading.Event()
            held.append(stop)
            # sends nothing until stopped
            calls.setdefault(address, []).append(stub.Write(iter(stop.wait, True), timeout=120))
    try:
        # The calls reach the worker concurrently, so which 32 are admitted is not the order
        # they were opened in: per listener, 8 end (refused) and 32 stay open.
        def ended(address: str) -> list[grpc.Future]:
            return [c for c in calls[address] if c.done()]

        for address in ingest:
            wait_for(lambda a=address: len(ended(a)) >= 8, 30, f"8 Write streams to {address} refused")
        time.sleep(0.5)  # (a ninth refusal, were there one, has had time to arrive)
        for address in ingest:
            refused = ended(address)
            assert len(refused) == 8, [(c.code(), c.details()) for c in refused]
            assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refused), \
                [(c.code(), c.details()) for c in refused]
            assert all("--max-client-streams=32" in (c.details() or "") for c in refused)
        # the pipeline flows meanwhile: records through the controller to the sink, exactly
        records = keyed(pipelines.workload(n=300))
        cluster.inject("events", "events", records, batch=100, max_disorder_us=DISORDER, done=True)
        cluster.wait_watermark("totals", MAX_TIMESTAMP, timeout=60)
        want = expected_outputs(tmp_path, topo, pipelines.sources(records, DISORDER), ("counts",))
        assert cluster.outputs("counts") == want["counts"]
        assert all(w.alive for w in cluster.client.status().workers)
    finally:
        for stop in held:
            stop.set()
        for call in (c for per_address in calls.values() for c in per_address):
            call.cancel()
