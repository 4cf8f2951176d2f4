"""Workers follow the registry by its changes (issue 34 item 9): a real controller and
two real workers (subprocesses, gRPC on loopback) while a pipeline runs.

Computations are registered, updated and unregistered while records flow; each worker
takes every new version as the changes to the one it holds (HeartbeatResponse
topology_delta_json), not the whole registry, and runs what changed: the outputs of the
pipeline running throughout and of the one registered meanwhile (with its window size
updated before its records came) are exactly the failure-free run's. A worker started
later holds no version: it gets the whole registry and runs its share.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from millwheel.sources import ListSource
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.rpc.convert import spec_to_proto
from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, expected_outputs, start_cluster, wait_for

pytestmark = pytest.mark.timeout(240)
DISORDER = 2 * pipelines.SECOND
DELTA = re.compile(r"registry version (\d+) from the changes to version (\d+)")


def second(window_s: int, doomed_n: int = 0) -> Topology:
    """A pipeline of its own over the ``more`` injector, and a computation to unregister."""
    opts = Options(key_ranges=2)
    return Topology(
        (ComputationSpec("parse2", (InputSpec("more"),), ("parsed2",), CodeRef("map", {"key": "json['user']"}), opts),
         ComputationSpec("counts2", (InputSpec("parsed2"),), ("counts2",),
                         CodeRef("window_aggregate", {"size_us": window_s * pipelines.SECOND}), opts),
         ComputationSpec("doomed", (InputSpec("parsed2"),), ("doomed_out",),
                         CodeRef("filter", {"expr": f"True or {doomed_n}"}), opts)),
        (InjectorSpec("more", "more"),))


def test_workers_take_registry_changes_while_a_pipeline_runs(tmp_path: Path) -> None:
    c = start_cluster(tmp_path, workers=2, allow_code=PIPELINE_CODE)
    try:
        first = pipelines.topology(key_ranges=2)
        records = pipelines.workload(n=600)
        more = pipelines.workload(n=400, seed=5)
        c.register(first)
        c.wait_balanced()
        half = len(records) // 2
        c.inject("events", "events", records[:half], max_disorder_us=DISORDER)

        # Meanwhile: a second pipeline registered (one change), a computation of it updated
        # twice and one unregistered; the window size of counts2 changed before any record.
        c.client.register(second(10))
        c.client.update(spec_to_proto(second(10, doomed_n=1).computations[2]))
        c.client.update(spec_to_proto(second(5).computations[1]), on_open_windows="drop")
        c.client.unregister("doomed")
        final = c.client.describe("counts2")
        assert final.version == 2

        def caught_up(log: str) -> bool:
            return any(int(m.group(1)) >= 4 + 4 for m in DELTA.finditer(log))
        # Both workers took the last versions as changes (the first pipeline's four changes
        # and the four above: version 8).
        wait_for(lambda: all(caught_up(c.log(f"worker{i}")) for i in (0, 1)), 30, "workers to take the changes")
        controller = c.log("controller")
        assert "its changes since version" in controller
        sent = [int(v) for v in re.findall(r"registry version (\d+): its changes since version", controller)]
        assert max(sent) == 8

        # A worker started now holds no version: the whole registry, once.
        c.workers[0].send_signal(signal.SIGKILL)
        c.workers[0].wait(10)
        late = c.start_worker()
        late_id = c.worker_id(late)
        assert late_id is not None
        c.wait_balanced(30)
        assert c.ranges_of(late_id)
        log = c.log("worker2")
        assert "registry version 8: 5 computations, 2 injectors" in log
        assert not DELTA.search(log)
        assert re.search(r"registry version 8: encoded whole \(\d+ characters\) for a worker holding version -1",
                         c.log("controller"))

        c.inject("events", "events", records[half:], max_disorder_us=DISORDER, done=True)
        c.inject("more", "more", more, max_disorder_us=DISORDER, done=True)
        c.wait_watermark("totals")
        c.wait_watermark("counts2")
        want = expected_outputs(tmp_path, first, pipelines.sources(records), ("counts", "totals"))
        assert c.outputs("counts") == want["counts"] and c.outputs("totals") == want["totals"]
        running = Topology(second(5).computations[:2], second(5).injectors)
        (tmp_path / "second").mkdir()
        want2 = expected_outputs(tmp_path / "second", running, {"more": ListSource(more, DISORDER)}, ("counts2",))
        assert len(want2["counts2"]) > 20
        assert c.outputs("counts2") == want2["counts2"]  # 5-second windows: the updated spec ran
    finally:
        c.stop()
