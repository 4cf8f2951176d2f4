"""Scale out and in while records flow (issue 13 item 3): a worker that joins takes a
fair share of the key ranges, a worker sent SIGTERM drains (its ranges move, it exits
0), and the output equals a failure-free run record by record, with watermarks that
never went backwards."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tests.support import pipelines
from tests.support.service_cluster import Cluster, WatermarkMonitor, expected_outputs, wait_for

DISORDER = 2 * pipelines.SECOND


def test_workers_join_and_leave_mid_stream_without_loss(cluster: Cluster, tmp_path: Path) -> None:
    topology = pipelines.topology(key_ranges=4)  # 3 computations x 4 + the injector: 13 ranges
    records = pipelines.workload(n=1500)
    first = [cluster.start_worker() for _ in range(2)]
    cluster.register(topology)
    cluster.wait_balanced()
    monitor = WatermarkMonitor(cluster.client)
    joined: list[subprocess.Popen[bytes]] = []

    def between(i: int) -> None:
        time.sleep(0.05)
        if i == 5:  # scale out: a third worker joins and gets its share (13 ranges / 3)
            joined.append(cluster.start_worker())
            cluster.wait_balanced()
            wid = cluster.worker_id(joined[0])
            assert wid is not None and len(cluster.ranges_of(wid)) in (4, 5)
        if i == 15:  # scale in: one of the first two drains and leaves
            first[0].send_signal(signal.SIGTERM)

    cluster.inject("events", "events", records, batch=50, max_disorder_us=DISORDER, done=True,
                   between=between)
    assert first[0].wait(30) == 0  # drained and exited cleanly
    cluster.wait_watermark("totals", timeout=120)
    monitor.stop()
    wait_for(lambda: len([w for w in cluster.client.status().workers if w.alive]) == 2, 15,
             "the drained worker to be gone")
    live = [w for w in cluster.client.status().workers if w.alive]
    assert sorted(w.ranges for w in live) == [6, 7]  # 13 ranges over the two left
    want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("counts", "totals"))
    assert cluster.outputs("counts") == want["counts"]
    assert cluster.outputs("totals") == want["totals"]
    assert monitor.samples > 5 and monitor.backwards == []
    wait_for(lambda: all(r.worker_id for r in cluster.client.status().ranges), 10, "every range owned")
