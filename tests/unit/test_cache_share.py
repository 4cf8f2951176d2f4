"""A worker's state caches share one budget: the more ranges it owns, the fewer keys
each keeps decoded (a range alone kept up to 200,000, so 64 ranges could hold 12.8
million keys' state in one process). The cache itself is cleared past its cap at a
checkpoint (millwheel/runtime/range_worker.py), so the cap bounds memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from millwheel.clock import SystemClock
from millwheel.operators import build_computation
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router
from millwheel.sensors import NullSensors
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Topology
from services.worker.units import MIN_RANGE_CACHED_KEYS, WORKER_CACHED_KEYS, OwnedRange, share_cache


def test_ranges_share_the_workers_budget(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    spec = ComputationSpec("count", (InputSpec("in"),), ("out",), CodeRef("map", {"key": "key"}))
    topo = Topology(computations=(spec,))
    units: dict[Any, OwnedRange] = {}

    def own(r: int) -> None:
        rw = RangeWorker(spec, r, store, build_computation(spec), Router(topo), SystemClock(), NullSensors())
        units[("count", r)] = OwnedRange("count", r, rw.token, store, worker=rw)

    own(0)
    assert share_cache(units) == WORKER_CACHED_KEYS
    assert units[("count", 0)].worker.max_cached_keys == WORKER_CACHED_KEYS  # type: ignore[union-attr]
    for r in range(1, 8):
        own(r)
    units[("injector:in", 0)] = OwnedRange("injector:in", 0, 1, store)  # an outbox has no cache
    share = share_cache(units)
    assert share == WORKER_CACHED_KEYS // 8
    assert {o.worker.max_cached_keys for o in units.values() if o.worker} == {share}  # type: ignore[union-attr]
    assert share_cache(units, budget=1000) == MIN_RANGE_CACHED_KEYS  # never below the floor
    store.close()
