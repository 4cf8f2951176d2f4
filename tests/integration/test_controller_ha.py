"""Several controllers on one store: one leads, the others stand by and take over.

Real processes on loopback: two or three ``millwheel controller`` over one store,
workers and the client given every address (``--controller a,b``). What a user checks:

* started together, they elect one leader; registrations through a standby are seen
  by all; no range moves more than once;
* the leader killed -9 mid-stream: a standby leads within 5 s, no range moves (the
  new leader keeps the assignment its workers report), the output equals a
  failure-free run record for record, watermarks never go backwards;
* a leader SIGSTOPped until a standby took over, then SIGCONTed, writes nothing: the
  lease, tokens and assignment stay as the new leader set them, and it stands by.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.state import open_store
from millwheel.state.lease import Lease
from millwheel.topology import Topology
from services.client import ControllerClient
from services.rpc.security import Security
from tests.support import pipelines
from tests.support.pause import stop_outside_writes
from tests.support.redis_server import RedisServer, free_port
from tests.support.service_cluster import (
    PIPELINE_CODE,
    ROOT,
    Cluster,
    WatermarkMonitor,
    _stopped,
    expected_outputs,
    wait_for,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
DISORDER = 2 * pipelines.SECOND
MOVE = re.compile(r"range (\S+)/(\d+): (\S+) -> (\S+) \(token (\d+)\)")


class HACluster(Cluster):
    """A :class:`Cluster` with several controllers; workers and client know them all."""

    def __init__(self, tmp: Path, n: int = 2, ui_ports: list[int] | None = None, **kwargs: object) -> None:
        super().__init__(tmp, allow_code=PIPELINE_CODE, **kwargs)  # type: ignore[arg-type]
        self.ui_ports = ui_ports
        self.ports = [self.port, *(free_port() for _ in range(n - 1))]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.address = ",".join(self.addresses)
        self.client.close()
        self.client = ControllerClient(self.address, timeout_s=10, security=Security())
        self.controllers: list[subprocess.Popen[bytes] | None] = [None] * n

    def start_controller(self, i: int | None = None) -> None:
        for j in ([i] if i is not None else range(len(self.ports))):
            self.controllers[j] = self._spawn(f"controller{j}", [
                "controller", "--store", self.store_url, "--port", str(self.ports[j]),
                "--heartbeat-timeout", str(self.heartbeat_timeout_s), *self.controller_args,
                *(["--ui-port", str(self.ui_ports[j])] if self.ui_ports else [])])
        wait_for(lambda: self.leader() is not None, 20, "a leader to be elected")
        self.controller = self.controllers[0]

    def one(self, i: int) -> ControllerClient:
        """A client of controller ``i`` alone."""
        return ControllerClient(self.addresses[i], timeout_s=5, failover_s=0, security=self.client.security)

    def leader(self) -> str | None:
        """The leader every live controller names (None until they agree)."""
        named = set()
        for i, proc in enumerate(self.controllers):
            if proc is None or proc.poll() is not None or _stopped(proc.pid):
                continue
            with self.one(i) as c:
                named.add(c.status().leader)
        return named.pop() if len(named) == 1 and "" not in named else None

    def lease(self) -> Lease | None:
        store = open_store(self.store_url)
        try:
            return store.read_lease()
        finally:
            store.close()

    def moves(self) -> list[tuple[str, int, str, str, int]]:
        """Every range move any controller logged."""
        return [(m[1], int(m[2]), m[3], m[4], int(m[5]))
                for j in range(len(self.ports)) for m in MOVE.finditer(self.log(f"controller{j}"))]

    def owners(self) -> dict[tuple[str, int], tuple[str, int]]:
        return {(r.node, r.range_id): (r.worker_id, r.token) for r in self.client.status().ranges}

    def stop(self) -> None:
        for p in self.controllers:
            if p is not None and p.poll() is None:
                if _stopped(p.pid):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(10)
        self.controller = None
        super().stop()


@pytest.fixture(params=["sqlite", "redis", "redis-cluster"])
def ha(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HACluster]:
    redis = RedisServer(appendonly=True) if request.param == "redis" else None
    url = redis.url if redis else None
    if request.param == "redis-cluster":  # the session's 3+3 cluster, a prefix of this test's own
        nodes = request.getfixturevalue("redis_cluster")
        url = f"{nodes.url}?prefix=ha{hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]}"
    c = HACluster(tmp_path, store_url=url)
    try:
        yield c
    finally:
        c.stop()
        if redis is not None:
            redis.stop()


def _inject_and_check(ha: HACluster, tmp_path: Path, topology: Topology, fault_at: int,
                      fault: object) -> WatermarkMonitor:
    records = pipelines.workload(n=1500)
    monitor = WatermarkMonitor(ha.client)

    def between(i: int) -> None:
        time.sleep(0.04)
        if i == fault_at:
            fault()  # type: ignore[operator]

    ha.inject("events", "events", records, batch=60, max_disorder_us=DISORDER, done=True, between=between)
    ha.wait_watermark("totals", timeout=120)
    monitor.stop()
    want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
    assert ha.outputs("counts") == want["counts"]
    assert ha.outputs("totals") == want["totals"]
    assert monitor.backwards == []
    return monitor


def _running(ha: HACluster) -> tuple[str, Topology]:
    """Controllers elected, two workers, the pipeline registered and balanced: the
    leader's address and the topology."""
    ha.start_controller()
    leader = ha.leader()
    assert leader is not None
    ha.start_worker()
    ha.start_worker()
    topology = pipelines.topology(key_ranges=3)
    ha.register(topology)
    ha.wait_balanced()
    return leader, topology


