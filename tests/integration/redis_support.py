"""A small pipeline spec and `millwheel run` driver shared by the Redis integration tests.

    events --[parse: map, key = json user]--> parsed
    parsed --[counts: window_aggregate, 10 s tumbling]--> counts (also logged)
    counts --[totals: running total per key]--> totals (sink)

The running total makes any double or lost processing visible in every later output
of the key, not just one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from millwheel.state import open_store
from tests.support import pipelines

ROOT = Path(__file__).resolve().parents[2]
Outputs = dict[str, list[tuple[str, bytes, int, str]]]


def write_spec(tmp: Path, n: int, key_ranges: int = 3) -> Path:
    events = tmp / "events.jsonl"
    with events.open("w") as fh:
        for r in pipelines.workload(n=n):
            fh.write(json.dumps({
                "key": r.key, "value": json.loads(r.value), "timestamp": r.timestamp, "id": r.record_id,
            }) + "\n")
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
    options: {{key_ranges: {key_ranges}}}
  - name: counts
    inputs: [parsed]
    outputs: [counts]
    code: {{name: window_aggregate, params: {{size_us: 10000000}}}}
    options: {{key_ranges: {key_ranges}}}
  - name: totals
    inputs: [counts]
    outputs: [totals]
    code: tests.support.pipelines:RunningTotal
    options: {{key_ranges: {key_ranges}}}
""")
    return spec


def millwheel_run(
    spec: Path, url: str, crash_at: str | None = None, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``python -m services.cli run SPEC --store URL`` as a child process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
    env.pop("MILLWHEEL_CRASH_AT", None)
    if crash_at:
        env["MILLWHEEL_CRASH_AT"] = crash_at
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", str(spec), "--store", url, "--quiet"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def run_to_end(spec: Path, url: str, timeout_s: float = 180) -> None:
    proc = millwheel_run(spec, url)
    _, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err.decode()


def outputs_of(url: str) -> Outputs:
    store = open_store(url)
    try:
        return pipelines.outputs(store)
    finally:
        store.close()
