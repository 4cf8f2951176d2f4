"""Late records counted per input stream and per action (issue 33, "Late data visible"):
the range worker counts each record behind the input watermark under the stream it came
on, durably; the error policy's isolation counts each once; ``millwheel run``'s local
runner hands each input's records over as its own batch; the service's batches name
their streams (services/worker/delivery.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from millwheel import late
from millwheel.clock import ManualClock
from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.runtime import poison
from millwheel.runtime.local_runner import LocalRunner
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router
from millwheel.sensors import CountingSensors
from millwheel.sources import ListSource
from millwheel.state.protocol import Production
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology
from services.generated import millwheel_pb2 as pb
from services.worker import delivery
from tests.support.faulty import Doubler, Flaky

S = 1_000_000


def two_inputs(**options: object) -> Topology:
    opts = Options(key_ranges=2, **options)  # type: ignore[arg-type]
    return Topology(
        (ComputationSpec("calc", (InputSpec("clicks", KeyExtractor("key")), InputSpec("views", KeyExtractor("key"))),
                         ("doubled",), CodeRef("tests.support.faulty:Doubler"), opts),),
        (InjectorSpec("c", "clicks"), InjectorSpec("v", "views")),
    )


def rec(i: int, ts: int, key: str = "k") -> Record:
    return Record(key, json.dumps({"amount": i}).encode(), ts, f"r{i}")


def counters(store: SQLiteStore, ranges: int = 2) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in range(ranges):
        for name, n in store.read_errors("calc", r).counters.items():
            out[name] = out.get(name, 0) + n
    return out


def worker(store: SQLiteStore, code: object, **options: object) -> tuple[RangeWorker, CountingSensors]:
    topo = two_inputs(**options)
    spec = topo.computations[0]
    spec = ComputationSpec(spec.name, spec.inputs, spec.outputs, spec.code,
                           Options(key_ranges=1, **options))  # type: ignore[arg-type]
    sensors = CountingSensors()
    return RangeWorker(spec, 0, store, code, Router(topo), ManualClock(1_000), sensors), sensors  # type: ignore[arg-type]


@pytest.mark.parametrize("policy,lateness,expect", [
    # ts 150 on time; 80 late within allowed lateness 30 (handed to user code); 50 beyond it
    (LatePolicy.PROCESS, 0, {"late:processed:clicks": 2}),
    (LatePolicy.DROP, 30, {"late:processed:clicks": 1, "late:dropped:clicks": 1, "late_dropped": 1}),
    (LatePolicy.ROUTE, 30, {"late:processed:clicks": 1, "late:routed:clicks": 1}),
])
def test_late_records_are_counted_under_their_input_and_what_became_of_them(
        tmp_path: Path, policy: LatePolicy, lateness: int, expect: dict[str, int]) -> None:
    store = SQLiteStore(tmp_path / "a.db")
    late_stream = {"late_stream": "late"} if policy is LatePolicy.ROUTE else {}
    rw, sensors = worker(store, Doubler(), late_policy=policy, allowed_lateness_us=lateness, **late_stream)
    rw.commit(rw.process_records([rec(1, 150), rec(2, 80), rec(3, 50)], 100, "clicks"))
    rw.commit(rw.process_records([rec(4, 100), rec(5, 120)], 100, "views"))  # on time (not below it)
    assert counters(store, 1) == expect
    per_input = {late.parse(k): n for k, n in expect.items() if k != "late_dropped"}
    assert dict(sensors.late) == {("calc", s, late.SENSOR_ACTION[a]): n for (s, a), n in per_input.items()}
    assert sensors.counts["late_process:calc"] == expect["late:processed:clicks"]  # the series as before


def test_an_isolated_batch_counts_each_late_record_once(tmp_path: Path) -> None:
    """A failing record makes the policy run the batch again without it, then it alone:
    the runs that raised count nothing, the ones checkpointed count theirs."""
    Flaky.runs.clear()
    store = SQLiteStore(tmp_path / "a.db")
    rw, _ = worker(store, Flaky(["r2"], failures=1))
    records = [rec(1, 10), rec(2, 20), rec(3, 30), rec(4, 500)]  # three late at watermark 100
    poison.process_batch(rw, records, 100, rw.commit, "views")
    assert Flaky.runs["r2"] == 2
    assert counters(store, 1) == {"late:processed:views": 3}


@pytest.mark.parametrize("policy,lateness,expect", [
    (LatePolicy.DROP, 10 * S, {("clicks", "dropped"): 3, ("clicks", "processed"): 2}),
    (LatePolicy.PROCESS, 0, {("clicks", "processed"): 5}),
])
def test_a_local_run_counts_late_records_per_input_only_on_the_late_one(
        tmp_path: Path, policy: LatePolicy, lateness: int, expect: dict[tuple[str, str], int]) -> None:
    """Two inputs; only clicks has records read after its watermark passed them:
    three far behind it, two within 10 s of it."""
    on_time = [rec(i, i * S, f"k{i % 4}") for i in range(40)]
    behind = [rec(100 + i, 0, f"k{i}") for i in range(3)] + [rec(200 + i, 35 * S, f"k{i}") for i in range(2)]
    views = [Record(f"k{i % 4}", json.dumps({"amount": i}).encode(), i * S, f"v{i}") for i in range(40)]
    store = SQLiteStore(tmp_path / "a.db")
    sensors = CountingSensors()
    LocalRunner(two_inputs(late_policy=policy, allowed_lateness_us=lateness), store,
                {"c": ListSource([*on_time, *behind]), "v": ListSource(views)}, sensors=sensors,
                batch_size=40).run()
    assert late.summed([counters(store)]) == expect
    assert {(i, a): n for (_c, i, a), n in sensors.late.items()} == {
        (i, late.SENSOR_ACTION[a]): n for (i, a), n in expect.items()}
    dropped = expect.get(("clicks", "dropped"), 0)
    assert counters(store).get("late_dropped", 0) == dropped
    assert len(store.read_log("doubled", 0, 10**6)) == 80 + 5 - dropped
    assert late.describe(late.summed([counters(store)]), ["clicks", "views"]) == [
        "clicks " + ", ".join(f"{n} {a}" for a in late.ACTIONS if (n := expect.get(("clicks", a)))), "views 0 late"]


def test_counter_names_parse_back_and_refuse_what_is_not_one() -> None:
    assert late.parse(late.counter("dropped", "clicks:eu")) == ("clicks:eu", "dropped")
    assert late.parse(late.counter("processed", "")) == ("", "processed")
    for name in ("late_dropped", "late:eaten:clicks", "late:dropped", "late:dropped:a b", "late:routed:" + "x" * 201):
        assert late.parse(name) is None, name
    assert late.summed([{"late:dropped:a": 2, "skipped": 1}, {"late:dropped:a": 3, "late:processed:": 1}]) == {
        ("a", "dropped"): 5, ("", "processed"): 1}
    assert late.describe({("", "processed"): 1, ("a", "routed"): 2}, ["b"]) == [
        "b 0 late", "(replay) 1 processed", "a 2 routed"]


def production(stream: str, i: int) -> Production:
    return Production("calc", stream, rec(i, i))


def test_a_batch_names_its_streams_and_nothing_per_record_when_there_is_one() -> None:
    one = delivery.batch("p", "calc", 0, [production("clicks", i) for i in range(3)], 1)
    assert (list(one.streams), list(one.stream_of)) == (["clicks"], [])
    mixed = [production("clicks", 0), production("views", 1), production("clicks", 2)]
    two = delivery.batch("p", "calc", 0, mixed, 1)
    assert (list(two.streams), list(two.stream_of)) == (["clicks", "views"], [0, 1, 0])
    assert pb.DeliverBatch.FromString(two.SerializeToString()) == two
    assert delivery.inputs([]) == ([], [])


def test_the_receiver_splits_a_batch_per_input_and_trusts_no_unknown_stream() -> None:
    records = [rec(i, i) for i in range(5)]
    known = {"clicks", "views"}
    split = delivery.Inputs(records, ["clicks", "views"], [0, 1, 0, 1, 1], known).split(records)
    assert [(s, [r.record_id for r in part]) for s, part in split] == [
        ("clicks", ["r0", "r2"]), ("views", ["r1", "r3", "r4"])]
    assert delivery.Inputs(records, ["clicks"], [], known).split(records[1:3]) == [("clicks", records[1:3])]
    assert delivery.Inputs(records, [], [], known).split(records) == [("", records)]  # an older sender
    assert delivery.Inputs(records, ["nope"], [], known).split(records) == [("", records)]
    for bad in ([0, 1], [0, 0, 0, 0, 2]):  # the wrong length, an index past the streams
        assert delivery.Inputs(records, ["clicks", "views"], bad, known).split(records) == [("", records)]