def test_controllers_started_together_elect_one_leader(ha: HACluster, tmp_path: Path) -> None:
    ha.start_controller()
    leader = ha.leader()
    assert leader in ha.addresses
    statuses = []
    for i in range(2):
        with ha.one(i) as c:
            statuses.append(c.status())
    assert {s.answered_by for s in statuses} == {leader}  # a standby forwards status to the leader
    assert len({s.leader_epoch for s in statuses}) == 1
    ha.start_worker()
    ha.start_worker()
    standby = 1 - ha.addresses.index(leader)
    topology = pipelines.topology(key_ranges=3)
    with ha.one(standby) as c:  # registered through the standby: forwarded to the leader
        c.register(topology)
    for i in range(2):
        with ha.one(i) as c:
            wait_for(lambda c=c: {x.spec.name for x in c.computations().computations}
                     == {x.name for x in topology.computations}, 10, f"controller {i} to see the registry")
    ha.wait_balanced()
    _inject_and_check(ha, tmp_path, topology, 5, lambda: None)
    units = sum(c.options.key_ranges for c in topology.computations) + len(topology.injectors)
    moves = ha.moves()
    print(f"range moves: {len(moves)} for {units} ranges")
    assert len(moves) <= units
    assert all(m[2] == "None" for m in moves)  # each range assigned once, never moved


def test_leader_killed_mid_stream_standby_takes_over(ha: HACluster, tmp_path: Path) -> None:
    leader, topology = _running(ha)
    victim = ha.controllers[ha.addresses.index(leader)]
    assert victim is not None
    took: dict[str, float] = {}
    before: dict[tuple[str, int], tuple[str, int]] = {}

    def kill() -> None:
        before.update(ha.owners())
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        new = wait_for(lambda: ha.leader() not in (None, leader) and ha.leader(), 10, "a standby to lead")
        took["s"] = time.monotonic() - t0
        took["leader"] = new

    _inject_and_check(ha, tmp_path, topology, 8, kill)
    print(f"leader {leader} killed -9: {took['leader']} leads after {took['s']:.2f} s")
    assert took["s"] < 5.0
    after = ha.owners()
    assert after == before, "a leader change moved ranges whose workers were alive"
    assert all(w.alive for w in ha.client.status().workers)


def test_deposed_leader_resumed_writes_nothing(ha: HACluster, tmp_path: Path) -> None:
    leader, topology = _running(ha)
    i = ha.addresses.index(leader)
    paused = ha.controllers[i]
    assert paused is not None
    seen: dict[str, object] = {}

    def pause() -> None:
        old = ha.lease()
        assert old is not None and old.holder.startswith(leader)
        stop_outside_writes(paused.pid)  # a SQLite write lock held while stopped would stop all
        wait_for(lambda: ha.leader() not in (None, leader), 15, "a standby to lead")
        lease = ha.lease()
        assert lease is not None and lease.epoch > old.epoch
        seen["lease"] = (lease.holder, lease.epoch)
        seen["owners"] = ha.owners()
        os.kill(paused.pid, signal.SIGCONT)
        wait_for(lambda: "no longer the leader" in ha.log(f"controller{i}"), 10,
                 "the resumed controller to notice it was deposed")
        time.sleep(1.0)  # what it had queued while paused has run by now

    _inject_and_check(ha, tmp_path, topology, 6, pause)
    lease = ha.lease()
    assert lease is not None and (lease.holder, lease.epoch) == seen["lease"]
    assert ha.owners() == seen["owners"]
    with ha.one(i) as c:  # it stands by and names the new leader
        status = c.status()
        assert status.leader != leader and status.answered_by == status.leader
    deposed_log = ha.log(f"controller{i}")
    tail = deposed_log[deposed_log.index("no longer the leader"):]
    assert not MOVE.search(tail), "the deposed leader moved a range after it was deposed"


