"""Each key range's pending outbox (productions checkpointed, not yet acked by their
consumers) is reported by its owner and shown by ClusterStatus, the console's ranges
table and its Tracker API: work in flight while a backlog drains, none once it has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, ROOT, Cluster, wait_for


def test_pending_outbox_per_range_rises_and_drains(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.register(pipelines.topology(key_ranges=2))
        seen: dict[tuple[str, int], int] = {}
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.02):
                for r in cluster.client.status().ranges:
                    seen[(r.node, r.range_id)] = max(seen.get((r.node, r.range_id), 0), r.pending)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cluster.inject("events", "events", pipelines.workload(n=20_000), batch=5000, done=True)
        cluster.wait_watermark("totals", timeout=120)
        time.sleep(0.5)
        stop.set()
        sampler.join(5)
        assert max(seen.values()) > 0, seen  # a backlog was in flight at some point
        wait_for(lambda: all(r.pending == 0 for r in cluster.client.status().ranges), 10,
                 "every outbox to drain")
        shown = subprocess.run([sys.executable, "-m", "services.cli", "status", "--json", "--controller",
                                cluster.address], capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert shown.returncode == 0, shown.stderr
        assert {r["pending"] for r in json.loads(shown.stdout)["ranges"]} == {0}
    finally:
        cluster.stop()
