"""Exact percentile, median, count_distinct and top_k: the Spark stage (real PySpark,
local mode, the process's one session) and the in-process window_aggregate give the
same results, and both equal a plain-Python reference computed from the records."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from millwheel.record import Record
from millwheel.topology import InjectorSpec, LatePolicy, Options, Topology
from millwheel.windows import Windowing
from tests.integration.test_spark_stage import final_windows, log_values, run, stage

S = 1_000_000

AGGS: dict[str, dict[str, Any]] = {
    "p90": {"aggregation": "percentile", "p": 90, "field": "x"},
    "p37": {"aggregation": "percentile", "p": 37.5, "field": "x"},
    "p100": {"aggregation": "percentile", "p": 100, "field": "x"},
    "median": {"aggregation": "median", "field": "x"},
    "distinct": {"aggregation": "count_distinct", "field": "user"},
    "top": {"aggregation": "top_k", "k": 3, "field": "term"},
    "topby": {"aggregation": "top_k", "k": 2, "field": "term", "by": "x"},
}


def reference(name: str, values: list[dict[str, Any]]) -> Any:
    """Each aggregation written out plainly, from the parsed record values."""
    if name in ("p90", "p37", "p100", "median"):
        p = {"p90": 90, "p37": 37.5, "p100": 100, "median": 50}[name]
        xs = sorted(float(v["x"]) for v in values)
        pos = (len(xs) - 1) * p / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    if name == "distinct":
        return len({json.dumps(v["user"]) for v in values})
    if name == "top":
        counts = Counter(v["term"] for v in values)
        return [[t, n] for t, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
    pairs = sorted(((v["term"], float(v["x"])) for v in values), key=lambda p: (-p[1], p[0]))[:2]
    return [[t, x] for t, x in pairs]


LATE_AGGS = ("p37", "distinct", "topby")  # fewer stages where every record is its own batch


def check_against_reference(store: Any, records: list[Record], windowing: Windowing,
                            names: tuple[str, ...] = tuple(AGGS)) -> None:
    expect: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        for start in windowing.assign(r.timestamp):
            expect.setdefault((r.key, start), []).append(json.loads(r.value))
    for name in names:
        ip, sp = final_windows(store, f"ip_{name}"), final_windows(store, f"sp_{name}")
        assert sorted(sp) == sorted(ip) == sorted(expect), name
        for k, vals in expect.items():
            assert sp[k] == ip[k], (name, k)  # the same JSON result, field by field
            assert sp[k]["count"] == len(vals)
            want = reference(name, vals)
            if name in ("p90", "p37", "p100", "median"):
                assert sp[k]["value"] == pytest.approx(want, rel=1e-12, abs=1e-12), (name, k)
            else:
                assert sp[k]["value"] == want, (name, k)


def topology(window: dict[str, Any], opts: Options, names: tuple[str, ...] = tuple(AGGS)) -> Topology:
    comps = []
    for name in names:
        params = AGGS[name]
        comps.append(stage(f"ip_{name}", "window_aggregate", {**window, **params}, opts))
        comps.append(stage(f"sp_{name}", "spark_aggregate", {**window, **params}, opts))
    return Topology(tuple(comps), (InjectorSpec("in", "in"),))


def value(rnd: random.Random) -> bytes:
    return json.dumps({"x": round(rnd.uniform(-100, 100), rnd.choice((0, 3, 6))),
                       "user": rnd.choice([1, 2, 2.5, "u1", "u2", "u3", None]),
                       "term": rnd.choice("abcdefg") * rnd.randint(1, 2)}).encode()


def test_holistic_aggregations_match_each_other_and_the_reference(tmp_path: Path) -> None:
    rnd = random.Random(11)
    records = [Record(f"k{i % 3}", value(rnd), i * S // 3, f"r{i}") for i in range(240)]
    window = {"size_us": 20 * S, "period_us": 10 * S}
    store, runner = run(topology(window, Options(key_ranges=2)), records, tmp_path / "h.db", batch_size=120)
    assert runner.finished()
    check_against_reference(store, records, Windowing(20 * S, 10 * S))


def test_late_records_within_lateness_correct_the_window_and_beyond_it_are_routed(tmp_path: Path) -> None:
    opts = Options(key_ranges=1, allowed_lateness_us=20 * S, late_policy=LatePolicy.ROUTE, late_stream="late")
    rnd = random.Random(5)
    ts = [1, 2, 15, 5, 26, 7, 45, 3, 60, 50, 8, 75]  # 5, 7 late within 20 s; 3, 8 too late
    records = [Record("a", value(rnd), t * S, f"r{i}") for i, t in enumerate(ts)]
    store, runner = run(topology({"size_us": 10 * S}, opts, LATE_AGGS), records, tmp_path / "late.db",
                         batch_size=1)
    too_late = {"r7", "r10"}
    check_against_reference(store, [r for r in records if r.record_id not in too_late], Windowing(10 * S),
                            LATE_AGGS)
    for name in LATE_AGGS:
        for prefix in ("ip", "sp"):
            first = [v["count"] for v in log_values(store, f"{prefix}_{name}") if v["start"] == 0]
            assert first[0] == 2 and first[-1] == 4, (prefix, name)  # on time, then corrected
    routed = Counter(r.timestamp for _s, r in store.read_log("late", 0, 10**6))
    assert routed == {3 * S: 2 * len(LATE_AGGS), 8 * S: 2 * len(LATE_AGGS)}  # once per computation
    assert runner.finished()


def test_late_records_beyond_lateness_dropped_with_drop_policy(tmp_path: Path) -> None:
    opts = Options(key_ranges=1, late_policy=LatePolicy.DROP)
    rnd = random.Random(9)
    records = [Record("a", value(rnd), t * S, f"r{i}") for i, t in enumerate([1, 12, 4, 25, 3, 27])]
    store, _ = run(topology({"size_us": 10 * S}, opts, LATE_AGGS), records, tmp_path / "drop.db", batch_size=1)
    check_against_reference(store, [r for r in records if r.record_id not in ("r2", "r4")], Windowing(10 * S),
                            LATE_AGGS)
