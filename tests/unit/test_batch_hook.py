"""The per-key batch hook ``process_records(ctx, records)`` changes speed, not results:
the same input gives the same state, timers and productions (IDs included) as the
per-record path, and code without the hook keeps the per-record path."""

import json
from math import isfinite
from pathlib import Path
from typing import Iterable

from hypothesis import given
from hypothesis import strategies as st

from millwheel.clock import ManualClock
from millwheel.computation import Computation, Context
from millwheel.operators.aggregate import WindowedAggregate, _dump, _load
from millwheel.record import Record
from millwheel.runtime.range_worker import RangeWorker, records_hook
from millwheel.runtime.routing import Router
from millwheel.sensors import CountingSensors
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology


class PerRecordSum(WindowedAggregate):
    """The built-in, forced onto the per-record path by overriding process_record."""

    def process_record(self, ctx: Context, record: Record) -> None:
        super().process_record(ctx, record)


class Echo(Computation):
    """Produces twice per record; records which ones it saw as late."""

    def process_record(self, ctx: Context, record: Record) -> None:
        for i in range(2):
            ctx.produce("out", ctx.key, f"{record.record_id}:{i}:{ctx.is_late}".encode(), record.timestamp)


class BatchEcho(Echo):
    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        for record in records:
            self.process_record(ctx, record)


def run(tmp_path: Path, name: str, code: Computation, batches: list[tuple[list[Record], int]],
        options: Options) -> tuple[dict[str, bytes], list[tuple[str, str, int]], list[tuple[str, bytes]]]:
    store = SQLiteStore(tmp_path / f"{name}.db")
    spec = ComputationSpec("c", (InputSpec("in"),), ("out",), CodeRef("x:Y"), options)
    if hasattr(code, "bind_outputs"):
        code.bind_outputs(("out",))
    topo = Topology((spec,), (InjectorSpec("i", "in"),))
    worker = RangeWorker(spec, 0, store, code, Router(topo), ManualClock(1_000), CountingSensors())
    keys = sorted({r.key for batch, _ in batches for r in batch})
    for records, watermark in batches:
        worker.commit(worker.process_records(records, watermark))
        fired = worker.fire_timers(watermark)
        if fired is not None:
            worker.commit(fired)
    state = store.read_state("c", keys)
    timers = sorted((t.key, t.tag, t.time) for t in store.read_timers("c", 0))
    outbox = [(p.record.record_id, p.record.value) for p in store.read_outbox("c", 0)]
    store.close()
    return state, timers, outbox


def rec(i: int, key: str, ts: int, value: float = 1.0) -> Record:
    return Record(key, json.dumps(value).encode(), ts, f"r{i}")


def test_windowed_aggregate_batch_hook_matches_the_per_record_path(tmp_path: Path) -> None:
    options = Options(key_ranges=1, late_policy=LatePolicy.DROP, allowed_lateness_us=100)
    params = {"size_us": 100, "aggregation": "sum", "allowed_lateness_us": 100}
    batches = [
        ([rec(1, "a", 10, 2), rec(2, "b", 20, 3), rec(3, "a", 150, 4), rec(4, "a", 30, 5)], 0),
        # late but within lateness, before [0,100) fires at the end of this batch
        ([rec(5, "a", 60, 1), rec(6, "b", 70, 1), rec(7, "a", 120, 2)], 120),
        # "a" 70 updates the fired window (a corrected result at once); "a" 5 is too late
        ([rec(8, "a", 70, 9), rec(9, "b", 180, 1), rec(10, "a", 5, 100)], 160),
        ([], 400),
    ]
    assert records_hook(WindowedAggregate(**params)) is not None  # type: ignore[arg-type]
    assert records_hook(PerRecordSum(**params)) is None  # type: ignore[arg-type]
    batch = run(tmp_path, "batch", WindowedAggregate(**params), batches, options)  # type: ignore[arg-type]
    per_record = run(tmp_path, "per", PerRecordSum(**params), batches, options)  # type: ignore[arg-type]
    assert batch == per_record
    outputs = [json.loads(v) for _, v in batch[2]]
    assert {(o["key"], o["start"], o["value"]) for o in outputs} == {
        ("a", 0, 8.0), ("b", 0, 4.0), ("a", 0, 17.0), ("a", 100, 6.0), ("b", 100, 1.0)}


