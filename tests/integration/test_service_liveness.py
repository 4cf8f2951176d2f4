"""Liveness never depends on processing, and user code runs under a deadline.

Real controller and worker processes (each worker with its watchdog process), real
gRPC. A background thread samples ClusterStatus throughout each test.

* one Inject message of 200,000 records: no worker is ever declared dead, every
  record is counted exactly once;
* a record whose user code holds the interpreter (one C call) for longer than the
  heartbeat timeout, within ``max_batch_seconds``: no worker is declared dead, the
  outputs equal a failure-free run;
* a record that overruns ``max_batch_seconds``: its worker is killed by its watchdog,
  then the record is run alone (killed again), then it is not run any more; the other
  records of its batch are processed exactly once and a live worker remains;
* a timer that overruns alone: its worker is killed, the next owner deletes it unrun;
* health: NOT_SERVING while the store (redis-server) is down, or (a worker) while its
  controller is, SERVING once it is back;
* Inject messages larger than --inject-batch keep their order and accepted counts.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from millwheel.record import Record
from millwheel.sources import ListSource
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.inject_limits import InjectLimits
from services.rpc.server import channel
from tests.support.service_cluster import PIPELINE_CODE, Cluster, expected_outputs, wait_for

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
SECOND = 1_000_000
CODE = "tests.support.slow_code:CountAndMaybeSpin"


class StatusSampler:
    """ClusterStatus every 0.1 s in the background: which workers were ever reported
    not alive, and the fewest live workers seen."""

    def __init__(self, client: ControllerClient) -> None:
        self.client = client
        self.samples = 0
        self.dead: set[str] = set()
        self.fewest_alive: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                workers = self.client.status().workers
            except Exception:  # noqa: BLE001 - a slow answer is not a dead worker
                continue
            self.samples += 1
            self.dead |= {w.worker_id for w in workers if not w.alive}
            alive = sum(w.alive for w in workers)
            self.fewest_alive = alive if self.fewest_alive is None else min(self.fewest_alive, alive)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def topology(exponent: int, key_ranges: int = 2, max_batch_seconds: float = 60.0) -> Topology:
    return Topology(
        computations=(ComputationSpec(
            "count", (InputSpec("events"),), ("out",), CodeRef(CODE, {"exponent": exponent}),
            Options(key_ranges=key_ranges, max_batch_seconds=max_batch_seconds)),),
        injectors=(InjectorSpec("events", "events"),),
        log_streams=("out",),
    )


def events(n: int, keys: int, spin_at: int | None = None) -> list[Record]:
    return [Record(f"k{i % keys}", b"spin" if i == spin_at else f"v{i}".encode(),
                   1_000 * SECOND + i, f"ev-{i}") for i in range(n)]


def one_message(records: list[Record]) -> pb.InjectRequest:
    return pb.InjectRequest(injector="events", stream="events", done=True, records=[
        pb.Record(key=r.key, value=r.value, timestamp=r.timestamp, id=r.record_id) for r in records])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A controller whose deployment allows the test pipelines' code and the spinner."""
    c = Cluster(tmp_path, allow_code=f"{PIPELINE_CODE},tests.support.slow_code")
    c.start_controller()
    try:
        yield c
    finally:
        c.stop()


def dead_letters(cluster: Cluster) -> list[dict[str, Any]]:
    return [json.loads(value) for _k, value, _ts, _id in cluster.outputs("count.dead_letters")]


def expected(tmp: Path, topo: Topology, records: list[Record]) -> list[tuple[str, bytes, int, str]]:
    return expected_outputs(tmp, topo, {"events": ListSource(records, 0)}, ("out",))["out"]


