"""A three-stage pipeline on a controller and three worker processes, used the way a
user would from another process: register over gRPC, inject, Subscribe, query
watermarks, state and keys, read metrics, drain a worker with SIGTERM."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from millwheel.record import MAX_TIMESTAMP
from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, Cluster, expected_outputs, wait_for

pytestmark = pytest.mark.timeout(240)
DISORDER = 2 * pipelines.SECOND


@pytest.fixture(params=["sqlite", "redis", "redis-cluster"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path):
    """The same service over the embedded store, a real redis-server, and a real
    3-master Redis Cluster (given by the URL of one node, as a user would)."""
    redis = None
    url = None
    if request.param == "redis":
        from tests.support.redis_server import RedisServer

        redis = RedisServer(appendonly=True)
        url = redis.url
    elif request.param == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url + "?prefix=pipeline"
    c = Cluster(tmp_path, store_url=url, allow_code=PIPELINE_CODE)
    try:
        c.start_controller()
        yield c
    finally:
        c.stop()
        if redis is not None:
            redis.stop()


def test_three_stage_pipeline_across_three_workers(cluster: Cluster, tmp_path: Path) -> None:
    topology = pipelines.topology(key_ranges=3)
    records = pipelines.workload(n=900)
    for _ in range(3):
        cluster.start_worker()
    cluster.register(topology)
    cluster.wait_balanced()
    status = cluster.client.status()
    assert len({r.worker_id for r in status.ranges}) == 3  # every worker owns ranges

    # First half: windows open, so some key has state and a pending event-time timer.
    half = len(records) // 2
    cluster.inject("events", "events", records[:half], max_disorder_us=DISORDER)
    cluster.wait_watermark("counts", records[half // 2].timestamp, timeout=30)
    keys = list(cluster.client.keys("counts"))
    assert keys, "counts has keys with state mid-stream"
    state = cluster.client.state("counts", keys[0])
    assert state.exists and state.state and state.timers
    assert all(t.domain == "event" and t.tag.startswith("end:") for t in state.timers)

    cluster.inject("events", "events", records[half:], max_disorder_us=DISORDER, done=True)
    cluster.wait_watermark("totals")
    wms = {w.node: w for w in cluster.client.watermarks()}
    assert set(wms) == {"injector:events", "parse", "counts", "totals"}
    assert all(w.low_watermark == MAX_TIMESTAMP for w in wms.values())

    want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
    assert cluster.outputs("counts") == want["counts"]
    assert cluster.outputs("totals") == want["totals"]
    assert len(want["totals"]) > 50
    # All windows fired: no pending timers, and the final total of a key is its state.
    last_total = {}
    for key, value, _ts, _id in want["totals"]:
        last_total[key] = json.loads(value)["total"]
    for key, total in last_total.items():
        st = cluster.client.state("totals", key)
        assert st.exists and int(st.state) == total and not st.timers

    # Every process serves Prometheus metrics; the workers counted what they processed.
    processed = 0
    for w in status.workers:
        body = urllib.request.urlopen(f"http://{w.metrics_address}/metrics", timeout=5).read().decode()
        assert "millwheel_checkpoint_seconds_bucket" in body
        for line in body.splitlines():
            if line.startswith('millwheel_records_in_total{computation="parse"}'):
                processed += int(float(line.split()[-1]))
    assert processed >= len(records)

    # SIGTERM drains a worker: its ranges move to the others and it exits cleanly.
    leaving = cluster.workers[0]
    leaving_id = cluster.worker_id(leaving)
    assert leaving_id is not None and cluster.ranges_of(leaving_id)
    leaving.send_signal(signal.SIGTERM)
    assert leaving.wait(30) == 0
    wait_for(lambda: all(r.worker_id and r.worker_id != leaving_id
                         for r in cluster.client.status().ranges), 20, "ranges to move")
