"""The Spark stage (spark_aggregate) against the in-process window_aggregate, real PySpark.

All tests in this process share the one lazily started SparkSession (local mode).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from millwheel.demo import zeitgeist
from millwheel.errors import UserCodeError
from millwheel.record import Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sensors import CountingSensors
from millwheel.sources import ListSource
from millwheel.spark import session
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
from millwheel.windows import Windowing

S = 1_000_000


def log_values(store: SQLiteStore, stream: str) -> list[dict[str, Any]]:
    return [json.loads(r.value) for _s, r in store.read_log(stream, 0, 10**9)]


def final_windows(store: SQLiteStore, stream: str) -> dict[tuple[str, int], dict[str, Any]]:
    """(key, window start) -> the last result emitted for it."""
    return {(v["key"], v["start"]): v for v in log_values(store, stream)}


def run(topology: Topology, records: list[Record], path: Path, disorder_us: int = 0,
        batch_size: int = 1000, sensors: CountingSensors | None = None) -> tuple[SQLiteStore, LocalRunner]:
    store = SQLiteStore(str(path))
    runner = LocalRunner(topology, store, {"in": ListSource(records, disorder_us)},
                         batch_size=batch_size, sensors=sensors)
    runner.run(idle_sleep_s=0.001)
    return store, runner


def stage(name: str, code: str, params: dict[str, Any], opts: Options, out: str | None = None) -> ComputationSpec:
    return ComputationSpec(name, (InputSpec("in"),), (out or name,), CodeRef(code, params), opts)


def test_zeitgeist_with_spark_counts_finds_the_same_anomalies(tmp_path: Path) -> None:
    work = zeitgeist.generate(12_000, 8, 11, minutes=20)
    results = {}
    for spark in (False, True):
        topo = dataclasses.replace(zeitgeist.build_topology(key_ranges=2, spark=spark), log_streams=("counts",))
        store = SQLiteStore(str(tmp_path / f"z{spark}.db"))
        LocalRunner(topo, store, {"queries": ListSource(work.records, work.max_disorder_us)}).run()
        counts = sorted((r.key, r.value) for _s, r in store.read_log("counts", 0, 10**9))
        results[spark] = (counts, zeitgeist.detected_anomalies(store))
    assert results[True][0] == results[False][0]
    assert len(results[True][0]) == 8 * 20
    assert results[True][1] == results[False][1]
    assert results[True][1], "the planted anomalies should be detected"


def test_builtin_aggregations_match_in_process_on_sliding_windows(tmp_path: Path) -> None:
    opts = Options(key_ranges=2)
    records = [
        Record(f"k{i % 3}", json.dumps({"x": (i * 7) % 11, "tag": f"t{i % 5}"}).encode(), i * S // 2, f"r{i}")
        for i in range(120)
    ]
    window = {"size_us": 10 * S, "period_us": 5 * S}
    comps = []
    for agg in ("count", "sum", "min", "max", "mean"):
        comps.append(stage(f"ip_{agg}", "window_aggregate", {**window, "aggregation": agg, "field": "x"}, opts))
        comps.append(stage(f"sp_{agg}", "spark_aggregate", {**window, "aggregation": agg, "field": "x"}, opts))
    comps.append(stage("sp_distinct", "spark_aggregate",
                       {**window, "aggregation": "approx_count_distinct", "field": "tag"}, opts))
    comps.append(stage("sp_median", "spark_aggregate",
                       {**window, "aggregation": "approx_percentile", "field": "x", "percentile": 0.5}, opts))
    comps.append(stage("sp_fn", "spark_aggregate",
                       {**window, "function": "tests.integration.test_spark_stage:distinct_tags"}, opts))
    topo = Topology(tuple(comps), (InjectorSpec("in", "in"),))
    store, _ = run(topo, records, tmp_path / "a.db", batch_size=40)
    for agg in ("count", "sum", "min", "max", "mean"):
        ip, sp = final_windows(store, f"ip_{agg}"), final_windows(store, f"sp_{agg}")
        assert len(ip) == 3 * 13  # 60 s of data in 10 s windows sliding by 5 s, 3 keys
        assert sorted(sp) == sorted(ip)
        assert [sp[k]["count"] for k in sorted(sp)] == [ip[k]["count"] for k in sorted(ip)]
        assert [sp[k]["value"] for k in sorted(sp)] == pytest.approx([ip[k]["value"] for k in sorted(ip)])
    # Expected values from the records themselves, per (key, window).
    expect: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        for start in Windowing(10 * S, 5 * S).assign(r.timestamp):
            expect.setdefault((r.key, start), []).append(json.loads(r.value))
    distinct, median, fn = (final_windows(store, s) for s in ("sp_distinct", "sp_median", "sp_fn"))
    assert set(distinct) == set(expect) == set(fn) == set(median)
    for k, vals in expect.items():
        tags = sorted({v["tag"] for v in vals})
        assert distinct[k]["value"] == len(tags)  # exact at this size
        assert fn[k]["value"] == tags and fn[k]["agg"] == "tests.integration.test_spark_stage:distinct_tags"
        xs = sorted(v["x"] for v in vals)
        assert median[k]["value"] in xs


def distinct_tags(df: Any) -> Any:
    """A user aggregation: the sorted distinct 'tag' fields of each window."""
    from pyspark.sql import functions as F

    tagged = df.withColumn("tag", F.get_json_object("value", "$.tag"))
    return tagged.groupBy("key", "window_start").agg(F.sort_array(F.collect_set("tag")).alias("value"))


def test_late_records_within_lateness_are_included_and_beyond_it_routed(tmp_path: Path) -> None:
    opts = Options(key_ranges=1, allowed_lateness_us=20 * S, late_policy=LatePolicy.ROUTE, late_stream="late")
    window = {"size_us": 10 * S}
    topo = Topology(
        (stage("ip", "window_aggregate", window, opts), stage("sp", "spark_aggregate", window, opts)),
        (InjectorSpec("in", "in"),),
    )
    ts = [1, 2, 15, 5, 26, 7, 45, 3, 60, 50]  # seconds; 5 and 7 late but within 20 s; 3 too late
    records = [Record("a", b"", t * S, f"r{i}") for i, t in enumerate(ts)]
    store, runner = run(topo, records, tmp_path / "late.db", batch_size=1)
    ip, sp = final_windows(store, "ip"), final_windows(store, "sp")
    assert {k: v["value"] for k, v in sp.items()} == {k: v["value"] for k, v in ip.items()}
    assert sp[("a", 0)]["value"] == 4  # 1, 2, 5, 7 (3 came after the window closed for good)
    emitted_first_window = [v["value"] for v in log_values(store, "sp") if v["start"] == 0]
    assert emitted_first_window[0] == 2 and emitted_first_window[-1] == 4  # on time, then corrected
    late = [(r.record_id) for _s, r in store.read_log("late", 0, 100)]
    assert len(late) == 2  # record r7 (t=3) routed once by each computation
    assert runner.finished()


def test_late_records_beyond_lateness_dropped_with_drop_policy(tmp_path: Path) -> None:
    opts = Options(key_ranges=1, late_policy=LatePolicy.DROP)
    topo = Topology((stage("sp", "spark_aggregate", {"size_us": 10 * S}, opts),), (InjectorSpec("in", "in"),))
    records = [Record("a", b"", t * S, f"r{i}") for i, t in enumerate([1, 12, 4, 25])]
    sensors = CountingSensors()
    store, _ = run(topo, records, tmp_path / "drop.db", batch_size=1, sensors=sensors)
    assert {k: v["value"] for k, v in final_windows(store, "sp").items()} == {
        ("a", 0): 1, ("a", 10 * S): 1, ("a", 20 * S): 1}
    assert sensors.counts["late_drop:sp"] == 1


FLAKY_MARKER = "MILLWHEEL_TEST_FLAKY_MARKER"


def fails_once(df: Any) -> Any:
    """Counts per window, but the first Spark job dies in a task (a real job failure)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    marker = os.environ[FLAKY_MARKER]
    first = not os.path.exists(marker)
    if first:
        Path(marker).write_text("failed once")

    def check(n: int) -> int:
        if first:
            raise RuntimeError("injected task failure")
        return n

    counted = df.groupBy("key", "window_start").agg(F.count(F.lit(1)).alias("n"))
    return counted.select("key", "window_start", F.udf(check, LongType())("n").alias("value"))


