"""millwheel.testing: a pipeline tested in virtual time, with crashes, as a user would
(the built-in operators of the README's pipeline, no server, no files left behind)."""

from __future__ import annotations

import json
import os
import tempfile
import time

import pytest

from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.testing import PipelineTest, every_crash
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology

SECOND = 1_000_000


def topology() -> Topology:
    """clicks -> per-user counts per 10 s window."""
    return Topology(
        computations=(
            ComputationSpec("by_user", (InputSpec("clicks"),), ("user_clicks",),
                            CodeRef("map", {"key": "json['user']"}), Options(key_ranges=2)),
            ComputationSpec("counts", (InputSpec("user_clicks"),), ("counts",),
                            CodeRef("window_aggregate", {"size_us": 10 * SECOND}), Options(key_ranges=2)),
        ),
        injectors=(InjectorSpec("clicks", "clicks"),),
    )


def clicks(n: int, start_s: int = 0) -> list[Record]:
    users = ["ann", "bob", "cy"]
    return [Record(f"c{i}", json.dumps({"user": users[i % 3]}).encode(), (start_s + i) * SECOND, f"click-{start_s}-{i}")
            for i in range(n)]


def counts(t: PipelineTest) -> dict[tuple[str, int], int]:
    return {(r.key, json.loads(r.value)["end"]): json.loads(r.value)["count"] for r in t.output("counts")}


def test_windows_close_when_the_watermark_passes_them_not_before() -> None:
    with PipelineTest(topology()) as t:
        t.add("clicks", clicks(15))  # 0..14 s
        t.run()
        assert t.output("counts") == []  # no watermark yet: every window open
        assert t.timers("counts", "ann")  # its window's end is a pending timer
        t.advance_watermark("clicks", 10 * SECOND)
        t.run()
        first = counts(t)
        assert first == {("ann", 10 * SECOND): 4, ("bob", 10 * SECOND): 3, ("cy", 10 * SECOND): 3}
        assert t.watermark("counts") == 10 * SECOND
        t.done("clicks")
        t.run()
        assert counts(t) == {**first, ("ann", 20 * SECOND): 1, ("bob", 20 * SECOND): 2, ("cy", 20 * SECOND): 2}
        assert t.watermark("counts") == MAX_TIMESTAMP


def test_a_crash_between_runs_loses_and_repeats_nothing() -> None:
    with PipelineTest(topology()) as t:
        t.add("clicks", clicks(30))
        t.advance_watermark("clicks", 10 * SECOND)
        t.run()
        before = counts(t)
        t.crash()  # what the runner held in memory is gone
        t.add("clicks", clicks(30, start_s=30))
        t.done("clicks")
        t.run()
        assert counts(t) == {**before, **{k: v for k, v in counts(t).items() if k not in before}}
        assert sum(counts(t).values()) == 60 and t.crashes == 1


def test_every_crash_point_gives_the_output_of_the_run_without_a_crash() -> None:
    def script(t: PipelineTest) -> None:
        t.add("clicks", clicks(40))
        t.advance_watermark("clicks", 20 * SECOND)
        t.run()
        t.add("clicks", clicks(20, start_s=40))
        t.done("clicks")
        t.run()

    checked = every_crash(topology(), script, outputs=["counts", "user_clicks"], max_visits=6)
    assert checked >= 20  # every point of the sequence, several visits each


def test_every_crash_reports_a_run_whose_output_differs() -> None:
    """The check can fail, naming the crash: here the crashed runs get one record more
    than the run without a crash (as a source that replays more than it first read
    would), and the first crashed run is reported."""
    runs: list[int] = []

    def script(t: PipelineTest) -> None:
        runs.append(1)
        t.add("clicks", clicks(12 if len(runs) == 1 else 13))
        t.done("clicks")
        t.run()

    with pytest.raises(AssertionError, match=r"crash at after_inject #1: stream 'counts' has \d+ records"):
        every_crash(topology(), script, outputs=["counts"], max_visits=2)


def test_processing_time_moves_only_when_told_and_no_file_is_left() -> None:
    tmp = tempfile.gettempdir()
    before = {p for p in os.listdir(tmp) if p.startswith("millwheel-test-")}
    started = time.monotonic()
    with PipelineTest(topology(), start_us=5 * SECOND) as t:
        assert t.clock.now_us() == 5 * SECOND
        t.add("clicks", clicks(3000))  # an hour of event time
        t.done("clicks")
        t.run()
        t.advance_processing_time(3600 * SECOND)
        assert t.clock.now_us() == 3605 * SECOND
        assert sum(counts(t).values()) == 3000
    assert time.monotonic() - started < 30  # well under a second on a desktop; loose here
    assert {p for p in os.listdir(tmp) if p.startswith("millwheel-test-")} == before


def test_a_crash_right_after_an_injector_took_a_watermark_keeps_that_watermark() -> None:
    """The injector's checkpoint moves its cursor past a watermark event: a crash before
    the watermark was reported must not lose it (the restarted injector would read on
    from the next event, and windows would wait for a watermark already given)."""
    from millwheel.testing import CrashSchedule

    with PipelineTest(topology(), crash=CrashSchedule("after_inject", 2)) as t:
        t.add("clicks", clicks(15))
        t.run()
        t.advance_watermark("clicks", 10 * SECOND)  # the injector's 2nd batch: crashed after it
        t.run()
        assert t.crashes == 1
        assert t.watermark("injector:clicks") == 10 * SECOND
        assert counts(t) == {("ann", 10 * SECOND): 4, ("bob", 10 * SECOND): 3, ("cy", 10 * SECOND): 3}