def test_follow_subscribe_leaves_a_stopped_controller(tmp_path: Path) -> None:
    """A follow-mode Subscribe served by a controller that is then SIGSTOPped (it sends
    no reset and answers nothing) goes on from the other controller within seconds: the
    link's keepalive fails the stalled call and the client resumes after its last row.
    Every row arrives once, in the stream's order, and the rows are the failure-free
    run's. (Without the keepalive the subscriber waits forever: the wait below times out.
    The subscription starts right after registration: a standby whose periodic view was
    older answered NOT_FOUND for the stream until it re-read the store on a miss.)"""
    ha = HACluster(tmp_path)
    try:
        leader, topology = _running(ha)
        s = next(i for i, a in enumerate(ha.addresses) if a != leader)
        standby = ha.controllers[s]
        assert standby is not None
        # the standby first: it serves the subscription (standbys answer reads)
        sub = ControllerClient(",".join([ha.addresses[s], leader]), timeout_s=10, security=Security())
        got: list[tuple[int, tuple[str, bytes, int, str]]] = []
        errors: list[BaseException] = []

        def follow() -> None:
            try:
                for seq, r in sub.subscribe("counts", follow=True):
                    got.append((seq, (r.key, r.value, r.timestamp, r.record_id)))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        records = pipelines.workload(n=1500)
        half = records[: len(records) // 2]
        ha.inject("events", "events", half, batch=60, max_disorder_us=DISORDER)
        wait_for(lambda: got or errors, 60, "the subscriber's first rows (through the standby)")
        assert not errors, errors
        os.kill(standby.pid, signal.SIGSTOP)
        stopped_at, stopped_rows = time.monotonic(), len(got)
        ha.inject("events", "events", records[len(half):], batch=60, max_disorder_us=DISORDER, done=True)
        ha.wait_watermark("totals", timeout=120)
        want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts",))["counts"]
        wait_for(lambda: len(got) >= len(want) or errors, 30, "the subscriber to get every row")
        print(f"stopped with {stopped_rows} rows; all {len(got)} rows {time.monotonic() - stopped_at:.1f} s later")
        assert not errors, errors
        seqs = [seq for seq, _ in got]
        assert seqs == sorted(set(seqs)), "a row twice or out of order"
        assert sorted(row for _, row in got) == want
        assert len(got) > stopped_rows, "nothing arrived after the stop"
        sub.close()
    finally:
        ha.stop()


def test_a_standbys_console_names_the_leader(tmp_path: Path) -> None:
    """The console of a standby says it stands by and who leads, and shows worker
    liveness as unknown (only the leader hears heartbeats), not every worker dead."""
    from tests.integration.ui_cluster import SECRET, TOKEN, Console

    ports = [free_port(), free_port()]
    ha = HACluster(tmp_path, ui_ports=ports, env={"MILLWHEEL_AUTH_TOKEN": TOKEN,
                                                  "MILLWHEEL_CLUSTER_SECRET": SECRET})
    ha.client.close()
    ha.client = ControllerClient(ha.address, timeout_s=10, security=Security(client_token=TOKEN))
    try:
        leader, _topology = _running(ha)
        i = ha.addresses.index(leader)
        standby, lead = Console(ha, ports[1 - i]), Console(ha, ports[i])
        wait_for(lambda: standby.api("/api/v1/overview")["computations"], 20, "the standby's console")
        over = standby.api("/api/v1/overview")
        assert over["leading"] is False and over["leader"] == leader
        assert {w["state"] for w in standby.api("/api/v1/workers")["workers"]} == {"unknown"}
        wait_for(lambda: lead.api("/api/v1/overview")["workers"]["alive"] == 2, 20, "the leader's console")
        assert lead.api("/api/v1/overview")["leading"] is True
    finally:
        ha.stop()


@pytest.mark.parametrize("flag,value,says", [
    ("--lease-ttl", "0", "--lease-ttl must be 0.1..3600 seconds"),
    ("--lease-ttl", "nan", "--lease-ttl must be 0.1..3600 seconds"),
    ("--lease-ttl", "1e9", "--lease-ttl must be 0.1..3600 seconds"),
    ("--takeover-grace", "-1", "--takeover-grace must be 0..86400 seconds"),
    ("--takeover-grace", "nan", "--takeover-grace must be 0..86400 seconds"),
    ("--takeover-grace", "inf", "--takeover-grace must be 0..86400 seconds"),
])
def test_bad_election_settings_are_refused_and_claim_nothing(tmp_path: Path, flag: str, value: str,
                                                             says: str) -> None:
    """A controller that could never lead (or never declare a worker dead) does not start:
    exit 2 naming the flag, and the store's lease is untouched."""
    url = f"sqlite:///{tmp_path}/s.db"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "controller", "--store", url,
                           "--port", str(free_port()), "--ui-port", "-1", flag, value],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr
    store = open_store(url)
    try:
        assert store.read_lease() is None
    finally:
        store.close()
