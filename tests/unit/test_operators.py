"""Built-in operators through the local runner, checked against a direct computation."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from millwheel.errors import InvalidSpecError, UserCodeError
from millwheel.record import Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sources import ListSource
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import (
    CodeRef,
    ComputationSpec,
    ErrorPolicy,
    InjectorSpec,
    InputSpec,
    LatePolicy,
    Options,
    Topology,
)

S = 1_000_000


def run(tmp_path: Path, code: CodeRef, records: list[Record], options: Options | None = None,
        disorder: int = 0, outputs: tuple[str, ...] = ("out",)) -> dict[str, list[Record]]:
    topo = Topology(
        (ComputationSpec("op", (InputSpec("in"),), outputs, code, options or Options(key_ranges=2)),),
        (InjectorSpec("src", "in"),),
    )
    store = SQLiteStore(tmp_path / "s.db")
    LocalRunner(topo, store, {"src": ListSource(records, disorder)}, batch_size=7).run()
    return {s: [r for _seq, r in store.read_log(s, 0, 10**6)] for s in topo.sink_streams()}


def values(n: int) -> list[Record]:
    return [Record(f"k{i % 3}", json.dumps({"x": i}).encode(), i * S, f"r{i}") for i in range(n)]


@pytest.mark.parametrize("agg", ["count", "sum", "min", "max", "mean"])
def test_tumbling_aggregations_match_a_direct_computation(tmp_path: Path, agg: str) -> None:
    records = values(100)
    out = run(tmp_path, CodeRef("window_aggregate", {"size_us": 10 * S, "aggregation": agg, "field": "x"}), records)
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for r in records:
        groups[(r.key, r.timestamp // (10 * S) * 10 * S)].append(json.loads(r.value)["x"])
    fns = {"count": len, "sum": sum, "min": min, "max": max, "mean": lambda xs: sum(xs) / len(xs)}
    expected = {k: fns[agg](xs) for k, xs in groups.items()}
    got = {(r.key, json.loads(r.value)["start"]): json.loads(r.value)["value"] for r in out["out"]}
    assert got == pytest.approx(expected)
    assert all(r.timestamp == json.loads(r.value)["end"] - 1 for r in out["out"])


def test_sliding_windows_count_each_record_in_every_window(tmp_path: Path) -> None:
    records = values(60)
    out = run(tmp_path, CodeRef("window_aggregate", {"size_us": 20 * S, "period_us": 5 * S}), records)
    total = sum(json.loads(r.value)["value"] for r in out["out"])
    assert total == 60 * 4  # every record lies in size/period = 4 windows
    assert len({(r.key, json.loads(r.value)["start"]) for r in out["out"]}) == len(out["out"])


def test_late_records_within_allowed_lateness_update_the_window(tmp_path: Path) -> None:
    on_time = [Record("k", b"1", t * S, f"a{t}") for t in range(0, 30)]
    late = Record("k", b"1", 3 * S, "late-1")  # window [0,10) already fired when it arrives
    beyond = Record("k", b"1", 1 * S, "late-2")
    records = [*on_time[:25], late, *on_time[25:], beyond]
    # injector watermark = max seen - 0: by record 25 the watermark is at 24 s
    opts = Options(key_ranges=1, allowed_lateness_us=22 * S, late_policy=LatePolicy.ROUTE, late_stream="late")
    out = run(tmp_path, CodeRef("window_aggregate", {"size_us": 10 * S}), records, opts,
              outputs=("out",))
    first = [json.loads(r.value) for r in out["out"] if json.loads(r.value)["start"] == 0]
    assert [w["value"] for w in first] == [10, 11]  # on-time result, then the corrected one
    assert [r.record_id for r in out["late"]] != [] and len(out["late"]) == 1  # 1 s is beyond lateness


def test_filter_and_map_by_expression(tmp_path: Path) -> None:
    out = run(tmp_path, CodeRef("filter", {"expr": "json['x'] % 2 == 0 and key != 'k1'"}), values(30))
    assert sorted(json.loads(r.value)["x"] for r in out["out"]) == [x for x in range(30) if x % 2 == 0 and x % 3 != 1]
    out2 = run(tmp_path / "m", CodeRef("map", {"key": "'user-' + str(json['x'] % 2)", "value": "json['x'] * 10"}),
               values(10))
    assert sorted((r.key, int(r.value)) for r in out2["out"]) == sorted((f"user-{x % 2}", x * 10) for x in range(10))


def test_bad_operator_specs_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(InvalidSpecError, match="unknown built-in operator 'windw'"):
        run(tmp_path, CodeRef("windw", {}), values(1))
    with pytest.raises(InvalidSpecError, match=r"params\.aggregation: 'mode' is not one of"):
        run(tmp_path, CodeRef("window_aggregate", {"size_us": 1, "aggregation": "mode"}), values(1))
    with pytest.raises(InvalidSpecError, match="syntax error"):
        run(tmp_path, CodeRef("filter", {"expr": "json[["}), values(1))
    with pytest.raises(InvalidSpecError, match="cannot import"):
        run(tmp_path, CodeRef("nosuch.module:Thing", {}), values(1))


def test_a_failing_expression_names_the_record(tmp_path: Path) -> None:
    with pytest.raises(UserCodeError, match="record r0"):  # on_error fail: the run stops
        run(tmp_path, CodeRef("filter", {"expr": "json['missing'] > 1"}), values(1),
            Options(key_ranges=2, on_error=ErrorPolicy.FAIL))
    out = run(tmp_path / "dl", CodeRef("filter", {"expr": "json['missing'] > 1"}), values(1))
    [letter] = [json.loads(r.value) for r in out["op.dead_letters"]]  # the default: dead letter
    # the expression's own error, as Python code would raise it (not an invalid spec)
    assert (letter["record_id"], letter["exception_type"]) == ("r0", "KeyError")
    assert "json['missing'] > 1" in letter["message"]