def test_hook_productions_get_the_per_record_ids_and_lateness(tmp_path: Path) -> None:
    options = Options(key_ranges=1)
    batches = [([Record("a", b"", 10, "x1"), Record("b", b"", 5, "x2"), Record("a", b"", 50, "x3")], 20)]
    assert records_hook(BatchEcho()) is not None and records_hook(Echo()) is None
    batch = run(tmp_path, "batch", BatchEcho(), batches, options)
    per_record = run(tmp_path, "per", Echo(), batches, options)
    assert sorted(batch[2]) == sorted(per_record[2])
    assert len({rid for rid, _ in batch[2]}) == 6
    values = {v for _, v in batch[2]}
    assert b"x1:0:True" in values and b"x3:1:False" in values


@given(st.dictionaries(
    st.integers(-(2**62), 2**62).map(str),
    st.tuples(st.integers(0, 2**40), st.floats(), st.floats(), st.floats(), st.booleans()).map(list),
    max_size=4,
))
def test_aggregate_state_is_the_compact_json_of_its_windows(windows: dict[str, list[object]]) -> None:
    assert _dump(windows) == json.dumps(windows, separators=(",", ":")).encode()
    if all(isfinite(v) for acc in windows.values() for v in acc[1:4]):  # type: ignore[arg-type]
        assert _load(_dump(windows)) == windows


class PerRecordCount(WindowedAggregate):
    def process_record(self, ctx: Context, record: Record) -> None:
        super().process_record(ctx, record)


def test_tumbling_count_whole_batch_path_matches_the_per_record_path(tmp_path: Path) -> None:
    """Counting over a batch's timestamps (no per-record ctx) gives the same state bytes,
    timers and results, late records included (policy process: a closed window is skipped)."""
    options = Options(key_ranges=1, late_policy=LatePolicy.PROCESS)
    params = {"size_us": 100}
    batches = [
        ([rec(1, "a", 10), rec(2, "b", 20), rec(3, "a", 150), rec(4, "a", 30), rec(5, "b", 250)], 0),
        ([rec(6, "a", 60), rec(7, "b", 170), rec(8, "a", 120)], 120),
        ([rec(9, "a", 70), rec(10, "b", 180), rec(11, "a", 205), rec(12, "a", 5)], 160),
        ([], 400),
    ]
    fast = run(tmp_path, "fast", WindowedAggregate(**params), batches, options)  # type: ignore[arg-type]
    slow = run(tmp_path, "slow", PerRecordCount(**params), batches, options)  # type: ignore[arg-type]
    assert fast == slow
    assert {(json.loads(v)["key"], json.loads(v)["start"], json.loads(v)["count"]) for _, v in fast[2]} == {
        ("a", 0, 3), ("b", 0, 1), ("a", 100, 2), ("b", 100, 2), ("a", 200, 1), ("b", 200, 1)}


def test_decoded_windows_are_not_reused_after_a_rollback(tmp_path: Path) -> None:
    """A batch processed, rolled back (not checkpointed) and processed again counts once:
    the operator's decoded windows of the first attempt are not the store's state."""
    store = SQLiteStore(tmp_path / "s.db")
    spec = ComputationSpec("c", (InputSpec("in"),), ("out",), CodeRef("x:Y"), Options(key_ranges=1))
    code = WindowedAggregate(size_us=100)
    code.bind_outputs(("out",))
    worker = RangeWorker(spec, 0, store, code, Router(Topology((spec,), (InjectorSpec("i", "in"),))),
                         ManualClock(1_000), CountingSensors())
    worker.commit(worker.process_records([rec(1, "a", 10)], 0))
    worker.process_records([rec(2, "a", 20)], 0)  # not checkpointed
    worker.rollback()
    worker.commit(worker.process_records([rec(2, "a", 20)], 0))
    assert _load(store.read_state("c", ["a"])["a"]) == {"0": [2, 0.0, 0.0, 0.0, False]}
    store.close()
