"""The Zeitgeist demo on Redis (one server, and a real Redis Cluster by the same kind
of URL) finds exactly the anomalies it finds on SQLite, and still does after a
kill -9 part-way through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.redis_cluster import RedisClusterNodes
from tests.support.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--records", "30000", "--keys", "20", "--seed", "4", "--json", "--quiet"]


def demo(store: str, crash_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MILLWHEEL_CRASH_AT", None)
    if crash_at:
        env["MILLWHEEL_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", "zeitgeist", *ARGS, "--store", store],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """One redis-server (AOF, fsync always), or the session's 3-master cluster: the
    demo is given the URL of one node either way and finds the cluster by itself."""
    if request.param == "redis":
        with RedisServer(appendonly=True, appendfsync="always") as server:
            yield server.url
    else:
        nodes: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        yield nodes.url


def test_zeitgeist_on_redis_detects_the_same_anomalies_as_on_sqlite(tmp_path: Path, redis_url: str) -> None:
    on_sqlite = result(demo(f"sqlite:///{tmp_path / 'z.db'}"))
    assert on_sqlite["detected"], "the demo detected nothing; the comparison would be empty"
    on_redis = result(demo(f"{redis_url}?prefix=zeitgeist"))
    crashed = demo(f"{redis_url}?prefix=crashed", crash_at="after_checkpoint:25")
    assert crashed.returncode == -9, crashed.stderr
    resumed = result(demo(f"{redis_url}?prefix=crashed"))
    assert on_redis["planted"] == on_sqlite["planted"]
    assert on_redis["detected"] == on_sqlite["detected"]
    assert (on_redis["precision"], on_redis["recall"]) == (on_sqlite["precision"], on_sqlite["recall"])
    assert resumed["detected"] == on_sqlite["detected"]
