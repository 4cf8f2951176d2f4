"""A worker whose ``--allow-code`` is narrower than the controller's: it may not run a
computation the controller accepted. It says so in its log (once a minute, not on
every heartbeat, no traceback), keeps serving its other ranges, and tells the
controller in its heartbeats, which moves the refused ranges to a worker that may run
them as soon as there is one; the output is exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from millwheel.record import MAX_TIMESTAMP
from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, Cluster, expected_outputs, wait_for

pytestmark = pytest.mark.timeout(240)
MESSAGE = "not taking ranges of computation 'totals'"


def test_a_worker_refusing_a_computation_logs_it_rarely_and_serves_its_other_ranges(tmp_path: Path) -> None:
    topology = pipelines.topology(key_ranges=2)
    records = pipelines.workload(n=400)
    cluster = Cluster(tmp_path, controller_args=["--allow-code", PIPELINE_CODE])
    try:
        cluster.start_controller()
        refusing = cluster.start_worker()  # built-in operators only; alone, it is assigned every range
        cluster.register(topology)
        wait_for(lambda: MESSAGE in cluster.log("worker0"), 20, "the refusal in the worker's log")
        # Its built-in ranges go on: every stage before totals completes (counts' own
        # watermark waits for its outputs to totals, but its logged stream is complete).
        want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
        cluster.inject("events", "events", records, max_disorder_us=2 * pipelines.SECOND, done=True)
        cluster.wait_watermark("parse", timeout=60)
        wait_for(lambda: cluster.outputs("counts") == want["counts"], 60, "every count in the stream log")
        refusing_id = cluster.worker_id(refusing)
        assert refusing_id is not None
        assert {n for n, _r, _t in cluster.ranges_of(refusing_id)} == {"injector:events", "parse", "counts", "totals"}
        assert cluster.client.watermarks("totals")[0].low_watermark < MAX_TIMESTAMP

        # Many heartbeats (every 100 ms) later, the refusal was logged once, without a traceback.
        log = cluster.log("worker0")
        assert 1 <= log.count(MESSAGE) <= 3, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        line = next(ln for ln in log.splitlines() if MESSAGE in ln)
        assert "tests.support.pipelines" in line  # the module
        assert "built-in operators only" in line  # the worker's allow-list

        # A worker allowed to run totals joins: the controller moves totals' ranges to it
        # (the refusing worker keeps running and keeps its built-in ranges), and the
        # output is exact.
        allowed = cluster.start_worker("--allow-code", PIPELINE_CODE)
        cluster.wait_watermark("totals", timeout=90)
        allowed_id = cluster.worker_id(allowed)
        assert allowed_id is not None
        assert {r for n, r, _t in cluster.ranges_of(allowed_id) if n == "totals"} == {0, 1}
        assert refusing.poll() is None and cluster.ranges_of(refusing_id)
        assert "totals" not in {n for n, _r, _t in cluster.ranges_of(refusing_id)}
        assert cluster.outputs("counts") == want["counts"]
        assert cluster.outputs("totals") == want["totals"]
        assert len(want["totals"]) > 20
        assert cluster.log("worker0").count(MESSAGE) <= 3
    finally:
        cluster.stop()
