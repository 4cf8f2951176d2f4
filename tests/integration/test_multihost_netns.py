"""Several hosts, one machine: Redis, the controllers and the workers each in its own
network namespace (tests/support/netns.py, tests/integration/netns_cluster.py),
talking over veth addresses on a private subnet exactly as they would across machines.

A host's cable is pulled at the switch (``ip link set DEV down``) mid-stream for
longer than the failure detection takes: it can reach nothing (controller, Redis,
peers) and nothing can reach it. Then the link comes back. The output must equal a
failure-free run record by record, and the host cut off must have written nothing
after it lost its role:

* a worker: its ranges move; healed, it drops every range it held, each now under a
  newer token (a write it had in flight is fenced by the store);
* the leading controller: a standby takes the lease and leads; the workers stay where
  they are (no range moves); healed, the old leader stands by: the lease, the tokens
  and the assignment are those the new leader set, and it logged no range move.

Timings are printed (``pytest -s``).
"""

from __future__ import annotations

import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

import pytest

from millwheel.state import open_store
from millwheel.state.lease import Lease
from tests.integration.netns_cluster import (
    CONTROLLER_PORT,
    WORKER_PORT,
    NetnsCluster,
    metric,
    reachable,
    start_redis,
)
from tests.integration.test_controller_ha import MOVE
from tests.support import netns, pipelines
from tests.support.service_cluster import WatermarkMonitor, expected_outputs, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
WHY_NOT = netns.unavailable()
if WHY_NOT:
    pytestmark.append(pytest.mark.skip(reason=f"multi-host test skipped: {WHY_NOT}"))

DISORDER = 2 * pipelines.SECOND
HEARTBEAT_TIMEOUT_S = 2.0
LEASE_TTL_S = 2.0  # the controllers' default
PARTITION_S = 6.0  # cable out for this long: 3 heartbeat timeouts, 3 lease periods


def _cluster(tmp_path: Path, controllers: int) -> Iterator[NetnsCluster]:
    with netns.NetLab(tmp_path) as lab:
        c = NetnsCluster(tmp_path, lab, start_redis(lab, tmp_path), controllers, HEARTBEAT_TIMEOUT_S)
        try:
            c.start_controller()
            yield c
        finally:
            c.stop()


@pytest.fixture
def net(tmp_path: Path) -> Iterator[NetnsCluster]:
    """One controller."""
    yield from _cluster(tmp_path, 1)


@pytest.fixture
def net_ha(tmp_path: Path) -> Iterator[NetnsCluster]:
    """Two controllers on two hosts: one leads, one stands by."""
    yield from _cluster(tmp_path, 2)


def now() -> str:
    """Wall-clock time as the processes' logs print it, to find the cut and the heal there."""
    return datetime.now().strftime("%H:%M:%S.%f")[:-3]


def run_with_partition(net: NetnsCluster, tmp_path: Path, partition: Callable[[], None]) -> float:
    """Register the pipeline, inject ~40 messages over ~10 s, run ``partition`` on a thread
    from message 8 on (it must finish before the injection does: the cut and the heal
    both fall mid-stream), wait for the end and compare with a failure-free run. Returns
    when the injection started (time.monotonic()); prints the longest time one Inject
    message took to be accepted."""
    topology = pipelines.topology(key_ranges=4)  # 3 x 4 + the injector: 13 ranges
    records = pipelines.workload(n=2000)
    net.register(topology)
    net.wait_balanced()
    monitor = WatermarkMonitor(net.client)
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            partition()
        except BaseException as exc:  # re-raised by the test thread
            errors.append(exc)

    cutter = threading.Thread(target=guarded, daemon=True)

    accepted: list[float] = []

    def between(i: int) -> None:
        accepted.append(time.monotonic())
        time.sleep(0.2)
        if i == 8:
            cutter.start()

    started = time.monotonic()
    net.inject("events", "events", records, batch=50, max_disorder_us=DISORDER, done=True, between=between)
    injected = time.monotonic()
    cutter.join(90)
    assert not cutter.is_alive() and not errors, errors
    net.wait_watermark("totals", timeout=120)
    monitor.stop()
    want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
    assert net.outputs("counts") == want["counts"]
    assert net.outputs("totals") == want["totals"]
    assert monitor.samples > 5 and monitor.backwards == []
    waits = [b - a - 0.2 for a, b in zip([started - 0.2, *accepted], accepted, strict=False)]
    longest = max(range(len(waits)), key=waits.__getitem__)
    print(f"\ninjection took {injected - started:.2f}s (longest wait for one message: {waits[longest]:.2f}s, "
          f"message {longest}), pipeline done {time.monotonic() - injected:.2f}s later")
    return started


