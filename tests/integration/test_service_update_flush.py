"""``millwheel update --on-open-windows flush`` on a real controller and two real
workers (subprocesses, gRPC on loopback).

A windowed count (2 s tumbling windows) runs while records are injected; mid-stream it
is updated to 3 s windows with flush. For every key the output must be exactly a
reference in which the key's records up to some point were counted in 2 s windows,
every one of those windows produced exactly once (the windows open at the switch with
the records they held then), and every later record in 3 s windows; every record
injected after the update answered is in a 3 s window. Nothing missing, nothing twice.
The same with a worker killed -9 during the switch. A flush that the controller cannot
route (a consumer keys the results by user code) is refused and changes nothing.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Topology
from services.rpc.convert import spec_to_proto
from services.rpc.status import PreconditionError
from tests.support import tagged_counts
from tests.support.savepoints import run_cli
from tests.support.service_cluster import PIPELINE_CODE, Cluster, inject_with_a_call, sigkill_after, wait_for
from tests.support.tagged_counts import SECOND

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
OLD, NEW = 2 * SECOND, 3 * SECOND
N = 1200
BATCH = 40
KEYS = 7
UPDATE_AT = 12  # inject messages before the update


def count_spec(size_us: int) -> ComputationSpec:
    return tagged_counts.count_spec(size_us, stream="events")


def records() -> list[Record]:
    return tagged_counts.records(N, KEYS)


def windows(timestamps: list[int], size: int) -> Counter[tuple[int, int, int]]:
    """(start, end, count) of each tumbling window of ``size`` over ``timestamps``."""
    per = Counter(ts - ts % size for ts in timestamps)
    return Counter((start, start + size, n) for start, n in per.items())


def check_against_reference(out: list[tuple[str, bytes, int, str]], recs: list[Record],
                            after_update: set[int]) -> dict[str, int]:
    """For each key, the split point s such that its output is exactly: its first s
    records in OLD windows (each once) plus the rest in NEW windows; asserted to exist,
    and to fall before every record injected after the update answered."""
    got: dict[str, Counter[tuple[int, int, int]]] = {}
    for key, value, ts, _rid in out:
        result = json.loads(value)
        assert result["key"] == key and result["agg"] == "count" and ts == result["end"] - 1
        got.setdefault(key, Counter())[(result["start"], result["end"], result["value"])] += 1
    splits = {}
    for k in range(KEYS):
        key = f"k{k}"
        mine = [(i, r.timestamp) for i, r in enumerate(recs) if r.key == key]
        found = [s for s in range(len(mine) + 1)
                 if windows([t for _, t in mine[:s]], OLD) + windows([t for _, t in mine[s:]], NEW)
                 == got.get(key, Counter())]
        assert found, f"{key}: output {sorted(got.get(key, {}))} is no old/new split of its records"
        s = found[0]
        late = [j for j, (i, _) in enumerate(mine) if i in after_update]
        assert all(j >= s for j in late), f"{key}: a record injected after the update was counted by the old code"
        splits[key] = s
    return splits


def run_flush(c: Cluster, tmp_path: Path, during: Any = None) -> None:
    topo = Topology((count_spec(OLD),), (InjectorSpec("events", "events"),), ("counts",))
    c.register(topo)
    c.wait_balanced()
    recs = records()
    new_file = tmp_path / "counts-3s.json"
    new_file.write_text(json.dumps({"name": "counts", "inputs": [{"stream": "events"}], "outputs": ["counts"],
                                    "code": {"name": "window_aggregate",
                                             "params": {"size_us": NEW, "aggregation": "count"}},
                                    "options": {"key_ranges": 2}}))
    answer: dict[str, Any] = {}

    def update() -> None:
        code, out, err = run_cli("update", str(new_file), "--on-open-windows", "flush",
                                 "--controller", c.address, "--json")
        assert code == 0, err
        answer.update(json.loads(out))

    after_update = inject_with_a_call(c, recs, BATCH, UPDATE_AT, update, during)
    c.wait_watermark("counts", timeout=120)
    assert answer["changed"] and answer["version"] == 2 and answer["dropped_windows"] == 0
    assert answer["flushed_windows"] > 0, answer  # windows were open at the switch
    splits = check_against_reference(c.outputs("counts"), recs, after_update)
    assert any(0 < s < N // KEYS for s in splits.values()), splits  # the switch fell mid-stream
    assert after_update
    # The state holds no window of the old shape: every key's windows are 3 s ones, and closed.
    assert not c.client.state("counts", "k1").exists


def test_update_flush_mid_stream(two_workers: Cluster, tmp_path: Path) -> None:
    run_flush(two_workers, tmp_path)


def test_update_flush_with_a_worker_killed_during_the_switch(two_workers: Cluster, tmp_path: Path) -> None:
    victim = two_workers.workers[0]
    # 50 ms in, the call is under way: windows flushed, ranges being rebuilt
    run_flush(two_workers, tmp_path, during=sigkill_after(victim, 0.05))
    assert victim.wait(10) == -signal.SIGKILL


def test_flush_refused_when_a_consumer_keys_results_by_user_code(tmp_path: Path) -> None:
    c = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    try:
        c.start_controller()
        c.start_worker()
        keyed = ComputationSpec("per_window", (InputSpec("counts", KeyExtractor(f"import:{PIPELINE_CODE}:key_of")),),
                                ("out",), CodeRef("map", {"value": "value"}))
        c.register(Topology((count_spec(OLD), keyed), (InjectorSpec("events", "events"),), ("out",)))
        c.wait_balanced()
        c.inject("events", "events", records()[:200], batch=50)
        wait_for(lambda: c.client.state("counts", "k1").state, 60, "open windows in counts")
        before = [(i.spec.SerializeToString(), i.version) for i in c.client.computations().computations]
        with pytest.raises(PreconditionError, match="user code"):
            c.client.update(spec_to_proto(count_spec(NEW)), on_open_windows="flush")
        assert [(i.spec.SerializeToString(), i.version) for i in c.client.computations().computations] == before
        assert c.client.state("counts", "k1").exists  # its windows are still open
    finally:
        c.stop()
