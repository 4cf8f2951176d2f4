"""What the rest of the service does while a computation is rescaled (issue 22's
isolation rule), on a real controller and two real workers (gRPC on loopback).

A window count holding enough keys that its rescale copies for a while (ballast keys
written into the store before the service starts: state and consumed IDs, no timers,
so no output of theirs) is rescaled 2 -> 8 while a second pipeline, the canary, keeps
being fed. The copy is held :data:`HOLD_S` longer (``MILLWHEEL_HOLD_AT`` on the
controller, sleeping where the copy runs, off the controller's lock): on a fast
machine the ballast copies in under a second, too short to watch. During the copy the
canary's output log must grow, ClusterStatus must answer within a second every time
with every worker alive (their heartbeats are answered), a second rescale or an
unregistration of the computation being copied is refused with nothing changed, a
savepoint asked for meanwhile waits for the copy (its cut holds the new layout), and
GetState answers keys that never change every time. Both outputs must equal the
failure-free run's record by record.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from millwheel.sources import ListSource
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.rpc.status import PreconditionError
from tests.support import isolation
from tests.support.isolation import topology, write_ballast
from tests.support.service_cluster import Cluster, expected_outputs, wait_for
from tests.support.tagged_counts import records

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
BALLAST = 20_000  # keys of state (and as many consumed IDs): a copy of 0.5-5 s, by the machine
HOLD_S = 3  # added to the copy: ClusterStatus is sampled every ~0.2 s, at least 5 times during it
N = 800
KEYS = 23


def test_the_rest_of_the_cluster_runs_on_while_a_computation_is_rescaled(tmp_path: Path) -> None:
    topo = topology()
    c = Cluster(tmp_path, env={"MILLWHEEL_HOLD_AT": f"rescale_staged:{HOLD_S}"})
    write_ballast(c.store_url, topo, BALLAST, 2000)
    events = records(N, KEYS)
    pings = isolation.pings()
    slow = ControllerClient(c.address, timeout_s=300)
    try:
        c.start()
        c.wait_balanced()
        c.inject("events", "events", events[:N // 2], batch=40)
        fed = threading.Event()
        stop = threading.Event()

        def feed_canary() -> None:  # small batches, all along, until told to stop
            for i in range(0, len(pings), 10):
                c.inject("pings", "pings", pings[i:i + 10], batch=10, done=i + 10 >= len(pings))
                if i >= 200:
                    fed.set()
                if not stop.is_set():
                    time.sleep(0.05)
        feeder = threading.Thread(target=feed_canary)
        feeder.start()
        assert fed.wait(60)
        wait_for(lambda: len(list(c.client.subscribe("pongs"))) > 0, 60, "the canary's first outputs")

        answer: list[Any] = []
        rescaling = threading.Thread(target=lambda: answer.append(slow.rescale("counts", 8)))
        samples: list[tuple[float, int, bool]] = []  # (ClusterStatus latency, canary outputs, workers alive)
        refused: list[str] = []
        phases: list[str] = []
        summary: list[Any] = []

        def savepoint() -> None:  # waits for the copy: never a half-moved layout in its file
            for msg in slow.stub.CreateSavepoint(pb.CreateSavepointRequest()):
                phases.append(msg.phase)
                if msg.phase == "done":
                    summary.append(msg.summary)
        cutting = threading.Thread(target=savepoint)
        # GetState of keys that never change answers them all along: while the copy
        # clears and refills counts' ranges, from the staged copy (it missed keys there).
        probes = [f"ballast-{i:06d}" for i in (0, 7_777, BALLAST - 1)]
        misses: list[str] = []
        reads: list[int] = []

        def read_probes() -> None:
            while rescaling.is_alive():
                for k in probes:
                    got = c.client.state("counts", k)
                    reads.append(1)
                    if not got.exists or got.state != b"x" * 64:
                        misses.append(k)
                time.sleep(0.02)
        reader = threading.Thread(target=read_probes)
        rescaling.start()
        reader.start()
        while rescaling.is_alive():
            t = time.monotonic()
            status = c.client.status()
            took = time.monotonic() - t
            pongs = len(list(c.client.subscribe("pongs")))
            if not rescaling.is_alive():
                break  # the copy ended meanwhile: this sample is not one taken during it
            samples.append((took, pongs, all(w.alive for w in status.workers) and len(status.workers) == 2))
            if len(samples) == 3:  # the copy is under way: the computation is the rescale's
                for call in (lambda: c.client.rescale("counts", 3), lambda: c.client.unregister("counts")):
                    with pytest.raises(PreconditionError) as err:
                        call()
                    refused.append(str(err.value))
                cutting.start()
            time.sleep(0.2)
        rescaling.join()
        reader.join(60)
        cutting.join(120)
        stop.set()
        resp = answer[0]
        assert resp.changed and resp.computation.spec.options.key_ranges == 8 and resp.keys >= BALLAST
        assert not misses and len(reads) >= 30, f"GetState missed {len(misses)} of {len(reads)} reads: {misses[:5]}"
        assert len(samples) >= 5, f"{len(samples)} ClusterStatus answers during a pause of {resp.pause_us / 1e6:.1f} s"
        assert all(alive for _t, _p, alive in samples), "a worker was declared dead during the rescale"
        slowest = max(t for t, _p, _a in samples)
        assert slowest < 1.0, f"ClusterStatus took {slowest:.2f} s during the rescale's copy"
        assert samples[-1][1] > samples[0][1], f"the canary's output did not grow during the rescale: {samples}"
        assert len(refused) == 2 and all("a rescale of 'counts' is under way" in r for r in refused), refused
        assert [(i.spec.name, i.spec.options.key_ranges) for i in c.client.computations().computations] == \
            [("counts", 8), ("canary", 2)]  # the refused calls changed nothing
        assert "waiting for a rescale" in phases and summary, phases
        assert summary[0].counts["ranges"] == 8 + 2 + 2  # cut after the copy: counts' new layout, canary, injectors

        wait_for(lambda: sorted(r.range_id for r in c.client.status().ranges if r.node == "counts")
                 == list(range(8)) and all(r.worker_id for r in c.client.status().ranges), 60,
                 "counts' 8 ranges to be placed")
        c.inject("events", "events", events[N // 2:], batch=40, done=True)
        feeder.join()
        c.wait_watermark("counts", timeout=120)
        c.wait_watermark("canary", timeout=120)
        want = expected_outputs(tmp_path, topo, {"events": ListSource(events), "pings": ListSource(pings)},
                                ("counts", "pongs"))
        assert c.outputs("counts") == want["counts"]
        assert c.outputs("pongs") == want["pongs"]
        assert "declared dead" not in c.log("controller")
    finally:
        slow.close()
        c.stop()
