"""bench/cases/nexmark_latency.py: which moment an output's latency counts from (the
feeder's tick log and how each query stamps its outputs), on hand-made ticks and on the
queries run in a test pipeline; the summary, the flags, the table and issue 32's rows on
made-up results. No latency is asserted: it is measured in bench/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.cases import nexmark, nexmark_latency
from bench.cases.nexmark_latency import TickLog, complete_at_us, latencies, parse_capacity, same_rows, summary
from bench.report.targets import issue_32_targets, nexmark_latency_rows
from millwheel.nexmark.generate import write
from millwheel.nexmark.generator import GeneratorConfig
from millwheel.nexmark.meta import read_meta
from millwheel.nexmark.queries import QUERIES, render
from millwheel.sources import parse_json_record
from millwheel.spec import topology_from_dict
from millwheel.testing import PipelineTest

S = 1_000_000  # µs
#: Ticks of a feeder: event time sent up to (µs) and the moment (s) of each.
TICKS = TickLog([9_998_000, 9_999_999, 10_000_500, 10_003_000, 12_000_000], [100.0, 100.1, 100.2, 100.3, 102.0])


def test_a_stateless_output_counts_from_the_tick_that_sent_its_event() -> None:
    # a bid stamped 10.000000 s went in the tick that reached 10.0005 s (100.2), not before
    assert complete_at_us("q0", 10 * S) == 10 * S
    assert TICKS.sent_at(10 * S) == 100.2
    assert TICKS.sent_at(9_999_999) == 100.1  # a tick that reached exactly its time sent it
    assert TICKS.sent_at(0) == 100.0
    got = latencies("q0", [(10 * S, 100.35), (9_998_000, 100.05)], TICKS)
    assert [(sent, round(lat, 6)) for sent, lat in got] == [(100.2, 0.15), (100.0, 0.05)]
    # q3's join stamps max(person, auction): the later event's tick, as for q0-q2
    assert [round(lat, 6) for _, lat in latencies("q3", [(10_003_000, 100.5)], TICKS)] == [0.2]


def test_a_window_output_counts_from_the_tick_that_let_the_watermark_pass_its_end() -> None:
    # window [0, 10 s) is stamped end - 1; in order its inputs are complete once the feed
    # sent every event before 10 s and moved its watermark (T + 1) to 10 s: T >= 10 s - 1
    end = 10 * S
    for query in ("q4", "q5", "q7", "q8", "q11"):
        assert complete_at_us(query, end - 1) == end - 1
        assert [round(lat, 6) for _, lat in latencies(query, [(end - 1, 101.0)], TICKS)] == [0.9]  # from 100.1
    # with disorder d the watermark is T + 1 - d: the end is passed once T >= end - 1 + d
    assert complete_at_us("q7", end - 1, 3000) == end + 2999
    assert [round(lat, 6) for _, lat in latencies("q7", [(end - 1, 101.0)], TICKS, 3000)] == [0.7]  # from 100.3
    assert latencies("q7", [(end - 1, 103.0)], TICKS, 5000)[0][0] == 102.0  # the first tick past 10.004999 s


def test_outputs_of_the_warm_up_and_of_the_final_done_are_not_measured() -> None:
    outputs = [(9_998_000, 100.5), (10 * S, 100.5), (12 * S, 102.5), (12 * S + 1, 103.0)]
    # 12 s + 1 µs was never reached by a tick: only `done` closed it
    assert [sent for sent, _ in latencies("q0", outputs, TICKS)] == [100.0, 100.2, 102.0]
    assert [sent for sent, _ in latencies("q0", outputs, TICKS, measure_from=100.2)] == [100.2, 102.0]
    with pytest.raises(ValueError):
        TickLog([1, 2], [1.0])


def test_the_summary_is_nearest_rank_over_the_outputs_and_counts_their_moments() -> None:
    measured = [(100.0, x / 1000) for x in range(1, 101)] + [(101.0, 0.5)]  # 101 outputs from 2 moments
    s = summary(measured)
    assert s["outputs"] == 101 and s["moments"] == 2
    assert (s["p50_ms"], s["p95_ms"], s["max_ms"], s["min_ms"]) == (51.0, 96.0, 500.0, 1.0)
    assert summary([])["p50_ms"] is None and summary([])["outputs"] == 0


def _stamps_explained(query: str, ts: int, row: dict[str, Any], data: dict[str, dict[int, dict[str, Any]]],
                      bids: list[dict[str, Any]]) -> int:
    """Worked out from the row and the events, not from the module: the latest event time an
    output depends on (stateless, join) or its window's end - 1 (windowed)."""
    ten = 10 * S
    if query in ("q0", "q1"):
        return int(row["dateTime"])
    if query == "q2":  # the row keeps no time: a bid at that time on that auction at that price
        assert any(b["dateTime"] == ts and (b["auction"], b["price"]) == (row["auction"], row["price"])
                   for b in bids)
        return ts
    if query == "q3":
        auction = data["auction"][row["id"]]
        return max(int(auction["dateTime"]), int(data["person"][auction["seller"]]["dateTime"]))
    if query == "q4":  # the running mean is stamped with an auction of that category's expires
        assert any(a["expires"] == ts and a["category"] == int(row["key"]) for a in data["auction"].values())
        return ts
    if query == "q5":
        return int(row["end"]) - 1
    if query == "q7":
        return int(row["dateTime"]) - int(row["dateTime"]) % ten + ten - 1
    if query == "q8":
        return int(row["starttime"]) + ten - 1
    assert query == "q11"
    return int(row["endtime"]) - 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("nexmark")
    write(GeneratorConfig(events=3000, rate=100, seed=5), where)
    return where


