"""Exactly-once through crashes: crash the local runtime at random seams of the
checkpoint sequence, restart it from the store (all in-memory state lost), and
compare every output record and every key's final state with a failure-free run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from millwheel.runtime.crash import POINTS, CrashSchedule, SimulatedCrash
from millwheel.runtime.local_runner import LocalRunner
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import Options, Productions
from tests.support import pipelines

RECORDS = pipelines.workload()


def run_clean(path: Path, options: Options | None = None) -> SQLiteStore:
    store = SQLiteStore(path)
    LocalRunner(
        pipelines.topology(options), store, pipelines.sources(RECORDS), batch_size=97, watermark_report_interval_us=0
    ).run()
    return store


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> SQLiteStore:
    return run_clean(tmp_path_factory.mktemp("ref") / "ref.db")


def run_with_crashes(
    path: Path, schedules: list[CrashSchedule], options: Options | None = None
) -> tuple[SQLiteStore, int]:
    """Run to completion, crashing at each schedule in turn; returns store and crash count."""
    crashes = 0
    for schedule in [*schedules, None]:
        store = SQLiteStore(path)
        runner = LocalRunner(
            pipelines.topology(options),
            store,
            pipelines.sources(RECORDS),
            batch_size=97,
            watermark_report_interval_us=0,
            **({"crash": schedule} if schedule else {}),
        )
        try:
            runner.run()
            return store, crashes
        except SimulatedCrash:
            crashes += 1
            store.close()  # the process is gone: nothing in memory survives
    raise AssertionError("unreachable")


def assert_same_as_reference(store: SQLiteStore, reference: SQLiteStore) -> None:
    got, want = pipelines.outputs(store), pipelines.outputs(reference)
    assert len(want["counts"]) > 50 and len(want["totals"]) == len(want["counts"])
    for stream in want:
        missing = set(want[stream]) - set(got[stream])
        extra = set(got[stream]) - set(want[stream])
        assert not missing and not extra, f"{stream}: {len(missing)} lost, {len(extra)} unexpected"
    for comp in ("counts", "totals"):
        assert pipelines.final_state(store, comp) == pipelines.final_state(reference, comp)
    # every input counted exactly once
    assert sum(int(v.split(b'"count": ')[1].rstrip(b"}")) for _k, v, _t, _i in got["counts"]) == len(RECORDS)


def test_reference_run_counts_every_record_once(reference: SQLiteStore) -> None:
    assert_same_as_reference(reference, reference)


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("nth", [1, 4, 13])
def test_single_crash_at_each_point(tmp_path: Path, reference: SQLiteStore, point: str, nth: int) -> None:
    store, crashes = run_with_crashes(tmp_path / "s.db", [CrashSchedule(point, nth)])
    assert crashes == 1
    assert_same_as_reference(store, reference)


@pytest.mark.parametrize("seed", range(12))
def test_random_crash_schedules(tmp_path: Path, reference: SQLiteStore, seed: int) -> None:
    rng = random.Random(seed)
    schedules = [CrashSchedule(rng.choice(POINTS), rng.randint(1, 15)) for _ in range(rng.randint(2, 5))]
    store, crashes = run_with_crashes(tmp_path / "s.db", schedules)
    assert crashes >= 1
    assert_same_as_reference(store, reference)


@pytest.mark.parametrize("point", ["after_dedup", "after_user_code", "after_checkpoint", "after_ack"])
def test_weak_productions_survive_crashes(tmp_path: Path, point: str) -> None:
    weak = Options(key_ranges=3, productions=Productions.WEAK)
    reference = run_clean(tmp_path / "ref.db", weak)
    store, crashes = run_with_crashes(tmp_path / "s.db", [CrashSchedule(point, 5), CrashSchedule(point, 11)], weak)
    assert crashes == 2
    assert_same_as_reference(store, reference)
    strong = run_clean(tmp_path / "strong.db")
    assert pipelines.outputs(store) == pipelines.outputs(strong)  # same results as strong productions
