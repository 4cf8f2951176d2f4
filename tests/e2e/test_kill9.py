"""Real kill -9 of a `millwheel run` process, at exact seams and at random moments."""

from __future__ import annotations

import random
import signal
import subprocess
from pathlib import Path

import pytest

from millwheel.state.sqlite_store import SQLiteStore
from tests.support import pipelines
from tests.support.random_kills import kill_at_random_moments, kill_window, timed_run

#: The spec, the failure-free run's outputs, the random kills' waits.
Reference = tuple[Path, dict[str, list[tuple[str, bytes, int, str]]], tuple[float, float]]


def millwheel_run(spec: Path, db: Path, crash_at: str | None = None) -> subprocess.Popen[bytes]:
    return pipelines.millwheel_run(spec, f"sqlite:///{db}", crash_at)


@pytest.fixture(scope="module")
def spec_and_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The spec, the failure-free run's outputs, and the waits the random kills draw
    from: 0.6 s (start-up takes ~0.5 s) to 60% of that run, timed on this machine."""
    tmp = tmp_path_factory.mktemp("k9")
    spec = pipelines.write_spec(tmp, 60000)  # ~2 s unloaded
    run_s = timed_run(lambda: millwheel_run(spec, tmp / "ref.db"), timeout_s=120)
    return spec, pipelines.outputs(SQLiteStore(tmp / "ref.db")), kill_window(run_s)


@pytest.mark.parametrize("crash_at", ["after_checkpoint:7", "after_ack:11", "after_inject:3", "after_user_code:20"])
def test_kill9_at_a_seam_then_restart_equals_failure_free_run(
    tmp_path: Path,
    spec_and_reference: Reference,
    crash_at: str,
) -> None:
    spec, reference, _window = spec_and_reference
    db = tmp_path / "s.db"
    proc = millwheel_run(spec, db, crash_at)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    proc = millwheel_run(spec, db)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert pipelines.outputs(SQLiteStore(db)) == reference


def test_kill9_at_random_moments(
    tmp_path: Path,
    spec_and_reference: Reference,
) -> None:
    spec, reference, window = spec_and_reference
    db = tmp_path / "s.db"
    kills, finished = kill_at_random_moments(lambda: millwheel_run(spec, db), random.Random(11), 20, window)
    if not finished:
        pytest.fail("never finished")
    assert kills >= 1, "the run finished before any kill; make the workload bigger"
    assert pipelines.outputs(SQLiteStore(db)) == reference