@pytest.mark.parametrize("query", QUERIES)
def test_each_query_stamps_its_outputs_as_the_latency_assumes(query: str, tiny: Path) -> None:
    meta = read_meta(tiny)
    rows = {t: [parse_json_record(line, t) for line in (tiny / f).read_text().splitlines()]
            for t, f in meta["files"].items()}
    data = {t: {json.loads(r.value)["id"]: json.loads(r.value) for r in rows[t]} for t in ("person", "auction")}
    bids = [json.loads(r.value) for r in rows["bid"]]
    spec = render(query, tiny)
    with PipelineTest(topology_from_dict(spec)) as t:
        for injector in spec["injectors"]:
            t.add(injector["name"], rows[injector["stream"]])
            t.done(injector["name"])
        t.run()
        out = t.output(query)
    assert out, f"{query} gave no output on the tiny data"
    for rec in out:
        row = json.loads(rec.value)
        assert complete_at_us(query, rec.timestamp) == _stamps_explained(query, rec.timestamp, row, data, bids), row


def test_capacity_is_one_figure_or_per_query() -> None:
    assert parse_capacity(None, ("q0",)) == {} and parse_capacity("", ("q0",)) == {}
    assert parse_capacity("20000", ("q0", "q5")) == {"q0": 20000.0, "q5": 20000.0}
    assert parse_capacity("q0=20000, q5=31000.5", ("q0",)) == {"q0": 20000.0, "q5": 31000.5}
    with pytest.raises(ValueError, match="q6"):
        parse_capacity("q6=1", ("q0",))


def test_q4_is_checked_by_each_categorys_final_mean() -> None:
    local = [{"key": "10", "count": 1, "value": 5.0}, {"key": "10", "count": 2, "value": 7.5},
             {"key": "11", "count": 1, "value": 3.0}]
    other_order = [{"key": "10", "count": 1, "value": 10.0}, {"key": "11", "count": 1, "value": 3.0},
                   {"key": "10", "count": 2, "value": 7.5}]
    assert same_rows("q4", other_order, local).ok
    assert not same_rows("q4", other_order[:2], local).ok
    assert not same_rows("q4", [*other_order[:2], {"key": "10", "count": 2, "value": 8.0}], local).ok
    assert not same_rows("q0", other_order, local).ok  # other queries: equal rows


def _result(**per_query: dict[str, Any]) -> dict[str, Any]:
    return {"load_pct": 50.0, "feed_s": 40.0, "warmup_s": 5.0, "watermark_every_s": 0.2, "rounds": 1, "cpus": 2,
            "queries": per_query}


def _query(p50: float, p95: float, ok: bool = True, kind: str = "window") -> dict[str, Any]:
    return {"ok": ok, "capacity_events_per_s": 6000.0, "capacity_measured": True, "output_time": "end - 1",
            "kind": kind, "rate_fed": 3000, "records_per_s": 2760.0, "outputs": 12, "moments": 4,
            "p50_ms": p50, "p95_ms": p95, "max_ms": p95 + 1, "feeder_behind_max_ms": 30.0,
            **({} if ok else {"error": "rows differ"})}


def test_the_table_and_issue_32s_latency_rows_report_without_judging() -> None:
    res = _result(q0=_query(80.0, 200.0, kind="event"), q5=_query(600.0, 1800.0), q8=_query(1.0, 2.0, ok=False))
    table = "\n".join(nexmark_latency.table_lines(res))
    assert "| q0 | 6,000 | 3,000 | 2,760 | 12 | - | 80 | 200 | 201 | 30 |" in table
    assert "| q5 | 6,000 | 3,000 | 2,760 | 12 | 4 | 600 | 1,800 | 1,801 |" in table and "**FAILED**" in table
    p50, p95 = nexmark_latency_rows(res)
    assert (p50["value"], p95["value"]) == (600.0, 1800.0)
    assert p50["met"] is None and p50["bound"] is None and p95["unit"] == "ms"
    assert "q0 80, q5 600; worst q5" in p50["note"] and "no figure for q8" in p50["note"]
    # the suite without the section: issue 32's rows say how to run it
    rows = issue_32_targets({})
    assert len(rows) == 6 and rows[-1]["value"] is None and "--latency" in rows[-1]["note"]
    assert issue_32_targets({"nexmark_latency": [{"result": res}]})[-2]["value"] == 600.0


def test_the_nexmark_case_hands_latency_to_its_mode_and_refuses_bad_flags() -> None:
    with pytest.raises(SystemExit):
        nexmark.main(["--latency", "--queries", "q6"])
    with pytest.raises(SystemExit):
        nexmark.main(["--latency", "--feed-s", "5", "--warmup-s", "5"])
    with pytest.raises(SystemExit):
        nexmark.main(["--latency", "--capacity", "q6=100"])
