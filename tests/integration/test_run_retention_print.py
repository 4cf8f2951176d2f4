"""``millwheel run --print STREAM`` and the count it prints never pass off what log
retention kept as the whole output: when retention removed a stream's oldest records,
stderr says so (a 10M-event Nexmark q0 printed 1.3M of its 9.2M rows, silently)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.support.service_cluster import ROOT

SPEC = """\
injectors: [{name: ev, stream: ev, file: ev.jsonl}]
computations:
  - name: doubled
    inputs: [ev]
    outputs: [out]
    code: {name: map, params: {value: "json['n'] * 2"}}
    options: {log_retention_us: %d}
"""


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "run", "spec.yaml", "--quiet",
                           "--store", f"sqlite:///{cwd}/s.db", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def write(tmp: Path, n: int, retention_us: int) -> None:
    (tmp / "spec.yaml").write_text(SPEC % retention_us)
    with open(tmp / "ev.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"key": f"k{i}", "value": {"n": i}, "timestamp": i + 1}) + "\n")


def test_print_after_retention_removed_records_says_so_and_shows_what_is_kept(tmp_path: Path) -> None:
    write(tmp_path, 500, 1_000_000)  # a second: the shortest retention there is
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "out: 500 records" in first.stderr
    assert "log retention" not in first.stderr  # nothing was a second old yet
    # The trimmer measures what was logged when it next passes (this run), and removes
    # records a second after that (the run after the wait).
    assert run(tmp_path).returncode == 0
    time.sleep(1.5)
    last = run(tmp_path, "--print", "out")
    assert last.returncode == 0, last.stderr
    printed = last.stdout.splitlines()
    assert len(printed) < 500
    assert f"out: {len(printed)} records" in last.stderr
    assert "out: log retention removed its oldest records (every one through log position" in last.stderr
    assert f"cover only the {len(printed)} kept" in last.stderr
    assert "{log_retention_bytes: 0}" in last.stderr


def test_nothing_is_said_when_retention_removed_nothing(tmp_path: Path) -> None:
    write(tmp_path, 50, 0)  # 0: no age limit
    assert run(tmp_path).returncode == 0
    last = run(tmp_path, "--print", "out")
    assert last.returncode == 0, last.stderr
    assert sorted(json.loads(line)["value"] for line in last.stdout.splitlines()) == sorted(
        str(2 * i) for i in range(50))
    assert "retention" not in last.stderr
