"""Exactly-once with the writer process (``millwheel run --writer-process``): real kill -9
of the runner, and of its writer child, at points mid-run; a restart (with the writer
process again) must leave every sink record equal to a failure-free run's."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from millwheel.state.sqlite_store import SQLiteStore
from millwheel.state.url_display import redact
from tests.support import pipelines
from tests.support.random_kills import kill_at_random_moments, kill_window, timed_run

WP = ("--writer-process",)
Reference = tuple[Path, pipelines.Outputs]


def run(spec: Path, db: Path, crash_at: str | None = None) -> subprocess.Popen[bytes]:
    return pipelines.millwheel_run(spec, f"sqlite:///{db}", crash_at, extra_args=WP)


@pytest.fixture(scope="module")
def spec_and_reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The failure-free run WITHOUT the writer process is the reference."""
    tmp = tmp_path_factory.mktemp("wp")
    spec = pipelines.write_spec(tmp, 30000)
    pipelines.run_to_end(spec, f"sqlite:///{tmp / 'ref.db'}")
    return spec, pipelines.outputs(SQLiteStore(tmp / "ref.db"))


@dataclass(frozen=True)
class LongReference:
    spec: Path
    outputs: pipelines.Outputs
    window: tuple[float, float]  # the waits the random kills draw from


@pytest.fixture(scope="module")
def long_spec_and_reference(tmp_path_factory: pytest.TempPathFactory) -> LongReference:
    """As :func:`spec_and_reference` with 200,000 records, plus one failure-free run with
    the writer process, timed: the random kills below wait within 0.6 s and 60% of that
    run, so they land before a run ends however fast this machine is."""
    tmp = tmp_path_factory.mktemp("wp-long")
    spec = pipelines.write_spec(tmp, 200_000)
    pipelines.run_to_end(spec, f"sqlite:///{tmp / 'ref.db'}")
    run_s = timed_run(lambda: run(spec, tmp / "timed.db"))
    return LongReference(spec, pipelines.outputs(SQLiteStore(tmp / "ref.db")), kill_window(run_s))


def finish(spec: Path, db: Path) -> None:
    proc = run(spec, db)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err.decode()


def test_failure_free_run_with_writer_process_equals_reference(tmp_path: Path, spec_and_reference: Reference) -> None:
    spec, reference = spec_and_reference
    finish(spec, tmp_path / "s.db")
    assert pipelines.outputs(SQLiteStore(tmp_path / "s.db")) == reference


@pytest.mark.parametrize("crash_at", ["after_checkpoint:7", "after_ack:11", "after_inject:3",
                                      "after_user_code:20", "after_watermark:2"])
def test_kill9_runner_at_a_seam_then_restart_equals_reference(
    tmp_path: Path, spec_and_reference: Reference, crash_at: str
) -> None:
    spec, reference = spec_and_reference
    db = tmp_path / "s.db"
    proc = run(spec, db, crash_at)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    finish(spec, db)
    assert pipelines.outputs(SQLiteStore(db)) == reference


def test_kill9_runner_at_random_moments(tmp_path: Path, long_spec_and_reference: LongReference) -> None:
    """Up to six kills at random moments, then a run to the end."""
    spec, reference = long_spec_and_reference.spec, long_spec_and_reference.outputs
    db = tmp_path / "s.db"
    kills, finished = kill_at_random_moments(lambda: run(spec, db), random.Random(5), 6,
                                             long_spec_and_reference.window)
    if not finished:
        finish(spec, db)
    assert kills >= 1, "the run finished before any kill; make the workload bigger"
    assert pipelines.outputs(SQLiteStore(db)) == reference


def writer_child(pid: int, timeout_s: float = 10) -> int:
    """The PID of the runner's writer process (its only child)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("the runner started no writer process")


def test_kill9_writer_process_stops_the_runner_and_a_restart_recovers(
    tmp_path: Path, long_spec_and_reference: LongReference
) -> None:
    """kill -9 of the writer child at random moments: the runner exits with an error
    naming it (never a success with lost writes); restarts finish the job exactly once."""
    spec, reference = long_spec_and_reference.spec, long_spec_and_reference.outputs
    db = tmp_path / "s.db"
    children: dict[int, int] = {}  # runner PID -> its writer's

    def start() -> subprocess.Popen[bytes]:
        proc = run(spec, db)
        children[proc.pid] = writer_child(proc.pid)
        return proc

    def kill_writer(proc: subprocess.Popen[bytes]) -> bool:
        try:
            os.kill(children[proc.pid], signal.SIGKILL)
        except ProcessLookupError:
            pass  # it already exited: the run is ending
        _, err = proc.communicate(timeout=60)
        if proc.returncode == 0:  # the run ended before the kill landed
            return False
        assert proc.returncode == 2, err.decode()
        assert "writer process died" in err.decode()
        return True

    kills, finished = kill_at_random_moments(start, random.Random(23), 6, long_spec_and_reference.window,
                                             kill=kill_writer)
    if not finished:
        finish(spec, db)
    assert kills >= 1, "the run finished before any kill; make the workload bigger"
    assert pipelines.outputs(SQLiteStore(db)) == reference


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "sqlite:///:memory:", "rediss://u:p@h:6379/0?x=y"])
def test_writer_process_on_another_store_is_refused_at_once(tmp_path: Path, url: str) -> None:
    """`--writer-process` names the store it cannot serve and exits 2 before opening it:
    no 30 s of retries against an unreachable Redis, nothing created."""
    spec = pipelines.write_spec(tmp_path, 100)
    proc = pipelines.millwheel_run(spec, url, extra_args=WP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert f"the writer process needs a sqlite:/// file store, not {redact(url)!r}" in err.decode()
    assert "unreachable" not in err.decode()
    assert "u:p@" not in err.decode()  # the password is not printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "pipeline.yaml"]
