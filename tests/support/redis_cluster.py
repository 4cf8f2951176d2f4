"""A real, throw-away Redis Cluster for tests: 3 masters and 3 replicas on free ports.

Each node is a :class:`~tests.support.redis_server.RedisServer` started with
``--cluster-enabled yes`` (AOF on, ``appendfsync always``) in its own data dir; the
cluster is formed with ``redis-cli --cluster create ... --cluster-replicas 1``. A
test can kill -9 the master that owns a key (its replica is promoted after
``cluster-node-timeout``) and restart the dead node, which rejoins as a replica.
Every node is stopped by PID at the end.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis
from redis.crc import key_slot

from tests.support.redis_server import RedisServer

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
NODE_TIMEOUT_MS = 1000


def free_cluster_port() -> int:
    """A free port P whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterNodes:
    """``masters`` masters with ``replicas`` replicas each, formed and ready."""

    def __init__(self, masters: int = 3, replicas: int = 1, appendonly: bool = True) -> None:
        """``appendonly=False``: no AOF (a throughput figure's store, not a durable one)."""
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters * (1 + replicas)):
                port = free_cluster_port()
                self.nodes.append(RedisServer(
                    appendonly=appendonly, appendfsync="always", port=port,
                    extra_args=[
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", f"nodes-{port}.conf",
                        "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                        "--cluster-replica-validity-factor", "0",  # any replica may take over
                        # As docs/redis.md says to deploy: a stopped master's slots wait, the
                        # others serve (the default "yes" answers CLUSTERDOWN for every slot
                        # until its replica is promoted; seen: the controller lost its lease).
                        "--cluster-require-full-coverage", "no",
                        "--appendfilename", f"appendonly-{port}.aof",
                    ],
                ))
            done = subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                 "--cluster-replicas", str(replicas), "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
            self.wait_ok(expected_masters=masters)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """A store URL naming one node: the client discovers the others."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2)

    def alive(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, expected_masters: int, timeout_s: float = 30.0) -> None:
        """Until every live node says ``cluster_state:ok``, sees ``expected_masters``
        masters, and every replica's link to its master is up."""
        deadline = time.monotonic() + timeout_s
        problem = ""
        while time.monotonic() < deadline:
            try:
                problem = self._problem(expected_masters)
            except redis.RedisError as exc:
                problem = f"{exc.__class__.__name__}: {exc}"
            if not problem:
                return
            time.sleep(0.05)
        raise RuntimeError(f"Redis Cluster not ready in {timeout_s}s: {problem}")

    def _problem(self, expected_masters: int) -> str:
        for node in self.alive():
            c = self.client(node.port)
            if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                return f"node {node.port}: cluster_state not ok"
            masters = [line for line in c.execute_command("CLUSTER", "NODES").decode().splitlines()
                       if "master" in line.split()[2] and "fail" not in line.split()[2]
                       and len(line.split()) > 8]
            if len(masters) != expected_masters:
                return f"node {node.port} sees {len(masters)} masters with slots"
            repl = c.info("replication")
            if repl["role"] == "slave" and repl.get("master_link_status") != "up":
                return f"replica {node.port}: link to its master is {repl.get('master_link_status')}"
        return ""

    def master_of(self, key: str) -> RedisServer:
        """The live node that owns ``key``'s hash slot now."""
        slot = key_slot(key.encode())
        for node in self.alive():
            for start, end, master, *_replicas in self.client(node.port).execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no node owns slot {slot}")

    def _node_table(self) -> list[list[str]]:
        """CLUSTER NODES of a live node, one split line per node."""
        raw = self.client(self.alive()[0].port).execute_command("CLUSTER", "NODES")
        return [line.split() for line in raw.decode().splitlines()]

    def _by_port(self, address: str) -> RedisServer:
        port = int(address.split("@")[0].rsplit(":", 1)[1])
        return next(n for n in self.nodes if n.port == port)

    def masters(self) -> list[RedisServer]:
        """The live masters that serve slots."""
        return [self._by_port(f[1]) for f in self._node_table()
                if "master" in f[2] and "fail" not in f[2] and len(f) > 8]

    def replica_of(self, master: RedisServer) -> RedisServer:
        table = self._node_table()
        master_id = next(f[0] for f in table if self._by_port(f[1]) is master)
        return next(self._by_port(f[1]) for f in table if "slave" in f[2] and f[3] == master_id)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
