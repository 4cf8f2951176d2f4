"""The bench harness works: its workload is seeded, its expected counts are exact, and
the check catches a wrong answer. (Speed is measured in bench/, never asserted here.)"""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench import pipelines
from bench.run_local import WorkloadArgs, backlog_case
from bench.workload import expected_counts, generate


def test_workload_is_seeded_and_has_late_records() -> None:
    a, b = (generate(3000, keys=50, distribution="zipf", density=50) for _ in range(2))
    assert [(r.key, r.timestamp, r.record_id) for r in a.records] == [
        (r.key, r.timestamp, r.record_id) for r in b.records
    ]
    assert len({r.record_id for r in a.records}) == 3000
    assert 10 <= len(a.late_ids) <= 60  # about 1%
    assert sum(expected_counts(a).values()) == 3000 - len(a.late_ids)


def test_small_run_outputs_exact_counts_and_check_catches_errors(tmp_path: object) -> None:
    for pipeline in pipelines.PIPELINES:
        # 200-record batches span 4 s of event time at 50 records/s: the late records are late
        result = backlog_case(WorkloadArgs(3000, 50, "uniform", density=50), pipeline,
                              f"sqlite:///{tmp_path}/{pipeline}.db", batch_size=200)
        assert result["correct"]["ok"], result["correct"]
        assert result["correct"]["late_dropped"] == result["correct"]["late_expected"] > 0
    w = generate(3000, keys=50, density=50)
    wrong = Counter(expected_counts(w))
    wrong[next(iter(wrong))] += 1
    from bench.workload import check

    assert not check(w, wrong).ok


def test_streamed_growth_workload_replays_and_a_run_is_exact() -> None:
    """bench.cases.growth: the streamed source gives the same records from any cursor (a
    restarted injector replays exactly), and a small run's output is exact."""
    from bench.cases import growth

    src = growth.StreamSource(7, 25_000, 50)
    first = src.read(None, 12_000)
    second = src.read(first.cursor, 12_000)
    whole = [r for r, _late in growth.stream(7, 25_000, 50)]
    assert [r.record_id for r in first.records + second.records] == [r.record_id for r in whole[:24_000]]
    assert first.records[11_000].timestamp == whole[11_000].timestamp
    result = growth.run(60_000, keys=50)
    want, late = growth.expected(7, 60_000, 50)
    assert late > 0 and result["late_dropped"] == late
    assert result["observed"] == want


