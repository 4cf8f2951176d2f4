"""Fixtures of the store contract suite: one fresh store per test, for every backend."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.state import open_store
from millwheel.state.protocol import StateStore
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.redis_server import RedisServer

BACKENDS = ("sqlite", "redis", "redis-cluster")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh redis-server (no persistence) on a free loopback port."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_server_aof() -> Iterator[RedisServer]:
    """A fresh redis-server with AOF on and ``appendfsync always``."""
    with RedisServer(appendonly=True, appendfsync="always") as server:
        yield server


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'contract.db'}"
    elif request.param == "redis-cluster":
        nodes: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        yield f"{nodes.url}?prefix={_unique_prefix(request)}"
    else:
        with RedisServer() as server:
            yield server.url


@pytest.fixture
def store(store_url: str) -> Iterator[StateStore]:
    s = open_store(store_url)
    yield s
    s.close()


def _unique_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix of this test alone, so tests sharing the session's cluster start empty."""
    return "t" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
