"""Kill -9 a `millwheel run` whose Spark stage is mid-job; restart; exactly-once results.

    events --[counts: spark_aggregate, 10 s count per user]--> counts --[totals]--> totals

``totals`` keeps a running sum of window counts per user, so a window emitted twice
(or lost) would change every later total. The failure-free reference runs in this
process; the crashed and the restarted runs are separate processes on one store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from millwheel.runtime.local_runner import LocalRunner
from millwheel.state.sqlite_store import SQLiteStore
from services.cli.local import load_target
from tests.support import pipelines, spark_pipeline

MARKER_ENV = "MILLWHEEL_TEST_SLOW_JOB_MARKER"


def write_spec(tmp: Path, code_params: str) -> Path:
    return spark_pipeline.write_spec(tmp, 20_000, 10_000_000, code_params)  # 10 s windows


def millwheel_run(spec: Path, db: Path, env_extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = dict(env_extra)
    return spark_pipeline.millwheel_run(spec, f"sqlite:///{db}", env.pop("MILLWHEEL_CRASH_AT", None), env)


def windows(outputs: dict[str, list[tuple[str, bytes, int, str]]]) -> list[tuple[str, int]]:
    return [(k, json.loads(v)["start"]) for k, v, _t, _i in outputs["counts"]]


def reference_run(spec: Path, db: Path) -> tuple[dict[str, Any], list[int]]:
    """The failure-free run, in process; also which visits of after_user_code directly
    follow a Spark job (the process-level crash points to aim at)."""
    topology, sources = load_target(str(spec))
    visits: list[int] = [0]
    after_job: list[int] = []
    runner: LocalRunner | None = None

    def hook(point: str) -> None:
        if point == "after_user_code":
            visits[0] += 1
            assert runner is not None
            status = runner.workers["counts"][0].code.status  # type: ignore[attr-defined]
            if status["jobs"] > len(after_job):
                after_job.append(visits[0])

    runner = LocalRunner(topology, SQLiteStore(db), sources, crash=hook)
    runner.run(idle_sleep_s=0.001)
    return pipelines.outputs(SQLiteStore(db)), after_job


def test_kill9_right_after_the_spark_job_then_restart_is_exactly_once(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "aggregation: count")
    reference, after_job = reference_run(spec, tmp_path / "ref.db")
    assert len(after_job) >= 3 and len(windows(reference)) == len(set(windows(reference))) > 300
    db = tmp_path / "s.db"
    crash_at = after_job[len(after_job) // 2]  # right after a Spark job in the middle of the run
    proc = millwheel_run(spec, db, {"MILLWHEEL_CRASH_AT": f"after_user_code:{crash_at}"})
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    partial = pipelines.outputs(SQLiteStore(db))
    assert len(partial["counts"]) < len(reference["counts"])  # it died mid-run
    proc = millwheel_run(spec, db, {})
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert pipelines.outputs(SQLiteStore(db)) == reference


def slow_first_job(df: Any) -> Any:
    """Counts per window; while no marker file exists, a Spark task writes it and stalls,
    so the test can kill the worker while the job runs."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    marker = os.environ[MARKER_ENV]

    def stall(n: int) -> int:
        import os as os_
        import time as time_

        if not os_.path.exists(marker):
            with open(marker, "w") as fh:
                fh.write("job running")
            time_.sleep(120)
        return n

    counted = df.groupBy("key", "window_start").agg(F.count(F.lit(1)).alias("n"))
    return counted.select("key", "window_start", F.udf(stall, LongType())("n").alias("value"))


def test_kill9_while_the_spark_job_runs_then_restart_is_exactly_once(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "function: 'tests.integration.test_spark_crash:slow_first_job'")
    marker = tmp_path / "marker"
    marker.write_text("reference run: no stall")
    os.environ[MARKER_ENV] = str(marker)
    try:
        reference, _ = reference_run(spec, tmp_path / "ref.db")
    finally:
        del os.environ[MARKER_ENV]
    marker.unlink()
    db = tmp_path / "s.db"
    proc = millwheel_run(spec, db, {MARKER_ENV: str(marker)})
    spark_pipeline.kill_once_the_job_runs(proc, marker, 180)
    assert pipelines.outputs(SQLiteStore(db))["counts"] == []  # nothing of the job was emitted
    proc = millwheel_run(spec, db, {MARKER_ENV: str(marker)})
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert pipelines.outputs(SQLiteStore(db)) == reference
