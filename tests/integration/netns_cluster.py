"""The service spread over network namespaces (tests/support/netns.py): Redis, each
controller and each worker on a host of its own, the test process the client.

Every process listens on ``0.0.0.0`` of its namespace and is told (``--advertise``) the
address the others reach it at; every call carries the client token or the cluster
secret (a non-loopback listener requires them). Each host has its own ports, so every
controller listens on 7070, every worker on 7071 and every /metrics on 9100.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from services.client import ControllerClient
from services.rpc.security import Security
from tests.support import netns
from tests.support.redis_server import REDIS_SERVER
from tests.support.service_cluster import PIPELINE_CODE, ROOT, Cluster, wait_for

TOKEN = "client-" + secrets.token_urlsafe(24)
SECRET = "cluster-" + secrets.token_urlsafe(24)
REDIS_PASSWORD = secrets.token_urlsafe(16)
CONTROLLER_PORT, WORKER_PORT, METRICS_PORT = 7070, 7071, 9100


class NetnsCluster(Cluster):
    """:class:`Cluster` with each process on its own host of a :class:`netns.NetLab`.
    ``controllers`` > 1: one leads, the others stand by; workers and the client are
    given every controller's address."""

    def __init__(self, tmp: Path, lab: netns.NetLab, store_url: str, controllers: int = 1,
                 heartbeat_timeout_s: float = 2.0) -> None:
        super().__init__(tmp, store_url=store_url, heartbeat_timeout_s=heartbeat_timeout_s,
                         allow_code=PIPELINE_CODE, env={"MILLWHEEL_AUTH_TOKEN": TOKEN,
                                                        "MILLWHEEL_CLUSTER_SECRET": SECRET})
        self.lab = lab
        self.security = Security(client_token=TOKEN)
        self.controller_hosts = [lab.add_host(f"ctl{i}") for i in range(controllers)]
        self.addresses = [f"{h.ip}:{CONTROLLER_PORT}" for h in self.controller_hosts]
        self.address = ",".join(self.addresses)
        self.client.close()
        self.client = ControllerClient(self.address, timeout_s=10, security=self.security)
        self.controllers: list[subprocess.Popen[bytes] | None] = [None] * controllers
        self.worker_hosts: list[netns.Host] = []

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}
        return {**env, "PYTHONPATH": str(ROOT), **self.env}

    def start_controller(self, i: int | None = None) -> None:
        """Controller ``i`` (default: all of them); returns once a leader is named."""
        for j in ([i] if i is not None else range(len(self.controller_hosts))):
            host = self.controller_hosts[j]
            self.controllers[j] = self.lab.spawn(host, [
                sys.executable, "-m", "services.cli", "controller", "--store", self.store_url,
                "--host", "0.0.0.0", "--advertise", host.ip, "--port", str(CONTROLLER_PORT),
                "--metrics-port", str(METRICS_PORT), "--heartbeat-timeout", str(self.heartbeat_timeout_s),
                *self.controller_args], f"controller{j}", self._env(), cwd=ROOT)
        self.controller = self.controllers[0]
        wait_for(lambda: self.client.status().leader, 30, f"a leader among {self.address}")

    def start_worker(self, *extra: str, env: dict[str, str] | None = None,
                     controller: str | None = None) -> subprocess.Popen[bytes]:
        """A worker on a new host; ``controller``: its ``--controller`` (default every
        controller's address)."""
        n = len(self.workers)
        host = self.lab.add_host(f"w{n}")
        self.worker_hosts.append(host)
        proc = self.lab.spawn(host, [
            sys.executable, "-m", "services.cli", "worker", "--store", self.store_url,
            "--controller", controller or self.address, "--host", "0.0.0.0", "--advertise", host.ip,
            "--port", str(WORKER_PORT), "--metrics-port", str(METRICS_PORT),
            "--delivery-timeout", "2", "--batch-size", "100", *self.worker_args, *extra],
            f"worker{n}", {**self._env(), **(env or {})}, cwd=ROOT)
        self.workers.append(proc)
        wait_for(lambda: self.worker_id(proc) is not None, 30, f"worker {n} on {host.ip} to join")
        return proc

    def one(self, i: int) -> ControllerClient:
        """A client of controller ``i`` alone (no failover)."""
        return ControllerClient(self.addresses[i], timeout_s=3, failover_s=0, security=self.security)

    def leader_named_by(self, i: int) -> str:
        with self.one(i) as c:
            return str(c.status().leader)

    def owners(self) -> dict[tuple[str, int], tuple[str, int]]:
        return {(r.node, r.range_id): (r.worker_id, r.token) for r in self.client.status().ranges}

    def stop(self) -> None:
        for p in self.controllers:
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(10)
        self.controller = None
        super().stop()


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


def reachable(host: netns.Host, port: int) -> bool:
    """Whether ``host`` accepts a TCP connection on ``port`` from the client within 0.5 s."""
    try:
        socket.create_connection((host.ip, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def metric(host: netns.Host, name: str) -> float:
    """The sum of metric ``name`` (over its labels) on ``host``'s /metrics."""
    with urllib.request.urlopen(f"http://{host.ip}:{METRICS_PORT}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))
