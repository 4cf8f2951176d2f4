"""Failures of real service processes mid-stream; every run's outputs must equal a
failure-free run record for record, and no served watermark may go backwards.

* kill -9 of a worker (by signal, and at exact crash points via MILLWHEEL_CRASH_AT);
* a zombie: a worker SIGSTOPped until its ranges move, then SIGCONTed;
* a controller killed and restarted on the same port.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable

import pytest

from millwheel.topology import Topology
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.rpc.server import channel
from tests.support import pipelines
from tests.support.pause import stop_outside_writes
from tests.support.service_cluster import (
    Cluster,
    WatermarkMonitor,
    expected_outputs,
    wait_for,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
DISORDER = 2 * pipelines.SECOND
FAULT_AT = 6  # after this many inject messages


def run_pipeline(cluster: Cluster, tmp_path: Path, fault: Callable[[], None],
                 topology: Topology | None = None) -> WatermarkMonitor:
    """Register the pipeline, inject with ``fault`` mid-stream, wait for the end, and
    compare every sink with the failure-free run."""
    topology = topology or pipelines.topology(key_ranges=3)
    records = pipelines.workload(n=1200)
    cluster.register(topology)
    cluster.wait_balanced()
    monitor = WatermarkMonitor(cluster.client)

    def between(i: int) -> None:
        time.sleep(0.05)
        if i == FAULT_AT:
            fault()

    cluster.inject("events", "events", records, batch=60, max_disorder_us=DISORDER, done=True,
                   between=between)
    cluster.wait_watermark("totals", timeout=120)
    monitor.stop()
    want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
    assert cluster.outputs("counts") == want["counts"]
    assert cluster.outputs("totals") == want["totals"]
    assert monitor.samples > 5
    assert monitor.backwards == []
    return monitor


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_kill9_worker_mid_stream(store: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    cluster: Cluster = request.getfixturevalue("cluster" if store == "sqlite" else "redis_service")
    workers = [cluster.start_worker() for _ in range(3)]
    victim = workers[1]
    victim_id = cluster.worker_id(victim)
    assert victim_id is not None

    def kill() -> None:
        assert cluster.ranges_of(victim_id)
        os.kill(victim.pid, signal.SIGKILL)

    run_pipeline(cluster, tmp_path, kill)
    assert victim.wait(5) == -signal.SIGKILL
    status = cluster.client.status()
    assert all(r.worker_id and r.worker_id != victim_id for r in status.ranges)
    assert not next(w for w in status.workers if w.worker_id == victim_id).alive


@pytest.mark.parametrize("point", ["after_checkpoint:20", "after_ack:6"])
def test_worker_killed_at_crash_point(cluster: Cluster, tmp_path: Path, point: str) -> None:
    crashing = cluster.start_worker(env={"MILLWHEEL_CRASH_AT": point})
    cluster.start_worker()
    cluster.start_worker()
    run_pipeline(cluster, tmp_path, lambda: None)
    assert crashing.poll() == -signal.SIGKILL, "the crash point was reached"


def test_zombie_worker_writes_nothing_visible(cluster: Cluster, tmp_path: Path) -> None:
    workers = [cluster.start_worker() for _ in range(3)]
    zombie = workers[2]
    zombie_id = cluster.worker_id(zombie)
    assert zombie_id is not None
    held: list[tuple[str, int, int]] = []
    refusals: list[pb.DeliverAck] = []
    zombie_address = next(w.address for w in cluster.client.status().workers if w.worker_id == zombie_id)

    def pause_until_moved() -> None:
        held.extend(cluster.ranges_of(zombie_id))
        assert held
        stop_outside_writes(zombie.pid)  # a SQLite write lock held while stopped would stop all
        wait_for(lambda: not cluster.ranges_of(zombie_id), 20, "the paused worker's ranges to move")
        # Resume it while the controller cannot tell it about the move, so it goes on
        # working on its old ranges with its old tokens for a while: a true zombie.
        assert cluster.controller is not None
        stop_outside_writes(cluster.controller.pid)
        os.kill(zombie.pid, signal.SIGCONT)
        try:
            # A sender with a stale view hands it a new record for a range it held:
            # it processes it, its checkpoint is fenced, and it refuses the batch.
            node, rid, _token = next(u for u in held if not u[0].startswith("injector:"))
            stray = pb.Record(key="stray", value=b'{"user": "stray"}', id="stray-1",
                              timestamp=pipelines.workload(n=1)[0].timestamp + 30 * pipelines.SECOND)
            with channel(zombie_address) as ch:
                acks = list(pb_grpc.WorkerStub(ch).Deliver(iter([pb.DeliverBatch(
                    batch_id=1, computation=node, range_id=rid, records=[stray])]), timeout=10))
            refusals.extend(acks)
            time.sleep(0.5)
        finally:
            os.kill(cluster.controller.pid, signal.SIGCONT)

    run_pipeline(cluster, tmp_path, pause_until_moved)
    # Its old ranges all carry newer tokens now; it is alive again and kept running.
    current = {(r.node, r.range_id): r.token for r in cluster.client.status().ranges}
    assert all(current[(node, rid)] > token for node, rid, token in held)
    assert zombie.poll() is None
    assert [a.status for a in refusals] == [pb.DeliverAck.NOT_OWNER]
    assert "fenced" in refusals[0].message
    assert "stray" not in {k for k, *_ in cluster.outputs("totals")}


def test_controller_restart_loses_no_registration_or_watermark(cluster: Cluster, tmp_path: Path) -> None:
    for _ in range(3):
        cluster.start_worker()
    before: dict[str, object] = {}

    def restart() -> None:
        before["names"] = [c.spec.name for c in cluster.client.computations().computations]
        before["wms"] = {w.node: w.low_watermark for w in cluster.client.watermarks()}
        assert cluster.controller is not None
        os.kill(cluster.controller.pid, signal.SIGKILL)
        cluster.controller.wait(5)
        time.sleep(0.3)
        cluster.start_controller()
        after = {w.node: w.low_watermark for w in cluster.client.watermarks()}
        assert [c.spec.name for c in cluster.client.computations().computations] == before["names"]
        assert all(after[node] >= wm for node, wm in before["wms"].items())  # type: ignore[attr-defined]

    run_pipeline(cluster, tmp_path, restart)
    assert before["names"] == ["parse", "counts", "totals"]


def test_range_fenced_behind_the_controllers_back_is_reissued(cluster: Cluster, tmp_path: Path) -> None:
    """Someone else bumps a range's token in the store (as a controller crash in the
    middle of a move would leave it): the owner's writes are fenced, the controller
    issues a fresh token, and nothing is lost or doubled."""
    from millwheel.state import open_store

    for _ in range(2):
        cluster.start_worker()
    store = open_store(cluster.store_url)
    stolen: list[int] = []

    def steal() -> None:
        stolen.append(store.acquire("counts", 0))

    try:
        run_pipeline(cluster, tmp_path, steal)
    finally:
        store.close()
    token = next(r.token for r in cluster.client.status().ranges if (r.node, r.range_id) == ("counts", 0))
    assert token > stolen[0]