def test_flink_peer_reports_not_available_cleanly_and_parses_its_io(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.peers.peer_flink without Flink: 'not available' with the reason, never an error;
    its CSV input holds the records (ms event times, IDs) and its sink parser turns
    committed rows into the (key, window start us) counts the check compares, skipping
    in-progress files."""
    from bench.peers import peer_flink
    from bench.workload import WINDOW_US, check

    why = peer_flink.prepare(venv=tmp_path / "no-venv", install=False)
    assert why is not None and "apache-flink not installed" in why
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    why = peer_flink.available(venv=tmp_path / "no-venv", install=False)
    assert why is not None and why.startswith("no Java")
    monkeypatch.undo()
    w = generate(3000, keys=20, density=50)
    rows = peer_flink.write_input(w.records, tmp_path / "in.csv")
    lines = (tmp_path / "in.csv").read_text().splitlines()
    assert rows == len(lines) == 3000
    first = w.records[0]
    assert lines[0] == f"{first.key},{first.timestamp // 1000},{first.record_id}"
    # A sink as Flink writes it: window starts in UTC, committed parts plus an in-progress one.
    sink = tmp_path / "sink"
    sink.mkdir()
    want = expected_counts(w)
    items = sorted(want.items())
    half = len(items) // 2

    def part(chunk: list[tuple[tuple[str, int], int]]) -> str:
        out = []
        for (key, start), n in chunk:
            when = datetime.fromtimestamp(start / 1e6, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
            out.append(f'{key},"{when}",{n}\n')
        return "".join(out)

    (sink / "part-x-0-0").write_text(part(items[:half]))
    (sink / "part-x-1-0").write_text(part(items[half:]))
    (sink / ".part-x-1-1.inprogress.abc").write_text(part(items[:1]))
    observed = peer_flink.read_counts(sink)
    assert all(start % WINDOW_US == 0 for _key, start in observed)
    assert check(w, observed).ok
    (sink / "part-x-1-0").unlink()
    assert not check(w, peer_flink.read_counts(sink)).ok


def test_pathway_peer_reports_not_available_cleanly_and_parses_its_output(tmp_path: Path) -> None:
    from bench.peers import peer_pathway
    from bench.workload import WINDOW_US, check

    why = peer_pathway.available(venv=tmp_path / "no-venv", install=False)
    assert why is not None and "pathway not installed" in why
    w = generate(3000, keys=20, density=50)
    want = expected_counts(w)
    out = tmp_path / "out.json"
    out.write_text(json.dumps([[k, start // 1000, n] for (k, start), n in want.items()]))
    assert check(w, peer_pathway.read_counts(out)).ok
    out.write_text(json.dumps([[k, start // 1000, n + 1] for (k, start), n in want.items()]))
    assert not check(w, peer_pathway.read_counts(out)).ok
    # Pathway's lagging lateness: extra late records are allowed by late_allowance, a lost
    # or extra on-time record is not.
    late = next(r for r in w.records if r.record_id in w.late_ids)
    window = (late.key, late.timestamp - late.timestamp % WINDOW_US)
    with_late = Counter(want)
    with_late[window] += 1
    assert not check(w, with_late).ok
    assert peer_pathway.late_allowance(w, with_late) == {
        "on_time_exact": True, "late_counted": 1, "windows_outside_allowance": 0}
    missing = Counter(want)
    missing[next(iter(missing))] -= 1
    assert not peer_pathway.late_allowance(w, missing)["on_time_exact"]


def test_report_computes_the_issue_14_targets_from_a_run() -> None:
    """The targets table reads the figures of the right cases (store, size) and only
    exact runs count for the growth ratio."""
    from bench.report.targets import ratios_and_targets

    def tp(pipeline: str, store: str, rate: float) -> dict[str, object]:
        return {"pipeline": pipeline, "workload": "uniform-1k", "store": store, "config": "eo-strong",
                "result": {"records_per_s": rate, "correct": {"ok": True}}}

    def growth(n: int, rate: float, ok: bool = True) -> dict[str, object]:
        return {"figure": "growth", "records": n, "result": {"records_per_s": rate, "correct": {"ok": ok}}}

    res = {
        "throughput": [tp("single", "sqlite", 100_000.0), tp("single", "redis-aof", 40_000.0),
                       tp("three", "sqlite", 30_000.0)],
        "limits": [], "peer": [], "latency": [], "recovery": [], "ha": [],
        "service": [{"figure": "backlog", "store": "sqlite",
                     "result": {"records_per_s": 18_000.0, "correct": {"ok": True}}}],
        "long": [growth(100_000, 80_000.0), growth(1_000_000, 76_000.0), growth(10_000_000, 1.0, ok=False)],
    }
    _ratios, targets = ratios_and_targets(res)
    redis = next(t for t in targets if "Redis AOF >= 0.5x SQLite" in t["target"])
    assert redis["value"] == 0.4 and redis["met"] is False
    service = next(t for t in targets if "service (up --workers 2) >= 0.5x local" in t["target"])
    assert service["value"] == 0.6 and service["met"] is True
    long = next(t for t in targets if t["target"].startswith("long run"))
    assert long["value"] == 0.95 and long["met"] is True  # the wrong 10M run does not count


def test_report_has_the_issue_24_rows_under_their_names() -> None:
    """The five rows issue 24 names are in the targets table, each with its bound and
    met/unmet from the run's figures (unknown when a section did not run)."""
    from bench.report.targets import ratios_and_targets

    def tp(pipeline: str, store: str, rate: float) -> dict[str, object]:
        return {"pipeline": pipeline, "workload": "uniform-1k", "store": store, "config": "eo-strong",
                "result": {"records_per_s": rate, "correct": {"ok": True}}}

    def lat(store: str, p95: float) -> dict[str, object]:
        return {"pipeline": "single", "store": store, "load_pct": 50,
                "result": {"record_latency_ms": {"p50": 1.0, "p95": p95}, "watermark_lag_added_ms": {}}}

    soak_rows = [{"target": f"soak: row {i}", "value": 1.0, "bound": 2.0, "unit": "", "met": i != 2} for i in range(3)]
    res = {
        "throughput": [tp("single", "sqlite", 100_000.0), tp("three", "sqlite", 30_000.0)],
        "limits": [], "latency": [lat("sqlite", 12.0), lat("redis-aof", 25.0)], "recovery": [], "ha": [],
        "peer": [{"peer": "millwheel-single-sqlite-eo-strong", "workload": "uniform-1k",
                  "result": {"records_per_s": 70_000.0}},
                 {"peer": "flink", "workload": "uniform-1k", "result": {"records_per_s": 50_000.0}}],
        "service": [{"figure": "backlog", "store": "sqlite",
                     "result": {"records_per_s": 18_000.0, "correct": {"ok": True}}}],
        "long": [], "soak": [{"result": {"targets": soak_rows}}],
    }
    rows = {t["target"]: t for t in ratios_and_targets(res)[1]}
    got = {name: (rows[name]["value"], rows[name]["bound"], rows[name]["met"]) for name in (
        "service >= 0.8x local", "Flink SQL >= 1.3x (default settings)", "SQLite p95 <= 20 ms",
        "Redis p95 <= 20 ms", "soak")}
    assert got == {"service >= 0.8x local": (0.6, 0.8, False),
                   "Flink SQL >= 1.3x (default settings)": (1.4, 1.3, True),
                   "SQLite p95 <= 20 ms": (12.0, 20.0, True), "Redis p95 <= 20 ms": (25.0, 20.0, False),
                   "soak": (1, 0, False)}
    res["soak"] = []
    assert {t["target"]: t for t in ratios_and_targets(res)[1]}["soak"]["met"] is None  # not run: unknown
