"""Staging directories of a worker killed mid-job are removed by the next job.

A Spark job reads the due windows from a staging directory the worker writes and
removes when the job ends; a worker SIGKILLed while the job runs cannot remove it.
Each directory is named by its owner (``w<pid>@<host>_<uuid>``), and every job first
removes those whose owner, on this host, is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from millwheel.spark.stage import STAGING_ENV, sweep_staging
from millwheel.state.sqlite_store import SQLiteStore
from tests.integration.test_spark_crash import MARKER_ENV, millwheel_run, write_spec
from tests.support import pipelines
from tests.support.spark_pipeline import kill_once_the_job_runs


def test_sweep_removes_only_directories_of_dead_owners_on_this_host(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead": f"w{dead.pid}@{host}_{'a' * 32}",
            "live": f"w{live.pid}@{host}_{'b' * 32}",
            "mine": f"w{os.getpid()}@{host}_{'c' * 32}",
            "other_host": f"w{dead.pid}@not-{host}_{'d' * 32}",
            "not_ours": "some-user-directory",
        }
        for name in names.values():
            (tmp_path / name / "window_start=0").mkdir(parents=True)
            (tmp_path / name / "window_start=0" / "part-0.json").write_text("{}\n")
        assert sweep_staging(str(tmp_path)) == [names["dead"]]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(v for k, v in names.items() if k != "dead")
    finally:
        live.kill()
        live.wait()
    assert sweep_staging(str(tmp_path / "missing")) == []


def test_staging_left_by_a_worker_killed_mid_job_is_removed_by_the_next_start(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "function: 'tests.integration.test_spark_crash:slow_first_job'")
    staging = tmp_path / "staging"
    marker = tmp_path / "marker"
    env = {MARKER_ENV: str(marker), STAGING_ENV: str(staging)}
    db = tmp_path / "s.db"
    proc = millwheel_run(spec, db, env)
    kill_once_the_job_runs(proc, marker, 240)
    left = [p.name for p in staging.iterdir()]
    assert len(left) == 1 and left[0].startswith(f"w{proc.pid}@"), left  # the job's directory, left behind
    assert any((staging / left[0]).rglob("part-0.json"))
    proc = millwheel_run(spec, db, env)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert list(staging.iterdir()) == []  # the killed worker's directory and every job's own
    assert pipelines.outputs(SQLiteStore(db))["counts"]  # the restarted run did emit its windows
