"""Where a cluster member (a worker, its watchdog) sends its heartbeats.

A worker is given controllers' *client* addresses (``--controller a:7070,b:7070``).
Each controller serves the Cluster service on a listener of its own, the cluster port,
which client calls never reach (services/controller/cluster_port.py), and names it in
every heartbeat answer (``HeartbeatResponse.cluster_address``). :class:`ClusterRoutes`
keeps, per controller, the cluster address it named: the first heartbeat to a
controller goes to its client address, the next ones to its cluster address.

The failover rule (services/rpc/controller_link.py) stays on client addresses: a
heartbeat that fails on a cluster address counts as a failure of that controller, and
the route is forgotten, so the next heartbeat to it goes to its client address again
and learns its cluster address afresh (a restarted controller may have another). A
cluster address that failed twice in a row without a success (a firewall that lets
the client port through and not the cluster port) is not used for ``AVOID_S``: the
client port serves heartbeats too.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("millwheel.cluster_routes")
AVOID_S = 60.0


class ClusterRoutes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._routes: dict[str, str] = {}  # client address -> cluster address
        self._failures: dict[str, tuple[int, float]] = {}  # cluster address -> (in a row, last)

    def target(self, address: str) -> str:
        """Where to send a Cluster call meant for the controller at ``address``."""
        with self._lock:
            return self._routes.get(address, address)

    def answered(self, address: str, target: str, cluster_address: str) -> None:
        """The controller at ``address`` answered a call sent to ``target``, naming
        ``cluster_address`` (empty: it has no cluster port; keep using ``address``)."""
        with self._lock:
            self._failures.pop(target, None)
            if not cluster_address or cluster_address == address:
                self._routes.pop(address, None)
                return
            count, last = self._failures.get(cluster_address, (0, 0.0))
            if count >= 2 and time.monotonic() - last < AVOID_S:
                return
            if self._routes.get(address) != cluster_address:
                log.info("controller %s serves heartbeats at %s", address, cluster_address)
            self._routes[address] = cluster_address

    def failed(self, address: str, target: str) -> None:
        """A Cluster call to ``target`` for ``address`` failed: forget the route; the
        next call goes to ``address`` and learns it again."""
        if target == address:
            return
        with self._lock:
            if self._routes.get(address) == target:
                del self._routes[address]
            count, _ = self._failures.get(target, (0, 0.0))
            self._failures[target] = (count + 1, time.monotonic())
            if count + 1 == 2:
                log.warning("heartbeats to %s (the cluster port of controller %s) failed twice: "
                            "sending them to %s for %g s; can workers reach its --cluster-port?",
                            target, address, address, AVOID_S)
