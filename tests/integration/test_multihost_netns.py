"""Several hosts, one machine: Redis, the controller and three workers each in its own
network namespace (tests/support/netns.py), talking over veth addresses on a private
subnet exactly as they would across machines (workers listen on 0.0.0.0 and advertise
their host's address; every call carries the client token or the cluster secret).

A worker's cable is pulled at the switch (``ip link set DEV down``) mid-stream, for
longer than the heartbeat timeout: it can reach neither the controller nor Redis nor
its peers, and nobody can reach it. Its ranges move; the link comes back; the output
must equal a failure-free run record by record, and the healed worker must have
dropped every range it held, each now under a newer token (what it tried to write
with the old ones was fenced by the store). Timings are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Iterator

import pytest

from services.client import ControllerClient
from services.security import Security
from tests.integration.service_cluster import (
    PIPELINE_CODE,
    ROOT,
    Cluster,
    WatermarkMonitor,
    expected_outputs,
    wait_for,
)
from tests.support import netns, pipelines
from tests.support.redis_server import REDIS_SERVER

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
WHY_NOT = netns.unavailable()
if WHY_NOT:
    pytestmark.append(pytest.mark.skip(reason=f"multi-host test skipped: {WHY_NOT}"))

DISORDER = 2 * pipelines.SECOND
TOKEN = "client-" + secrets.token_urlsafe(24)
SECRET = "cluster-" + secrets.token_urlsafe(24)
REDIS_PASSWORD = secrets.token_urlsafe(16)
HEARTBEAT_TIMEOUT_S = 2.0
PARTITION_S = 3 * HEARTBEAT_TIMEOUT_S  # cable out for this long
CONTROLLER_PORT, WORKER_PORT, METRICS_PORT = 7070, 7071, 9100  # every host has its own ports


class NetnsCluster(Cluster):
    """:class:`Cluster` with each process on its own host of a :class:`netns.NetLab`;
    the test process is the client, on the lab's root leg."""

    def __init__(self, tmp: Path, lab: netns.NetLab, store_url: str) -> None:
        super().__init__(tmp, store_url=store_url, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                         allow_code=PIPELINE_CODE, env={"MILLWHEEL_AUTH_TOKEN": TOKEN,
                                                        "MILLWHEEL_CLUSTER_SECRET": SECRET})
        self.lab = lab
        self.controller_host = lab.add_host("ctl")
        self.address = f"{self.controller_host.ip}:{CONTROLLER_PORT}"
        self.client.close()
        self.client = ControllerClient(self.address, timeout_s=10, security=Security(client_token=TOKEN))
        self.worker_hosts: list[netns.Host] = []

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}
        return {**env, "PYTHONPATH": str(ROOT), **self.env}

    def start_controller(self) -> None:
        self.controller = self.lab.spawn(self.controller_host, [
            sys.executable, "-m", "services.cli", "controller", "--store", self.store_url,
            "--host", "0.0.0.0", "--port", str(CONTROLLER_PORT), "--metrics-port", "-1",
            "--heartbeat-timeout", str(self.heartbeat_timeout_s), *self.controller_args],
            "controller", self._env(), cwd=ROOT)
        wait_for(lambda: self.client.status(), 30, f"controller on {self.address}")

    def start_worker(self, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        n = len(self.workers)
        host = self.lab.add_host(f"w{n}")
        self.worker_hosts.append(host)
        proc = self.lab.spawn(host, [
            sys.executable, "-m", "services.cli", "worker", "--store", self.store_url,
            "--controller", self.address, "--host", "0.0.0.0", "--advertise", host.ip,
            "--port", str(WORKER_PORT), "--metrics-port", str(METRICS_PORT),
            "--delivery-timeout", "2", "--batch-size", "100", *self.worker_args, *extra],
            f"worker{n}", {**self._env(), **(env or {})}, cwd=ROOT)
        self.workers.append(proc)
        wait_for(lambda: self.worker_id(proc) is not None, 30, f"worker {n} on {host.ip} to join")
        return proc


def start_redis(lab: netns.NetLab, tmp: Path) -> str:
    """A real redis-server on its own host: AOF with ``appendfsync always``, a password,
    listening only on its host's address. Returns the store URL."""
    host = lab.add_host("redis")
    data = tmp / "redis"
    data.mkdir()
    lab.spawn(host, [REDIS_SERVER, "--bind", host.ip, "--port", "6379", "--dir", str(data), "--save", "",
                     "--appendonly", "yes", "--appendfsync", "always", "--requirepass", REDIS_PASSWORD,
                     "--protected-mode", "no", "--daemonize", "no"], "redis")
    url = f"redis://:{REDIS_PASSWORD}@{host.ip}:6379/0"
    import redis

    def pong() -> bool:
        with redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1) as r:
            return bool(r.ping())
    wait_for(pong, 20, f"redis-server on {host.ip}")
    return url