def always_fails(df: Any) -> Any:
    raise RuntimeError("this aggregation never works")


def counting_spec(code_params: dict[str, Any], **options: Any) -> Topology:
    opts = Options(key_ranges=1, **options)
    return Topology((stage("sp", "spark_aggregate", {"size_us": 10 * S, **code_params}, opts, "out"),),
                    (InjectorSpec("in", "in"),))


def test_failed_job_is_retried_and_emits_each_window_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FLAKY_MARKER, str(tmp_path / "marker"))
    records = [Record(f"k{i % 2}", b"", i * S, f"r{i}") for i in range(30)]
    sensors = CountingSensors()
    topo = counting_spec({"function": "tests.integration.test_spark_stage:fails_once", "retry_backoff_s": 0.1})
    store, runner = run(topo, records, tmp_path / "retry.db", sensors=sensors)
    values = log_values(store, "out")
    assert sorted((v["key"], v["start"], v["value"]) for v in values) == sorted(
        (f"k{k}", w * 10 * S, 5) for k in range(2) for w in range(3))
    assert sensors.counts["spark_retry:sp"] == 1
    assert runner.workers["sp"][0].code.status["retries"] == 1  # type: ignore[attr-defined]


def test_job_that_keeps_failing_loses_no_window(tmp_path: Path) -> None:
    """With ``on_error: fail`` (the default dead-letters the windows' timers instead)."""
    records = [Record("k", b"", i * S, f"r{i}") for i in range(25)]
    db = tmp_path / "fail.db"
    broken = counting_spec({"function": "tests.integration.test_spark_stage:always_fails",
                            "max_attempts": 2, "retry_backoff_s": 0.05}, on_error=ErrorPolicy.FAIL)
    store = SQLiteStore(str(db))
    with pytest.raises(UserCodeError, match="never works"):
        LocalRunner(broken, store, {"in": ListSource(records)}).run()
    assert store.read_log("out", 0, 100) == []  # nothing half-emitted
    assert store.read_timers("sp", 0)  # the window is still pending, its records in state
    # Fixed code, same computation, same store: every window appears exactly once.
    LocalRunner(counting_spec({}), store, {"in": ListSource(records)}).run()
    assert sorted((v["start"], v["value"]) for v in log_values(store, "out")) == [
        (0, 10), (10 * S, 10), (20 * S, 5)]