def test_the_largest_inject_message_starves_no_heartbeat(cluster: Cluster) -> None:
    """One message of --max-inject-records (100,000) records: split at the controller,
    no worker is ever declared dead, every record counted once. (A larger message is
    refused at once: test_service_security.py.)"""
    n, keys = InjectLimits.max_records, 50
    cluster.register(topology(exponent=1))
    for _ in range(2):
        cluster.start_worker("--batch-size", "5000")
    cluster.wait_balanced()
    sampler = StatusSampler(cluster.client)
    started = time.monotonic()
    with ControllerClient(cluster.address, timeout_s=600) as client:
        resp = client.inject([one_message(events(n, keys))])
    assert resp.accepted == n
    cluster.wait_watermark("count", timeout=400)
    took = time.monotonic() - started
    sampler.stop()
    want = collections.Counter(f"k{i % keys}" for i in range(n))
    got = {k: int(cluster.client.state("count", k).state) for k in want}
    assert got == dict(want)
    assert sampler.samples > 10
    assert sampler.dead == set(), f"declared dead during the message ({took:.0f} s): {sampler.dead}"


def test_gil_holding_record_within_deadline_keeps_its_worker_alive(cluster: Cluster, tmp_path: Path) -> None:
    records = events(300, keys=7, spin_at=120)
    topo = topology(exponent=999_999)
    cluster.register(topo)
    for _ in range(2):
        cluster.start_worker()
    cluster.wait_balanced()
    sampler = StatusSampler(cluster.client)
    started = time.monotonic()
    with ControllerClient(cluster.address, timeout_s=120) as client:
        client.inject([one_message(records)])
    cluster.wait_watermark("count", timeout=120)
    took = time.monotonic() - started
    sampler.stop()
    assert took > 2 * cluster.heartbeat_timeout_s, f"the record did not hold the worker ({took:.1f} s)"
    assert cluster.outputs("out") == expected(tmp_path, topology(exponent=1), records)
    assert sampler.dead == set(), f"a busy worker was declared dead: {sampler.dead}"
    assert all(p.poll() is None for p in cluster.workers)


def test_record_overrunning_its_deadline_is_isolated(cluster: Cluster, tmp_path: Path) -> None:
    """The batch overruns -> worker killed; its records run one by one -> the spinning
    one overruns alone -> worker killed; the third owner does not run it again: the error
    policy dead-letters it (once, with its DeadlineExceeded cause) and the rest flows."""
    records = events(240, keys=5, spin_at=100)
    spin = records[100]
    topo = topology(exponent=3 * 999_999, max_batch_seconds=2.0)
    cluster.register(topo)
    workers = [cluster.start_worker("--batch-size", "1000") for _ in range(4)]
    cluster.wait_balanced()
    # Let every worker apply the final assignment: a worker that has not yet seen its
    # range move would run the batch too (its writes fenced, but a third kill).
    time.sleep(1.0)
    sampler = StatusSampler(cluster.client)
    with ControllerClient(cluster.address, timeout_s=60) as client:
        client.inject([one_message(records)])
    good = [r for r in records if r is not spin]
    want = expected(tmp_path, topology(exponent=1), good)

    def done() -> bool:
        return cluster.outputs("out") == want and sum(p.poll() is not None for p in workers) >= 2
    wait_for(done, 120, "every other record's output, with two workers killed")
    time.sleep(3 * cluster.heartbeat_timeout_s)  # the refused record stays refused
    sampler.stop()
    assert cluster.outputs("out") == want
    killed = [p for p in workers if p.poll() is not None]
    # Two kills: the batch, then the record alone (a third only if a stale owner ran it too).
    assert 2 <= len(killed) <= 3 and all(p.returncode == -9 for p in killed)
    assert sampler.fewest_alive is not None and sampler.fewest_alive >= 1
    logs = "".join(cluster.log(f"worker{i}") for i in range(4))
    assert logs.count("over its deadline of 2.0 s: killed the worker") == len(killed)
    letters = dead_letters(cluster)
    assert [(d["record_id"], d["key"], d["exception_type"]) for d in letters] == [
        (spin.record_id, spin.key, "DeadlineExceeded")]
    assert "overran max_batch_seconds alone" in letters[0]["message"]
    assert cluster.client.describe("count").dead_lettered == 1


