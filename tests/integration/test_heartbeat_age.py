"""ClusterStatus never shows a negative heartbeat age (issue 21, item 8).

The age was ``now - last_seen`` with ``now`` read before the controller's lock was
taken: a heartbeat that held the lock meanwhile set ``last_seen`` after ``now``. The
console's worker rows did the same. Against a real controller whose lock heartbeats
keep busy (two workers, a thousand key ranges), polled from several threads.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from millwheel.keys import KeyExtractor
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from tests.support.service_cluster import Cluster

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_heartbeat_ages_are_never_negative(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_worker()
    cluster.start_worker()
    cluster.register(Topology(
        computations=(ComputationSpec("wide", (InputSpec("events", KeyExtractor("key")),), ("out",),
                                      CodeRef("map", {"key": "key"}), Options(key_ranges=1024)),),
        injectors=(InjectorSpec("events", "events"),)))
    cluster.wait_balanced(60)
    ages: list[float] = []
    stop = time.monotonic() + 10

    def poll() -> None:
        while time.monotonic() < stop:
            ages.extend(w.last_heartbeat_age_s for w in cluster.client.status().workers if w.alive)

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ages) > 20
    negative = [a for a in ages if a < 0]  # 9 of 107, down to -0.099 s, before
    assert not negative, f"{len(negative)} of {len(ages)} ages negative, down to {min(negative):.6f} s"
