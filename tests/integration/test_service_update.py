"""Updating a running computation in place (UpdateComputation, ``millwheel update``)
on a real controller and two real workers (subprocesses, gRPC on loopback).

A ``map`` tags every record with its version ("v1:" or "v2:" before the value); the
update switches the tag while records are injected continuously. Record by record,
every input must come out exactly once, tagged by exactly one version; every record
injected after the update answered must carry the new tag (the old code can no longer
checkpoint anything); a downstream window count, unchanged, must equal the
failure-free run exactly. The same with a worker killed -9 during the switch.
Refused updates must change nothing: registry specs and versions compared before and
after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from millwheel.errors import InvalidSpecError, NotFoundError
from millwheel.record import Record
from millwheel.sources import ListSource
from millwheel.spec import computation_to_dict
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options, Topology
from services.rpc.convert import spec_to_proto
from services.rpc.status import PreconditionError
from tests.support import tagged_counts
from tests.support.service_cluster import (
    ROOT,
    Cluster,
    expected_outputs,
    inject_with_a_call,
    sigkill_after,
    wait_for,
)
from tests.support.tagged_counts import WINDOW, count_spec, tag_spec

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
N = 1200
BATCH = 40
UPDATE_AT = 10  # inject messages before the update


def topology() -> Topology:
    return tagged_counts.topology(tag="v1", log_streams=("tagged", "counts"))


def records(n: int = N) -> list[Record]:
    return tagged_counts.records(n)


def registry_view(c: Cluster) -> list[tuple[str, Any, int, bool]]:
    """What a user sees of the registry: every computation's spec, version and whether
    it has a rollback target; and ClusterStatus's versions must agree."""
    listed = c.client.computations().computations
    view = [(i.spec.name, computation_to_dict(_spec(i.spec)), i.version, i.has_previous) for i in listed]
    status = {v.name: (v.version, v.has_previous) for v in c.client.status().versions}
    assert status == {name: (version, prev) for name, _, version, prev in view}
    return view


def _spec(msg: Any) -> ComputationSpec:
    from services.rpc.convert import spec_from_proto

    return spec_from_proto(msg)


def run_update(c: Cluster, tmp_path: Path, during: Any = None) -> None:
    """Inject continuously, update ``tag`` to v2 mid-stream (``during`` runs alongside
    the call), and check the outputs record by record."""
    topo = topology()
    c.register(topo)
    c.wait_balanced()
    recs = records()

    def update() -> None:
        resp = c.client.update(spec_to_proto(tag_spec("v2")))
        assert resp.changed and resp.previous_version == 1 and resp.computation.version == 2

    after_update = {f"r{j}" for j in inject_with_a_call(c, recs, BATCH, UPDATE_AT, update, during)}
    c.wait_watermark("counts", timeout=120)

    out = c.outputs("tagged")
    by_version: dict[str, list[str]] = {"v1": [], "v2": []}
    seen = []
    for key, value, ts, _rid in out:
        version, _, original = value.decode().partition(":")
        assert version in by_version, f"output {value!r} carries no version's tag"
        by_version[version].append(original)
        seen.append((key, original, ts))
    # Every record exactly once (none missing, none twice), each by exactly one version.
    assert sorted(seen) == sorted((r.key, r.value.decode(), r.timestamp) for r in recs)
    assert by_version["v1"] and by_version["v2"]
    # Injected after the update answered: the old code can no longer checkpoint it.
    assert after_update and after_update <= set(by_version["v2"])
    assert not after_update & set(by_version["v1"])
    # Downstream state unaffected: its window counts are the failure-free run's.
    want = expected_outputs(tmp_path, topo, {"events": ListSource(recs)}, ("counts",))
    assert c.outputs("counts") == want["counts"]
    info = c.client.describe("tag")
    assert info.version == 2 and info.has_previous
    assert _spec(info.spec).code.params["value"] == "'v2:' + value"


def test_update_mid_stream(two_workers: Cluster, tmp_path: Path) -> None:
    run_update(two_workers, tmp_path)


