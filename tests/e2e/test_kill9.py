"""Real kill -9 of a `millwheel run` process, at exact seams and at random moments."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from millwheel.state.sqlite_store import SQLiteStore
from tests.support import pipelines

ROOT = Path(__file__).resolve().parents[2]


def write_spec(tmp: Path, n: int) -> Path:
    events = tmp / "events.jsonl"
    with events.open("w") as fh:
        for r in pipelines.workload(n=n):
            fh.write(
                json.dumps({"key": r.key, "value": json.loads(r.value), "timestamp": r.timestamp, "id": r.record_id})
                + "\n"
            )
    spec = tmp / "pipeline.yaml"
    spec.write_text(f"""
injectors:
  - {{name: events, stream: events, file: {events.name}, max_disorder_us: 2000000}}
log_streams: [counts]
computations:
  - name: parse
    inputs: [events]
    outputs: [parsed]
    code: {{name: map, params: {{key: "json['user']"}}}}
    options: {{key_ranges: 3}}
  - name: counts
    inputs: [parsed]
    outputs: [counts]
    code: {{name: window_aggregate, params: {{size_us: 10000000}}}}
    options: {{key_ranges: 3}}
  - name: totals
    inputs: [counts]
    outputs: [totals]
    code: tests.support.pipelines:RunningTotal
    options: {{key_ranges: 3}}
""")
    return spec


def millwheel_run(spec: Path, db: Path, crash_at: str | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MILLWHEEL_CRASH_AT", None)
    if crash_at:
        env["MILLWHEEL_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", str(spec), "--store", f"sqlite:///{db}", "--quiet"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.fixture(scope="module")
def spec_and_reference(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, list[tuple[str, bytes, int, str]]]]:
    tmp = tmp_path_factory.mktemp("k9")
    spec = write_spec(tmp, 30000)
    proc = millwheel_run(spec, tmp / "ref.db")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    return spec, pipelines.outputs(SQLiteStore(tmp / "ref.db"))


@pytest.mark.parametrize("crash_at", ["after_checkpoint:7", "after_ack:11", "after_inject:3", "after_user_code:20"])
def test_kill9_at_a_seam_then_restart_equals_failure_free_run(
    tmp_path: Path,
    spec_and_reference: tuple[Path, dict[str, list[tuple[str, bytes, int, str]]]],
    crash_at: str,
) -> None:
    spec, reference = spec_and_reference
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
    spec_and_reference: tuple[Path, dict[str, list[tuple[str, bytes, int, str]]]],
) -> None:
    spec, reference = spec_and_reference
    db = tmp_path / "s.db"
    rng = random.Random(11)
    kills = 0
    for _attempt in range(20):
        proc = millwheel_run(spec, db)
        try:
            proc.wait(timeout=rng.uniform(0.6, 1.6))  # start-up takes ~0.5 s
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
            continue
        assert proc.returncode == 0, proc.stderr.read().decode() if proc.stderr else ""
        break
    else:
        pytest.fail("never finished")
    assert kills >= 1, "the run finished before any kill; make the workload bigger"
    assert pipelines.outputs(SQLiteStore(db)) == reference
