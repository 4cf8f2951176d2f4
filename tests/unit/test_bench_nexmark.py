"""bench/cases/nexmark.py: its arguments, its summary and table, its target rows, on a
tiny run and on made-up runs. No timing is asserted: speed is measured in bench/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.cases import nexmark
from bench.report.targets import issue_32_targets, nexmark_target_rows


def test_a_tiny_local_run_gives_a_row_per_query_and_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "n.json"
    md = tmp_path / "n.md"
    rc = nexmark.main(["--events", "2000", "--queries", "q1,q2", "--rounds", "1", "--no-flink",
                       "--service-queries", "", "--empty-events", "100", "--json-out", str(out), "--md-out", str(md)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert list(res["queries"]) == ["q1", "q2"] and res["flink"] is False
    q1 = res["queries"]["q1"]
    assert q1["ok"] and q1["local"]["runs"] == 1 and q1["local"]["per_core"] > 0
    assert q1["published_per_core"] == 157_900 and q1["local_over_flink"] is None
    # every run: an empty one per query, then the round; rows are not kept in the JSON
    assert [(r["round"], r["query"], r["system"]) for r in res["runs"]] == [
        (0, "q1", "local"), (0, "q2", "local"), (1, "q1", "local"), (1, "q2", "local")]
    assert all("values" not in r for r in res["runs"])
    assert res["runs"][2]["output_rows"] == res["counts"]["bid"]  # q1 maps every bid
    table = md.read_text()
    assert "| q1 |" in table and "consistent (no Flink run)" in table and "not measured here" in table
    assert "every query's output equals Flink SQL's" in table  # issue 32's rows follow
    assert "| q1 |" in capsys.readouterr().out


def test_unknown_queries_and_bad_sizes_are_refused() -> None:
    with pytest.raises(SystemExit):
        nexmark.main(["--queries", "q6"])
    with pytest.raises(SystemExit):
        nexmark.main(["--events", "100", "--empty-events", "100"])


def _run(system: str, query: str, cpu: float, ok: bool = True, round_no: int = 1) -> dict[str, Any]:
    r: dict[str, Any] = {"system": system, "query": query, "round": round_no, "cpu_s": cpu, "wall_s": cpu}
    if round_no:
        r["check"] = {"ok": ok, "detail": "equal (5 rows)" if ok else "differs: 5 rows vs Flink's 6"}
    return r


def _result(runs: list[dict[str, Any]], queries: tuple[str, ...], events: int = 101_000) -> dict[str, Any]:
    empty = {(r["system"], r["query"]): r["cpu_s"] for r in runs if r["round"] == 0}
    return {"events": events, "rate": 10_000, "seed": 32, "rounds": 1, "cpus": 2, "flink": True,
            "event_time_s": 10.0, "counts": {"person": 1, "auction": 3, "bid": 46},
            "queries": {q: nexmark.summarize(q, [r for r in runs if r["query"] == q], empty, events, 1000)
                        for q in queries}}


def test_figures_are_start_up_removed_and_a_wrong_query_gives_none() -> None:
    runs = [_run("local", "q5", 1.0, round_no=0), _run("flink", "q5", 10.0, round_no=0),
            _run("local", "q5", 3.0), _run("flink", "q5", 15.0), _run("service", "q5", 4.0),
            _run("local", "q8", 1.0, round_no=0), _run("flink", "q8", 10.0, round_no=0),
            _run("local", "q8", 2.0, ok=False), _run("flink", "q8", 12.0, ok=False)]
    res = _result(runs, ("q5", "q8"))
    q5, q8 = res["queries"]["q5"], res["queries"]["q8"]
    assert q5["local"]["per_core"] == pytest.approx(100_000 / 2.0)  # (events - empty) / (CPU - empty CPU)
    assert q5["flink"]["per_core"] == pytest.approx(100_000 / 5.0)
    assert q5["local"]["per_core_raw"] == pytest.approx(101_000 / 3.0)
    assert q5["local_over_flink"] == pytest.approx(2.5)
    assert q5["service"]["per_core"] == pytest.approx(101_000 / 4.0)  # no empty run of its own here
    assert q5["service_cpu_ratio"] == pytest.approx(round((100_000 / 2.0) / (101_000 / 4.0), 3))
    assert not q8["ok"] and q8["local"]["per_core"] is None and q8["local_over_flink"] is None
    table = "\n".join(nexmark.table_lines(res))
    assert "**WRONG**" in table and "| q8 | - |" in table

    rows = {t["target"]: t for t in nexmark_target_rows(res)}
    same = rows["every query's output equals Flink SQL's"]
    assert same["value"] == 1 and same["met"] is None  # shown, judged only at >= 10M events
    assert rows["local per core >= Flink 1.13 published on q5, q7, q8"]["value"] is None  # q7 not run, q8 wrong
    assert rows["local per core >= 1.0x PyFlink (measured here) on every query"]["value"] is None
    service = rows["service CPU per event <= 1.5x local on q5 and q8"]
    assert service["value"] is None and "q8" in service["note"]


def test_issue_32_rows_say_why_there_is_no_figure() -> None:
    rows = issue_32_targets({})  # four rows of the per-core section, two of the latency one
    assert len(rows) == 6 and all(r["value"] is None and r["met"] is None for r in rows)
    assert all("not run" in r["note"] for r in rows)
    failed = issue_32_targets({"nexmark": [{"error": "RuntimeError: boom"}]})
    assert all("boom" in r["note"] for r in failed[:4])


def test_the_chart_is_a_png(tmp_path: Path) -> None:
    runs = [_run("local", "q5", 1.0, round_no=0), _run("flink", "q5", 10.0, round_no=0),
            _run("local", "q5", 3.0), _run("flink", "q5", 15.0)]
    res = _result(runs, ("q5",))
    nexmark.chart(res, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_per_core_rows_are_judged_only_from_200k_events() -> None:
    runs = [_run("local", q, 1.0, round_no=0) for q in ("q5", "q7", "q8")] + \
           [_run("local", q, 3.0) for q in ("q5", "q7", "q8")]
    for events, judged in ((101_000, False), (300_000, True)):
        rows = {t["target"]: t for t in nexmark_target_rows(_result(runs, ("q5", "q7", "q8"), events))}
        published = rows["local per core >= Flink 1.13 published on q5, q7, q8"]
        assert published["value"] is not None
        assert (published["met"] is not None) == judged
        assert ("not judged" in published["note"]) != judged
