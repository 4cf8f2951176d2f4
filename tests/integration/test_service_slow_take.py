"""A range that is slow to build does not hold up the worker's heartbeats.

Building a range reads its state from the store (every retained consumed record ID,
for the deduplicator) and constructs its code; either can take seconds. Built on the
heartbeat thread, as before, that silenced the worker past the controller's
``--heartbeat-timeout``: it was declared dead and every range of it moved (seen in a
soak at the first record-ID expiry). Now ranges are built on taker threads
(services/worker/taker.py): here a computation whose constructor sleeps 8 s (five
heartbeat timeouts) is registered while a canary pipeline runs; every worker stays
alive throughout, the canary keeps flowing, and once built the slow ranges run too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.generated import millwheel_pb2 as pb
from tests.support.canary_pipeline import Canary
from tests.support.service_cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(300)
CODE = "tests.support.misbehaving_code"
BUILD_S = 8.0


def test_a_range_slow_to_build_leaves_its_worker_alive_and_other_ranges_flowing(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, allow_code=CODE)  # --heartbeat-timeout 1.5 s
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.start_worker()
        canary = Canary(cluster.client)
        canary.register()
        canary.round()
        cluster.client.register_topology(
            [pb.ComputationSpec(name="slow", inputs=[pb.InputStream(stream="slow-in")], outputs=["slow-out"],
                                code=pb.Code(name=f"{CODE}:SlowToBuild",
                                             params_json=json.dumps({"output": "slow-out", "seconds": BUILD_S})),
                                options=pb.Options(key_ranges=2))],
            [("slow", "slow-in")], ["slow-out"])
        registered = time.monotonic()
        not_alive = []
        # While the slow ranges are being built: every worker alive at every look, and the
        # canary's rounds go through.
        while time.monotonic() - registered < BUILD_S + 2:
            status = cluster.client.status()
            not_alive += [w.worker_id for w in status.workers if not w.alive]
            assert len(status.workers) == 2, status.workers
            canary.round()
            time.sleep(0.2)
        assert not not_alive, f"workers seen not alive while a range was built: {not_alive}"
        assert "declared dead" not in cluster.log("controller"), cluster.log("controller")[-3000:]
        # Built, they run: records injected into the slow computation come out.
        records = [pb.Record(key=f"k{i}", value=b"%d" % i, timestamp=1_000_000 + i, id=f"s{i}") for i in range(40)]
        cluster.client.inject([pb.InjectRequest(injector="slow", stream="slow-in", records=records)])
        wait_for(lambda: len(list(cluster.client.subscribe("slow-out"))) == 40, 60,
                 "the slow computation's records to come out")
        assert sorted(r.value for _s, r in cluster.client.subscribe("slow-out")) == sorted(r.value for r in records)
        status = cluster.client.status()
        assert all(w.alive for w in status.workers), status.workers
        assert "declared dead" not in cluster.log("controller")
        print(f"canary rounds (s): {[round(t, 2) for t in canary.seconds]}")
    finally:
        cluster.stop()