def kills_session_once(df: Any) -> Any:
    """Counts per window; on its first call it kills the Spark driver JVM mid-job."""
    from pyspark.sql import functions as F

    marker = Path(os.environ[FLAKY_MARKER])
    if not marker.exists():
        marker.write_text("killed")
        pid = session.gateway_pid()
        assert pid is not None
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return df.groupBy("key", "window_start").agg(F.count(F.lit(1)).alias("value"))


def test_session_lost_mid_job_is_restarted_and_the_job_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FLAKY_MARKER, str(tmp_path / "marker"))
    records = [Record("k", b"", i * S, f"r{i}") for i in range(60)]
    store = SQLiteStore(str(tmp_path / "lost.db"))
    sensors = CountingSensors()
    restarts = session.restart_count()
    topo = counting_spec({"function": "tests.integration.test_spark_stage:kills_session_once",
                          "retry_backoff_s": 0.1})
    runner = LocalRunner(topo, store, {"in": ListSource(records)}, batch_size=10, sensors=sensors)
    runner.run(idle_sleep_s=0.001)
    assert (tmp_path / "marker").exists()
    assert sensors.counts["spark_retry:sp"] == 1
    assert session.restart_count() == restarts + 1
    assert runner.workers["sp"][0].code.status["session_restarts"] == restarts + 1  # type: ignore[attr-defined]
    assert sorted((v["start"], v["value"]) for v in log_values(store, "out")) == [
        (w * 10 * S, 10) for w in range(6)]
    assert session.is_alive()


def test_pyspark_is_imported_by_the_session_module_only_and_lazily() -> None:
    import subprocess
    import sys

    code = ("import sys, millwheel.operators, millwheel.spark.stage, millwheel.spark.backfill, services.cli; "
            "services.cli.build_parser(); assert 'pyspark' not in sys.modules, 'pyspark imported eagerly'")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
    importers = sorted(
        str(p.relative_to(root)) for d in ("millwheel", "services") for p in (root / d).rglob("*.py")
        if "from pyspark" in p.read_text() or "import pyspark" in p.read_text()
    )
    assert importers == ["millwheel/spark/session.py"]