@pytest.fixture
def net(tmp_path: Path) -> Iterator[NetnsCluster]:
    with netns.NetLab(tmp_path) as lab:
        c = NetnsCluster(tmp_path, lab, start_redis(lab, tmp_path))
        try:
            c.start_controller()
            yield c
        finally:
            c.stop()


def reachable(host: netns.Host) -> bool:
    """Whether the worker on ``host`` accepts a TCP connection from the client within 0.5 s."""
    try:
        socket.create_connection((host.ip, WORKER_PORT), timeout=0.5).close()
        return True
    except OSError:
        return False


def fenced_writes(host: netns.Host) -> float:
    """millwheel_fenced_writes_total of the worker on ``host`` (all computations)."""
    with urllib.request.urlopen(f"http://{host.ip}:{METRICS_PORT}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("millwheel_fenced_writes_total{"))


def test_partitioned_worker_loses_its_ranges_and_writes_nothing(net: NetnsCluster, tmp_path: Path) -> None:
    topology = pipelines.topology(key_ranges=4)  # 3 x 4 + the injector: 13 ranges
    records = pipelines.workload(n=2000)
    for _ in range(3):
        net.start_worker()
    victim, victim_host = net.workers[1], net.worker_hosts[1]
    victim_id = net.worker_id(victim)
    assert victim_id is not None and victim_id.startswith(f"{victim_host.ip}:{WORKER_PORT}/")
    net.register(topology)
    net.wait_balanced()
    monitor = WatermarkMonitor(net.client)
    held: list[tuple[str, int, int]] = []
    t: dict[str, float] = {}
    wall: dict[str, str] = {}  # to find the cut and the heal in the processes' logs
    errors: list[BaseException] = []

    def partition() -> None:
        try:
            held.extend(net.ranges_of(victim_id))
            assert held, "the victim owns ranges before the cut"
            assert reachable(victim_host)
            t["cut"], wall["cut"] = time.monotonic(), datetime.now().strftime("%H:%M:%S.%f")[:-3]
            net.lab.cut(victim_host)
            assert not reachable(victim_host), "the cut worker still answers"
            wait_for(lambda: not next(w for w in net.client.status().workers if w.worker_id == victim_id).alive,
                     20, "the partitioned worker to be declared dead")
            t["dead"] = time.monotonic()
            wait_for(lambda: not net.ranges_of(victim_id), 20, "the partitioned worker's ranges to move")
            t["moved"] = time.monotonic()
            time.sleep(max(0.0, t["cut"] + PARTITION_S - time.monotonic()))
            net.lab.heal(victim_host)
            t["healed"], wall["healed"] = time.monotonic(), datetime.now().strftime("%H:%M:%S.%f")[:-3]
            wait_for(lambda: net.worker_id(victim) == victim_id, 30, "the healed worker to heartbeat again")
            t["back"] = time.monotonic()
        except BaseException as exc:  # re-raised by the test thread
            errors.append(exc)

    cutter = threading.Thread(target=partition, daemon=True)

    def between(i: int) -> None:
        time.sleep(0.2)  # ~40 messages over ~10 s: the cut and the heal both fall mid-stream
        if i == 8:
            cutter.start()

    started = time.monotonic()
    net.inject("events", "events", records, batch=50, max_disorder_us=DISORDER, done=True, between=between)
    t["injected"] = time.monotonic()
    cutter.join(60)
    assert not cutter.is_alive() and not errors, errors
    assert t["healed"] < t["injected"], "records were still being injected after the heal"
    net.wait_watermark("totals", timeout=120)
    t["done"] = time.monotonic()
    monitor.stop()

    want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
    assert net.outputs("counts") == want["counts"]
    assert net.outputs("totals") == want["totals"]
    assert monitor.samples > 5 and monitor.backwards == []
    # Fenced: every range it held is under a newer token, and the healed worker dropped
    # each of them (on its first heartbeat, or when the store refused its write).
    current = {(r.node, r.range_id): r.token for r in net.client.status().ranges}
    assert all(current[(node, rid)] > token for node, rid, token in held)
    log = net.log("worker1")
    missing = [u for u in held if f"dropped {u[0]}/{u[1]} (token {u[2]})" not in log]
    assert not missing, f"the healed worker did not drop {missing}"
    assert victim.poll() is None, "the partitioned worker survived and rejoined"
    print(f"\nnetns partition of {victim_host.ip} ({len(held)} ranges) at {t['cut'] - started:.2f}s "
          f"({wall['cut']}, healed {wall['healed']}): "
          f"declared dead after {t['dead'] - t['cut']:.2f}s, ranges moved after {t['moved'] - t['cut']:.2f}s, "
          f"healed after {t['healed'] - t['cut']:.2f}s, heartbeating again {t['back'] - t['healed']:.2f}s "
          f"after the heal; injection took {t['injected'] - started:.2f}s, pipeline done "
          f"{t['done'] - t['injected']:.2f}s later; fenced writes counted by the healed worker: "
          f"{fenced_writes(victim_host):.0f}")
