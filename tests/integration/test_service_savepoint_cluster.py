"""Savepoints across stores with a real Redis Cluster (3 masters, 3 replicas) on one
side: a controller and two workers per service (subprocesses, gRPC on loopback).

SQLite -> Redis Cluster: a savepoint taken mid-stream on SQLite while records are
injected, restored into a service on the cluster and fed the rest; the first service's
output up to the cut plus the second's after it equals the failure-free run exactly,
each window once. Before that good restore, a corrupt copy of the file (one bit
flipped) and a truncated one are refused by the controller on the cluster, and nothing
of them is in the cluster's store afterwards. Redis Cluster -> SQLite: the same the
other way round. The scenario is tests/support/savepoints.py's, as for SQLite -> Redis.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.state import open_store
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.savepoints import flipped, mid_stream, send_restore
from tests.support.service_cluster import Cluster

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


def _nothing_of_it(url: str) -> None:
    """The store holds no key range, token or log of the savepoint's pipeline."""
    store = open_store(url)
    try:
        for node, ranges in (("injector:events", 1), ("tag", 3), ("counts", 2)):
            assert not store.list_keys(node, None, 1), node
            assert all(store.current_token(node, r) == 0 for r in range(ranges)), node
            assert not store.read_watermarks(node), node
        for stream in ("counts", "tagged", "events"):
            assert store.log_end(stream) == (0, 0), stream
    finally:
        store.close()


def test_sqlite_to_redis_cluster_mid_stream_exact(tmp_path: Path, redis_cluster: RedisClusterNodes) -> None:
    url = f"{redis_cluster.url}?prefix=sp-to"

    def refused(second: Cluster, path: Path) -> None:
        data = path.read_bytes()
        for name, bad in (("flipped", flipped(data)), ("truncated", data[:len(data) - 100])):
            with pytest.raises(InvalidSpecError, match="corrupt|truncated"):
                send_restore(second, bad)
            assert not second.client.computations().computations, name
            assert not second.client.status().ranges, name
        _nothing_of_it(url)

    mid_stream(tmp_path, None, url, refused=refused)


def test_redis_cluster_to_sqlite_mid_stream_exact(tmp_path: Path, redis_cluster: RedisClusterNodes) -> None:
    mid_stream(tmp_path, f"{redis_cluster.url}?prefix=sp-from", None)
