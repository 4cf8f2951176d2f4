"""The soak's conclusions from its series (bench/cases/soak_series.py) and its workload
(bench/cases/soak.py), on synthetic series: the growth over the final window, the
target rows, the exact-output check. No service is started and nothing is timed."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from bench.cases import soak_series as ss
from bench.cases.soak import Feed, Plan, compare, topology
from bench.workload import DISORDER_US, WINDOW_US


def series(minutes: int, **columns: object) -> list[dict[str, object]]:
    """One sample a minute; each column a function of the minute."""
    return [{"t_min": float(m), **{k: f(m) for k, f in columns.items()}}  # type: ignore[operator]
            for m in range(minutes + 1)]


def test_the_window_is_the_last_20_minutes_or_two_thirds_of_a_shorter_run() -> None:
    assert ss.window_s(30 * 60) == 20 * 60
    assert ss.window_s(120 * 60) == 20 * 60
    assert ss.window_s(15 * 60) == 10 * 60


def test_growth_is_measured_on_the_final_window_only() -> None:
    # warm-up doubles the value in 10 minutes, then +1 MB a minute from 100 MB
    s = series(30, **{"rss_mb.worker0": lambda m: 50 + 5 * m if m <= 10 else 100 + (m - 10)})
    ts, ys = ss.tail(s, "rss_mb.worker0", ss.window_s(30 * 60))
    assert ts[0] == 10 * 60 and ts[-1] == 30 * 60 and len(ts) == 21
    assert ss.growth_pct(ts, ys) == pytest.approx(20.0)  # 100 -> 120 MB


def test_one_spike_does_not_decide_the_growth() -> None:
    # flat at 80 MB with the last sample at 92 MB: +15% end to end, the fitted line far less
    s = series(30, **{"rss_mb.worker0": lambda m: 92.0 if m == 30 else 80.0})
    ts, ys = ss.tail(s, "rss_mb.worker0", ss.window_s(30 * 60))
    assert (ys[-1] - ys[0]) / ys[0] > 0.1
    g = ss.growth_pct(ts, ys)
    assert g is not None and 0 < g < 10


def test_growth_needs_three_samples_and_a_positive_start() -> None:
    assert ss.growth_pct([0.0, 60.0], [1.0, 2.0]) is None
    assert ss.growth_pct([0.0, 60.0, 120.0], [0.0, 0.0, 0.0]) is None
    assert ss.growth_pct([0.0, 60.0, 120.0], [10.0, 10.0, 10.0]) == 0.0


def test_targets_flat_service_meets_every_row() -> None:
    s = series(30, **{"rss_mb.controller": lambda m: 58.0, "rss_mb.worker0": lambda m: 60 + math.sin(m),
                      "store_mb.db": lambda m: 100.0 + m % 3, "store_mb.wal": lambda m: 20.0 - m % 3,
                      "store_mb.total": lambda m: 120.0, "lag_s.mean": lambda m: 2.0 + 0.1 * (m % 2)})
    correct = compare(Counter({("a", 0): 2}), Counter({("a", 0): 2}))
    rows = ss.targets(s, 30 * 60, correct)
    assert [r["met"] for r in rows] == [True, True, True, True], rows
    assert all(r["target"].startswith("soak: ") for r in rows)
    assert "over the last 20 min of 30" in rows[0]["target"]


def test_targets_catch_growing_memory_store_and_lag_and_wrong_output() -> None:
    s = series(30, **{"rss_mb.controller": lambda m: 58.0, "rss_mb.worker1": lambda m: 60 + m,
                      "store_mb.total": lambda m: 100 + 2 * m, "lag_s.mean": lambda m: 2.0 + 0.5 * m})
    correct = compare(Counter({("a", 0): 2, ("b", 0): 1}), Counter({("a", 0): 3}))
    rss, store, lag, output = ss.targets(s, 30 * 60, correct)
    assert rss["met"] is False and rss["value"] == pytest.approx(100 * 20 / 70)  # 70 -> 90 MB
    assert "worker1 +28.6%" in rss["detail"] and "controller +0.0%" in rss["detail"]
    assert store["met"] is False and store["value"] == pytest.approx(100 * 40 / 120)
    assert lag["met"] is False and lag["value"] == pytest.approx(10.0)
    assert output["met"] is False and output["value"] == 2


def test_the_store_is_judged_by_its_total_not_by_file_and_wal_apart() -> None:
    # a checkpoint moves bytes from the WAL into the file: the total is what grows or not
    s = series(30, **{"store_mb.db": lambda m: 100.0 + m, "store_mb.wal": lambda m: 50.0 - m,
                      "store_mb.total": lambda m: 150.0, "rss_mb.w": lambda m: 1.0, "lag_s.mean": lambda m: 1.0})
    store = ss.targets(s, 30 * 60, None)[1]
    assert store["met"] is True and store["detail"] == "total +0.0%"


def test_too_few_samples_is_not_met_nor_failed() -> None:
    rows = ss.targets(series(1, **{"rss_mb.w": lambda m: 1.0, "lag_s.mean": lambda m: 1.0}), 60, None)
    assert [r["met"] for r in rows] == [None, None, None, None]


def test_compare_wants_every_window_once_with_its_count() -> None:
    expected = Counter({("u1", 0): 3, ("u2", 0): 1})
    assert compare(expected, Counter(expected))["ok"]
    doubled = compare(expected, Counter({("u1", 0): 6, ("u2", 0): 1}))
    assert not doubled["ok"] and doubled["windows_wrong"] == 1 and "expected 3, got 6" in doubled["detail"]
    missing = compare(expected, Counter({("u1", 0): 3}))
    assert not missing["ok"] and "expected 1, got None" in missing["detail"]
    extra = compare(expected, Counter({**expected, ("u3", 10): 1}))
    assert not extra["ok"] and "1 unexpected windows" in extra["detail"]


def test_feed_counts_what_it_sends_and_no_record_is_late() -> None:
    feed = Feed(Plan(users=20, turnover_s=1.0), rate=1e6)  # far ahead of the clock: never sleeps
    feed.start()
    records = list(feed.records(feed.t0 + 0.005, batch=100))  # due times t0 + i/rate < t0 + 5 ms
    assert len(records) == feed.sent == 5000
    assert len({r.record_id for r in records}) == 5000
    counted: Counter[tuple[str, int]] = Counter()
    max_seen = None
    for i, r in enumerate(records):
        user = json.loads(r.value)["k"]
        counted[(user, r.timestamp - r.timestamp % WINDOW_US)] += 1
        if i % 100 == 0 and max_seen is not None:  # a message's watermark: max so far - disorder
            assert r.timestamp > max_seen - DISORDER_US
        max_seen = r.timestamp if max_seen is None else max(max_seen, r.timestamp)
    assert counted == feed.expected
    # the population slides: one new user every rate * turnover / users records
    users = [int(json.loads(r.value)["k"][1:]) for r in records]
    assert max(users) >= 5000 // feed.shift_every


def test_the_soak_topology_sets_the_ttl_and_the_id_retention() -> None:
    topo = topology(Plan(state_ttl_s=60, id_retention_s=300))
    count = next(c for c in topo.computations if c.name == "count")
    assert count.options.state_ttl_us == 60_000_000
    assert {c.options.record_id_retention_us for c in topo.computations} == {300_000_000}


def test_csv_and_plot_are_written(tmp_path: Path) -> None:
    s = series(5, **{"rss_mb.worker0": lambda m: 60.0, "store_mb.total": lambda m: 10.0 + m,
                     "rows.consumed_ids": lambda m: 1000 * m, "rows.log": lambda m: 10 * m,
                     "lag_s.mean": lambda m: 2.0, "rate.injected": lambda m: None if m == 0 else 3000.0})
    ss.write_csv(tmp_path / "s.csv", s)
    lines = (tmp_path / "s.csv").read_text().splitlines()
    assert lines[0].split(",")[0] == "t_min" and len(lines) == 7
    assert lines[1].endswith(",")  # no rate in the first sample: an empty cell
    ss.plot(tmp_path / "s.png", s, 300, "test")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
