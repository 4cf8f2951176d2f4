"""kill -9 of `millwheel run` on Redis at the seams of the exactly-once sequence.

The process SIGKILLs itself (``MILLWHEEL_CRASH_AT``) between checkpoint and ack,
between ack and send, and after injecting; a rerun on the same Redis must produce
exactly the failure-free output, record for record, on one redis-server and on
a Redis Cluster.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.pipelines import Outputs, millwheel_run, outputs_of, run_to_end, write_spec
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.redis_server import RedisServer

AnyRedis = RedisServer | RedisClusterNodes


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def server(request: pytest.FixtureRequest) -> Iterator[AnyRedis]:
    """One redis-server (AOF, fsync always), or the session's Redis Cluster (its URL
    names one node; the store finds the others)."""
    if request.param == "redis":
        with RedisServer(appendonly=True, appendfsync="always") as srv:
            yield srv
    else:
        yield request.getfixturevalue("redis_cluster")


@pytest.fixture(scope="module")
def spec_and_reference(tmp_path_factory: pytest.TempPathFactory, server: AnyRedis) -> tuple[Path, Outputs]:
    tmp = tmp_path_factory.mktemp("redis-crash")
    spec = write_spec(tmp, 3000)
    url = f"{server.url}?prefix=reference"
    run_to_end(spec, url)
    reference = outputs_of(url)
    assert len(reference["counts"]) > 100 and len(reference["totals"]) == len(reference["counts"])
    sqlite_url = f"sqlite:///{tmp / 'reference.db'}"
    run_to_end(spec, sqlite_url)
    assert outputs_of(sqlite_url) == reference, "Redis and SQLite disagree on a failure-free run"
    return spec, reference


@pytest.mark.parametrize("crash_at", [
    "after_checkpoint:4", "after_checkpoint:22", "after_ack:2", "after_ack:17", "after_inject:2",
])
def test_kill9_then_rerun_equals_failure_free_run(
    server: AnyRedis, spec_and_reference: tuple[Path, Outputs], crash_at: str
) -> None:
    spec, reference = spec_and_reference
    url = f"{server.url}?prefix=" + crash_at.replace(":", "-")
    proc = millwheel_run(spec, url, crash_at)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"never reached {crash_at}: {err.decode()}"
    assert outputs_of(url) != reference  # it really stopped part-way
    run_to_end(spec, url)
    assert outputs_of(url) == reference


def test_many_kills_in_a_row_then_finish(
    server: AnyRedis, spec_and_reference: tuple[Path, Outputs]
) -> None:
    spec, reference = spec_and_reference
    url = f"{server.url}?prefix=serial"
    rng = random.Random(5)
    for _ in range(4):
        crash_at = f"{rng.choice(['after_checkpoint', 'after_ack', 'after_user_code'])}:{rng.randint(2, 20)}"
        proc = millwheel_run(spec, url, crash_at)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (-signal.SIGKILL, 0), err.decode()
    run_to_end(spec, url)
    assert outputs_of(url) == reference