def test_update_with_a_worker_killed_during_the_switch(two_workers: Cluster, tmp_path: Path) -> None:
    victim = two_workers.workers[0]
    # 50 ms in, the call is under way: new tokens, ranges being rebuilt
    run_update(two_workers, tmp_path, during=sigkill_after(victim, 0.05))
    assert victim.wait(10) == -signal.SIGKILL


def test_refused_updates_change_nothing_then_drop_and_rollback(two_workers: Cluster) -> None:
    c = two_workers
    c.register(topology())
    c.wait_balanced()
    # Records without the end of input: windows of "counts" stay open.
    c.inject("events", "events", records(200), batch=50)
    wait_for(lambda: c.client.state("counts", "k1").state, 60, "open windows in counts")
    # Every record counted: one still in flight at the drop below would be counted by the
    # new version into a new window (seen once: k1's windows "gone" held 22 records).
    wait_for(lambda: tagged_counts.counted(c.client) == 200, 60, "the 200 records to be counted")
    before = registry_view(c)
    assert [v[2] for v in before] == [1, 1]

    refusals: list[tuple[type[Exception], Any, str, str]] = [
        (PreconditionError, count_spec(WINDOW * 2), "", "window"),  # open windows, default refuse
        (PreconditionError, tag_spec("v2", key_ranges=5), "", "key_ranges"),
        (PreconditionError, ComputationSpec("tag", (InputSpec("events"),), ("elsewhere",),
                                            CodeRef("map", {"value": "value"}), Options(key_ranges=3)),
         "", "tagged"),  # counts would be orphaned (and a logged stream unwritten)
        (NotFoundError, ComputationSpec("nobody", (InputSpec("events"),), ("x",),
                                        CodeRef("map", {"value": "value"})), "", "nobody"),
        (InvalidSpecError, count_spec(WINDOW * 2), "fold", "fold"),  # no such directive
        (InvalidSpecError, ComputationSpec("tag", (InputSpec("events"),), ("tagged",),
                                           CodeRef("map", {"value": "value +"}), Options(key_ranges=3)),
         "", "syntax"),  # cannot be built: the old version keeps running
    ]
    for cls, spec, directive, needle in refusals:
        with pytest.raises(cls) as err:
            c.client.update(spec_to_proto(spec), on_open_windows=directive)
        assert needle in str(err.value), str(err.value)
        assert registry_view(c) == before, f"refused update ({needle}) changed the registry"
    with pytest.raises(PreconditionError, match="no previous version"):
        c.client.update(None, rollback="counts")
    assert registry_view(c) == before

    # Sending the running spec again is a no-op (a retry after a lost answer).
    same = c.client.update(spec_to_proto(tag_spec("v1")))
    assert not same.changed and same.computation.version == 1
    assert registry_view(c) == before

    # drop: the open windows are discarded and the new window size runs.
    resp = c.client.update(spec_to_proto(count_spec(WINDOW * 2)), on_open_windows="drop")
    assert resp.changed and resp.dropped_windows > 0 and resp.computation.version == 2
    gone = c.client.state("counts", "k1")
    assert gone.state == b"" and not gone.exists
    assert _spec(c.client.describe("counts").spec).code.params["size_us"] == WINDOW * 2

    # Rollback through the CLI: back to the spec registered first, version 3.
    cli = subprocess.run(
        [sys.executable, "-m", "services.cli", "update", "--rollback", "counts", "--controller", c.address,
         "--json", "--on-open-windows", "drop"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    answer = json.loads(cli.stdout)
    assert answer["version"] == 3 and answer["previous_version"] == 2 and answer["rolled_back"]
    after = registry_view(c)
    assert after[1][1] == before[1][1] and after[1][2] == 3 and not after[1][3]
    with pytest.raises(PreconditionError, match="no previous version"):
        c.client.update(None, rollback="counts")

    # The pipeline still runs end to end on the rolled-back code.
    c.inject("events", "events", records(400)[200:], batch=50, done=True)
    c.wait_watermark("counts", timeout=120)
    assert c.outputs("counts")
