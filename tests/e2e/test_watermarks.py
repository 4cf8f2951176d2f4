"""Watermarks through a running pipeline: honest (window results never late
downstream), monotone, and durable across a restart."""

from __future__ import annotations

from pathlib import Path

from millwheel.record import MAX_TIMESTAMP
from millwheel.runtime.crash import CrashSchedule, SimulatedCrash
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sensors import CountingSensors
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import LatePolicy, Options
from tests.support import pipelines

RECORDS = pipelines.workload(n=1500)


def test_window_results_are_never_late_and_watermarks_only_advance(tmp_path: Path) -> None:
    sensors = CountingSensors()
    opts = Options(key_ranges=3, late_policy=LatePolicy.DROP)
    store = SQLiteStore(tmp_path / "s.db")
    runner = LocalRunner(pipelines.topology(opts), store, pipelines.sources(RECORDS), sensors=sensors,
                         batch_size=50, watermark_report_interval_us=0)
    seen: dict[str, list[int]] = {}
    while not runner.finished():
        runner.step()
        for node in ("injector:events", "parse", "counts", "totals"):
            seen.setdefault(node, []).append(runner.watermark(node))
    for node, marks in seen.items():
        assert marks == sorted(marks), f"{node} watermark went backwards"
        assert marks[-1] == MAX_TIMESTAMP
    # downstream never lags behind upstream
    for up, down in (("parse", "counts"), ("counts", "totals")):
        assert all(d <= u for u, d in zip(seen[up], seen[down], strict=True))
    assert not [k for k in sensors.counts if k.startswith("late_")], sensors.counts
    assert sensors.counts["in:totals"] == len(pipelines.outputs(store)["counts"])


def test_watermarks_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    runner = LocalRunner(pipelines.topology(), SQLiteStore(path), pipelines.sources(RECORDS),
                         batch_size=50, watermark_report_interval_us=0, crash=CrashSchedule("after_watermark", 12))
    try:
        runner.run()
    except SimulatedCrash:
        pass
    before = {n: runner.watermark(n) for n in ("parse", "counts", "totals")}
    assert 0 < before["counts"] < MAX_TIMESTAMP
    stored = SQLiteStore(path)
    restarted = LocalRunner(pipelines.topology(), stored, pipelines.sources(RECORDS))
    for node, wm in before.items():
        # the crash came right after a report: the restarted runner starts no lower
        assert min(stored.read_watermarks(node).values()) == wm
        assert restarted.watermark(node) >= wm
