"""The local runner fires at most ``timer_slice`` timers per range in a step that
received few records (docs/bench.md "Speed round 2: latency"): a window close of many
keys is spread over several steps. These tests check what a user would: every window
result still comes out exactly once with the same value, a computation's watermark
never passes a timer it has not fired yet (so its results are never late downstream),
and the spreading really happens."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from millwheel.record import MAX_TIMESTAMP, TimeDomain
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sensors import CountingSensors
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import LatePolicy, Options
from tests.support import pipelines

SECOND = 1_000_000
USERS = 60  # 60 keys: a window close is due for ~60 timers at once
RECORDS = pipelines.workload(n=1200, users=USERS)
RANGES = 3


def expected_counts() -> Counter[tuple[str, int]]:
    """(user, window start) -> number of events, from the workload alone."""
    return Counter((json.loads(r.value)["user"], r.timestamp - r.timestamp % (10 * SECOND)) for r in RECORDS)


def counted(store: SQLiteStore) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for key, value, _ts, _id in pipelines.outputs(store)["counts"]:
        window = json.loads(value)
        assert (key, window["start"]) not in out, f"window {key} {window['start']} emitted twice"
        out[(key, window["start"])] = window["count"]
    return out


def earliest_unfired(store: SQLiteStore, computation: str) -> int:
    """The earliest event-time timer holding ``computation``'s watermark, as stored."""
    times = [t.time for r in range(RANGES) for t in store.read_timers(computation, r)
             if t.domain is TimeDomain.EVENT and t.hold]
    return min(times, default=MAX_TIMESTAMP)


def run(path: Path, timer_slice: int, batch_size: int,
        on_step: object = None) -> tuple[SQLiteStore, CountingSensors]:
    sensors = CountingSensors()
    store = SQLiteStore(path)
    opts = Options(key_ranges=RANGES, late_policy=LatePolicy.DROP)
    runner = LocalRunner(pipelines.topology(opts), store, pipelines.sources(RECORDS), sensors=sensors,
                         batch_size=batch_size, timer_slice=timer_slice, watermark_report_interval_us=0)
    while not runner.finished():
        runner.step()
        if callable(on_step):
            on_step(runner, store)
    return store, sensors


def test_a_timer_slice_of_one_still_fires_every_window_exactly_once(tmp_path: Path) -> None:
    sliced, sliced_sensors = run(tmp_path / "sliced.db", timer_slice=1, batch_size=5)
    whole, _ = run(tmp_path / "whole.db", timer_slice=10_000, batch_size=5)
    assert counted(sliced) == expected_counts()
    # the same results, record for record (IDs included), and the same running totals
    assert pipelines.outputs(sliced) == pipelines.outputs(whole)
    assert not [k for k in sliced_sensors.counts if k.startswith("late_")], sliced_sensors.counts


def test_watermarks_never_pass_an_unfired_timer(tmp_path: Path) -> None:
    left_over: list[int] = []  # per step: due timers of "counts" still waiting
    marks: dict[str, list[int]] = {"counts": [], "totals": []}

    def check(runner: LocalRunner, store: SQLiteStore) -> None:
        pending = earliest_unfired(store, "counts")
        out = runner.watermark("counts")
        assert out <= pending, f"counts' watermark {out} passed its unfired timer at {pending}"
        due = runner.watermarks.input_watermark("counts")
        left_over.append(sum(1 for r in range(RANGES) for t in store.read_timers("counts", r)
                             if t.domain is TimeDomain.EVENT and t.time < due))
        for node in marks:
            marks[node].append(runner.watermark(node))

    store, sensors = run(tmp_path / "s.db", timer_slice=1, batch_size=5, on_step=check)
    assert max(left_over) > RANGES, "the slice never left due timers for a later step"
    for node, seen in marks.items():
        assert seen == sorted(seen), f"{node} watermark went backwards"
        assert seen[-1] == MAX_TIMESTAMP
    assert all(d <= u for u, d in zip(marks["counts"], marks["totals"], strict=True))
    # no window result reached "totals" late: none was dropped or counted as late
    assert not [k for k in sensors.counts if k.startswith("late_")], sensors.counts
    assert counted(store) == expected_counts()


def test_a_step_fires_no_more_than_the_slice_or_the_records_it_received(tmp_path: Path) -> None:
    """Each step reads at most 5 records, so "counts" receives at most 5 per step: with a
    slice of 1 a range fires at most 1 timer, or 2 per record it received (13 results
    a step in all), where the unsliced runner emits a whole window close (~60 keys)."""

    def rows_per_step(timer_slice: int, name: str) -> list[int]:
        rows: list[int] = []

        def count_rows(runner: LocalRunner, store: SQLiteStore) -> None:
            rows.append(len(pipelines.outputs(store, ("counts",))["counts"]))

        store, _ = run(tmp_path / name, timer_slice=timer_slice, batch_size=5, on_step=count_rows)
        assert counted(store) == expected_counts()
        return [b - a for a, b in zip([0, *rows], rows, strict=False)]

    bound = RANGES * 1 + 2 * 5
    assert max(rows_per_step(10_000, "whole.db")) > bound
    assert max(rows_per_step(1, "sliced.db")) <= bound
