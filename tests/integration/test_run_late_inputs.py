"""``millwheel run`` ends by saying how many records were late at each computation, per
input stream and what became of them (issue 33, "Late data visible"), for this run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.service_cluster import ROOT

SPEC = """\
injectors: [{{name: clicks, stream: clicks, file: clicks.jsonl}}, {{name: views, stream: views, file: views.jsonl}}]
computations:
  - name: doubled
    inputs: [clicks, views]
    outputs: [out]
    code: {{name: map, params: {{value: "json['n'] * 2"}}}}
    options: {{late_policy: {policy}, allowed_lateness_us: 3000000}}
"""
S = 1_000_000


def write(path: Path, timestamps: list[int]) -> None:
    with open(path, "w") as f:
        for i, ts in enumerate(timestamps):
            f.write(json.dumps({"key": f"k{i % 3}", "value": {"n": i}, "timestamp": ts}) + "\n")


@pytest.mark.parametrize("policy,shown,out", [
    ("drop", "clicks 3 dropped, 2 processed; views 0 late", 10 + 4 + 2),
    ("process", "clicks 5 processed; views 0 late", 10 + 4 + 5),
])
def test_run_prints_the_late_records_per_input(tmp_path: Path, policy: str, shown: str, out: int) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC.format(policy=policy))
    # clicks: 10 s of records read 5 at a time, then 3 records 9 s behind its watermark
    # and 2 within the 3 s allowed; views: 4 records, all read in the first batch
    write(tmp_path / "clicks.jsonl", [i * S for i in range(1, 11)] + [S] * 3 + [8 * S] * 2)
    write(tmp_path / "views.jsonl", [i * S for i in range(1, 5)])
    cmd = [sys.executable, "-m", "services.cli", "run", "spec.yaml", "--batch-size", "5", "--print", "out"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr
    assert f"doubled: late records (behind the input watermark), per input: {shown}" in first.stderr
    assert len(first.stdout.splitlines()) == out
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 0, again.stderr
    assert "late records" not in again.stderr  # nothing new was late in this run (same store)
