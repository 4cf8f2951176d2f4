"""``millwheel run``'s exit status tells a script whether input was set aside: a run that
dead-lettered records exits 3 (issue 33: it exited 0, and a script saw a clean run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.service_cluster import ROOT

SPEC = """\
injectors: [{name: ev, stream: ev, file: ev.jsonl}]
computations:
  - {name: doubled, inputs: [ev], outputs: [out], code: {name: map, params: {value: "json['n'] * 2"}}}
"""


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "run", "spec.yaml", "--quiet", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def write(tmp: Path, values: list[dict[str, int]]) -> None:
    (tmp / "spec.yaml").write_text(SPEC)
    with open(tmp / "ev.jsonl", "a") as f:
        for i, v in enumerate(values):
            f.write(json.dumps({"key": f"k{i}", "value": v, "timestamp": i + 1}) + "\n")


def test_a_run_that_dead_letters_records_exits_3_and_says_where_they_are(tmp_path: Path) -> None:
    write(tmp_path, [{"n": 1}, {"x": 1}, {"n": 2}, {"x": 2}])
    first = run(tmp_path)
    assert first.returncode == 3, first.stderr
    assert "this run dead-lettered records (doubled.dead_letters 2)" in first.stderr
    assert "--print STREAM" in first.stderr
    # Run again on the same store: nothing new is dead-lettered by this run.
    again = run(tmp_path)
    assert again.returncode == 0, again.stderr
    assert "dead-lettered" not in again.stderr


def test_dead_letters_ok_exits_0_and_a_clean_run_exits_0(tmp_path: Path) -> None:
    write(tmp_path, [{"x": 1}])
    allowed = run(tmp_path, "--dead-letters-ok", "--store", f"sqlite:///{tmp_path}/a.db")
    assert allowed.returncode == 0, allowed.stderr
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    write(clean_dir, [{"n": 1}, {"n": 2}])
    clean = run(clean_dir, "--print", "out")
    assert clean.returncode == 0, clean.stderr
    assert sorted(json.loads(line)["value"] for line in clean.stdout.splitlines()) == ["2", "4"]
