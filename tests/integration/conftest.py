"""Fixtures shared by the service tests; a test module may define its own ``cluster``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer
from tests.support.service_cluster import PIPELINE_CODE, Cluster, start_cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A running controller on a fresh SQLite store; tests start their own workers."""
    c = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    c.start_controller()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def redis_service(tmp_path: Path) -> Iterator[Cluster]:
    """As ``cluster``, on a fresh redis-server (AOF on) instead of SQLite: the tests
    parametrised over both stores ask for one or the other by name."""
    redis = RedisServer(appendonly=True)
    c = Cluster(tmp_path, store_url=redis.url, allow_code=PIPELINE_CODE)
    try:
        c.start_controller()
        yield c
    finally:
        c.stop()
        redis.stop()


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[Cluster]:
    """A running controller and two workers on a fresh SQLite store, built-in operators
    only: what the day-2 operation tests (update, rescale, drain) act on."""
    c = start_cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()