def test_partitioned_worker_loses_its_ranges_and_writes_nothing(net: NetnsCluster, tmp_path: Path) -> None:
    for _ in range(3):
        net.start_worker()
    victim, host = net.workers[1], net.worker_hosts[1]
    victim_id = net.worker_id(victim)
    assert victim_id is not None and victim_id.startswith(f"{host.ip}:{WORKER_PORT}/")
    held: list[tuple[str, int, int]] = []
    t: dict[str, float] = {}
    wall: dict[str, str] = {}

    def partition() -> None:
        held.extend(net.ranges_of(victim_id))
        assert held, "the victim owns ranges before the cut"
        assert reachable(host, WORKER_PORT)
        t["cut"], wall["cut"] = time.monotonic(), now()
        net.lab.cut(host)
        assert not reachable(host, WORKER_PORT), "the cut worker still answers"
        wait_for(lambda: not next(w for w in net.client.status().workers if w.worker_id == victim_id).alive,
                 20, "the partitioned worker to be declared dead")
        t["dead"] = time.monotonic()
        wait_for(lambda: not net.ranges_of(victim_id), 20, "the partitioned worker's ranges to move")
        t["moved"] = time.monotonic()
        time.sleep(max(0.0, t["cut"] + PARTITION_S - time.monotonic()))
        net.lab.heal(host)
        t["healed"], wall["healed"] = time.monotonic(), now()
        wait_for(lambda: net.worker_id(victim) == victim_id, 30, "the healed worker to heartbeat again")
        t["back"] = time.monotonic()

    started = run_with_partition(net, tmp_path, partition)
    # Fenced: every range it held is under a newer token, and the healed worker dropped
    # each of them (on its first heartbeat, or when the store refused its write).
    current = {(r.node, r.range_id): r.token for r in net.client.status().ranges}
    assert all(current[(node, rid)] > token for node, rid, token in held)
    log = net.log("worker1")
    missing = [u for u in held if f"dropped {u[0]}/{u[1]} (token {u[2]})" not in log]
    assert not missing, f"the healed worker did not drop {missing}"
    assert victim.poll() is None, "the partitioned worker survived and rejoined"
    print(f"worker {host.ip} ({len(held)} ranges) cut at {t['cut'] - started:.2f}s ({wall['cut']}, healed "
          f"{wall['healed']}): declared dead after {t['dead'] - t['cut']:.2f}s, ranges moved after "
          f"{t['moved'] - t['cut']:.2f}s, healed after {t['healed'] - t['cut']:.2f}s, heartbeating again "
          f"{t['back'] - t['healed']:.2f}s after the heal; fenced writes counted by the healed worker: "
          f"{metric(host, 'millwheel_fenced_writes_total'):.0f}")


def test_partitioned_leader_is_replaced_and_writes_nothing(net_ha: NetnsCluster, tmp_path: Path) -> None:
    net = net_ha
    for _ in range(2):
        net.start_worker()
    leader = net.client.status().leader
    old = net.addresses.index(leader)
    new = 1 - old
    host = net.controller_hosts[old]
    t: dict[str, float] = {}
    wall: dict[str, str] = {}
    seen: dict[str, object] = {}

    def lease() -> Lease:
        store = open_store(net.store_url)  # from the client's host, like any other
        try:
            held = store.read_lease()
        finally:
            store.close()
        assert held is not None
        return held

    def partition() -> None:
        before = lease()
        assert before.holder.startswith(leader)
        seen["owners"] = net.owners()
        assert reachable(host, CONTROLLER_PORT)
        t["cut"], wall["cut"] = time.monotonic(), now()
        net.lab.cut(host)
        assert not reachable(host, CONTROLLER_PORT), "the cut controller still answers"
        wait_for(lambda: lease().holder.startswith(net.addresses[new]), 15, "the standby to take the lease")
        t["lease"] = time.monotonic()
        after = lease()
        assert after.epoch > before.epoch
        wait_for(lambda: net.leader_named_by(new) == net.addresses[new], 15, "the standby to say it leads")
        t["led"] = time.monotonic()
        seen["lease"] = (after.holder, after.epoch)
        time.sleep(max(0.0, t["cut"] + PARTITION_S - time.monotonic()))
        net.lab.heal(host)
        t["healed"], wall["healed"] = time.monotonic(), now()
        wait_for(lambda: net.leader_named_by(old) == net.addresses[new], 15,
                 "the healed controller to name the new leader")
        t["standby"] = time.monotonic()
        time.sleep(1.0)  # whatever it had queued while cut off has reached the store by now

    started = run_with_partition(net, tmp_path, partition)
    # The old leader wrote nothing: the lease is the new leader's, no range moved (no
    # worker died: the new leader kept the assignment), the old one logged no move
    # since it was deposed, and it says it stands by.
    held = lease()
    assert (held.holder, held.epoch) == seen["lease"]
    assert net.owners() == seen["owners"]
    assert all(w.alive for w in net.client.status().workers)
    log = net.log(f"controller{old}")
    assert "no longer the leader" in log
    assert not MOVE.search(log[log.index("no longer the leader"):]), "the deposed leader moved a range"
    with net.one(old) as c:
        status = c.status()
    assert status.leader == net.addresses[new] and status.leader_epoch == held.epoch
    assert metric(host, "millwheel_controller_leader") == 0
    assert metric(net.controller_hosts[new], "millwheel_controller_leader") == 1
    print(f"leader {leader} cut at {t['cut'] - started:.2f}s ({wall['cut']}, healed {wall['healed']}): "
          f"{net.addresses[new]} holds the lease after {t['lease'] - t['cut']:.2f}s (epoch {held.epoch}) and "
          f"answers as leader after {t['led'] - t['cut']:.2f}s; healed after "
          f"{t['healed'] - t['cut']:.2f}s, the old leader names the new one "
          f"{t['standby'] - t['healed']:.2f}s after the heal; no range moved; writes of the old leader "
          f"refused by the store for its stale epoch: {log.count('is not current')}")