def test_timer_overrunning_its_deadline_is_dead_lettered_unrun(cluster: Cluster, tmp_path: Path) -> None:
    """The only due timer overruns alone -> worker killed; the next owner gives it up
    under the error policy without running it (a dead letter with its DeadlineExceeded
    cause), and the computation's watermark moves on to the end."""
    records = events(60, keys=3, spin_at=None)
    records[30] = Record(records[30].key, b"spin-timer", records[30].timestamp, records[30].record_id)
    cluster.register(topology(exponent=3 * 999_999, max_batch_seconds=2.0))
    workers = [cluster.start_worker() for _ in range(2)]
    cluster.wait_balanced()
    sampler = StatusSampler(cluster.client)
    with ControllerClient(cluster.address, timeout_s=60) as client:
        client.inject([one_message(records)])
    cluster.wait_watermark("count", timeout=120)
    sampler.stop()
    want = [o for o in expected(tmp_path, topology(exponent=1), records) if b'"timer"' not in o[1]]
    assert cluster.outputs("out") == want
    assert [p.returncode for p in workers if p.poll() is not None] == [-9]
    assert sampler.fewest_alive is not None and sampler.fewest_alive >= 1
    letters = dead_letters(cluster)
    assert [(d["timer"]["tag"], d["exception_type"]) for d in letters] == [("spin", "DeadlineExceeded")]
    assert "overran max_batch_seconds alone" in letters[0]["message"]


def _health(address: str) -> int:
    with channel(address) as ch:
        try:
            return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status)
        except grpc.RpcError:
            return -1


def test_health_follows_the_store(tmp_path: Path) -> None:
    from tests.support.redis_server import RedisServer

    redis = RedisServer(appendonly=True)
    cluster = Cluster(tmp_path, store_url=redis.url)
    try:
        cluster.start_controller()
        cluster.start_worker()
        worker = next(w.address for w in cluster.client.status().workers)
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        for address in (cluster.address, worker):
            assert _health(address) == serving
        redis.kill()
        for address in (cluster.address, worker):
            wait_for(lambda a=address: _health(a) == not_serving, 15, f"{address} NOT_SERVING")
        redis.restart()
        for address in (cluster.address, worker):
            wait_for(lambda a=address: _health(a) == serving, 15, f"{address} SERVING again")
    finally:
        cluster.stop()
        redis.stop()


def test_worker_health_follows_its_controller(cluster: Cluster) -> None:
    """A worker whose heartbeats fail for longer than its grace (10 s) is NOT_SERVING;
    SERVING again once the controller is back (restarted on the same port)."""
    cluster.start_worker()
    worker = next(w.address for w in cluster.client.status().workers)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert _health(worker) == serving
    assert cluster.controller is not None
    cluster.controller.kill()
    cluster.controller.wait(10)
    time.sleep(5)
    assert _health(worker) == serving  # a short outage is within the grace
    wait_for(lambda: _health(worker) == not_serving, 20, "worker NOT_SERVING")
    cluster.start_controller()
    wait_for(lambda: _health(worker) == serving, 20, "worker SERVING again")


def test_inject_split_keeps_message_semantics(cluster: Cluster, tmp_path: Path) -> None:
    """Messages larger than --inject-batch arrive whole, in order, counted once each."""
    cluster.register(topology(exponent=1, key_ranges=1))
    cluster.start_worker()
    cluster.wait_balanced()
    records = events(12_345, keys=3)
    msgs = [one_message(records[:7000]), one_message(records[7000:])]
    msgs[0].ClearField("done")
    with ControllerClient(cluster.address, timeout_s=120) as client:
        resp = client.inject(msgs)
    assert resp.accepted == len(records)
    cluster.wait_watermark("count", timeout=120)
    assert cluster.outputs("out") == expected(tmp_path, topology(exponent=1, key_ranges=1), records)
