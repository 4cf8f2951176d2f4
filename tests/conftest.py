"""Shared fixtures: fresh stores per test, and one real Redis Cluster per session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from millwheel.state.sqlite_store import SQLiteStore
from tests.support.redis_cluster import RedisClusterNodes


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "store.db")
    yield store
    store.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """3 masters + 3 replicas (AOF, appendfsync always), started once per session;
    tests keep apart by key prefix (``?prefix=``), as deployments sharing a cluster do."""
    with RedisClusterNodes() as nodes:
        yield nodes
