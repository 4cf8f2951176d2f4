"""redis-server killed with SIGKILL mid-stream (AOF on, ``appendfsync always``) and
restarted on the same port and data dir.

Two ways a run gets through it: the store retries with backoff and the same
``millwheel run`` process carries on; or the outage outlasts the retry deadline, the
run stops with a clear error and a rerun resumes from what Redis holds. Either way
the output equals a failure-free run, record for record.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.state import open_store
from tests.support.pipelines import Outputs, millwheel_run, outputs_of, run_to_end, write_spec
from tests.support.redis_server import RedisServer

RECORDS = 24_000


@pytest.fixture(scope="module")
def spec_and_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Outputs]:
    tmp = tmp_path_factory.mktemp("redis-restart")
    spec = write_spec(tmp, RECORDS)
    url = f"sqlite:///{tmp / 'reference.db'}"
    run_to_end(spec, url)
    return spec, outputs_of(url)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True, appendfsync="always") as srv:
        yield srv


def wait_for_progress(url: str, min_windows: int = 20, timeout_s: float = 60) -> None:
    store = open_store(url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(store.read_log("counts", 0, 10**6)) >= min_windows:
                return
            time.sleep(0.05)
        raise AssertionError("the run made no progress")
    finally:
        store.close()


def test_run_survives_a_redis_kill_and_restart(server: RedisServer, spec_and_reference: tuple[Path, Outputs]) -> None:
    spec, reference = spec_and_reference
    proc = millwheel_run(spec, server.url)
    wait_for_progress(server.url)
    assert proc.poll() is None, "finished before Redis could be killed; make the workload bigger"
    server.kill()
    time.sleep(1.0)  # the runner is retrying against a closed port meanwhile
    server.start()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()
    assert outputs_of(server.url) == reference


def test_outage_longer_than_the_retry_deadline_stops_the_run_and_a_rerun_resumes(
    server: RedisServer, spec_and_reference: tuple[Path, Outputs]
) -> None:
    spec, reference = spec_and_reference
    url = f"{server.url}?retry_deadline=0.5"
    proc = millwheel_run(spec, url)
    wait_for_progress(server.url)
    server.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "Redis unreachable" in err.decode(), err.decode()
    server.start()
    partial = outputs_of(server.url)
    assert 0 < len(partial["counts"]) < len(reference["counts"])
    run_to_end(spec, url)
    assert outputs_of(server.url) == reference
