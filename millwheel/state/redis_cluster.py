"""What the Redis store does differently on Redis Cluster, and replicated writes.

Kept apart from :mod:`millwheel.state.redis_store` so the store reads the same for
both deployments; no redis-py import here (the clients come in as arguments, built by
:mod:`millwheel.state.redis_connection`, which stays the only importer of ``redis``).

* **Detection** (``?cluster=auto``, the default): the first call asks the node named
  in the URL for ``INFO cluster``; ``cluster_enabled:1`` switches the store to
  redis-py's cluster client, which discovers the other nodes and follows MOVED/ASK.
  ``?cluster=yes`` skips the question, ``?cluster=no`` never switches.
* **Replicated writes** (``?wait_replicas=N``): a write that must survive a failover
  is sent, then ``WAIT N`` on the *same connection* (WAIT counts the replication
  offset of the connection's own last write, so a WAIT on another pooled connection
  would prove nothing) until N replicas acknowledge it or the retry deadline passes.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from millwheel.errors import InvalidSpecError, StoreError

CLUSTER_MODES = ("auto", "yes", "no")
WAIT_SLICE_MS = 1000  # one WAIT blocks at most this long before the deadline is checked


class NotReplicatedError(StoreError):
    """A write reached its master but not ``wait_replicas`` replicas in time."""


def cluster_mode(value: str, where: str) -> str:
    if value not in CLUSTER_MODES:
        raise InvalidSpecError(f"store URL {where!r}: option cluster={value!r}; use auto, yes or no")
    return value


def is_cluster_node(info: dict[str, Any]) -> bool:
    """``INFO cluster`` of a node -> whether it runs in cluster mode."""
    return str(info.get("cluster_enabled", 0)) == "1"


def check_database(db: int, where: str) -> None:
    if db != 0:
        raise InvalidSpecError(
            f"store URL {where!r}: database {db} requested, but the server is a Redis "
            "Cluster node and a cluster has only database 0 (use ?prefix= to separate "
            "deployments)"
        )


def node_client(client: Any, key: str, cluster: bool) -> Any:
    """The plain client of the node holding ``key`` (the client itself off-cluster)."""
    if not cluster:
        return client
    return client.get_redis_connection(client.get_node_from_key(key))


def refresh_topology(client: Any) -> None:
    """Ask the cluster again which node owns which slot (after MOVED, a dead master,
    CLUSTERDOWN). Failing here is not an error: the caller retries anyway."""
    try:
        client.nodes_manager.initialize()
    except Exception:  # noqa: BLE001 - the next attempt reports what is wrong
        pass


def replicated(
    client: Any, args: Sequence[Any], replicas: int, deadline: float,
    drop_on: tuple[type[BaseException], ...],
) -> Any:
    """Send ``args`` on one connection of ``client``'s pool, then ``WAIT replicas``
    there until enough replicas have the write or ``deadline`` (monotonic) passes.

    A connection that failed (``drop_on``) is closed so the pool never reuses it.
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command(*args)
        reply = client.parse_response(conn, args[0])
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            conn.send_command("WAIT", replicas, max(1, min(WAIT_SLICE_MS, left_ms)))
            acked = int(client.parse_response(conn, "WAIT"))
            if acked >= replicas:
                return reply
            if time.monotonic() >= deadline:
                raise NotReplicatedError(
                    f"{args[0]} applied on the master but acknowledged by {acked} of "
                    f"{replicas} replicas (wait_replicas) before the retry deadline"
                )
    except drop_on:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
