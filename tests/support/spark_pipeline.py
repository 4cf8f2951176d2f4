"""The Spark stage's crash tests' pipeline, and killing a run while its Spark job runs.

    events --[counts: spark_aggregate, per user]--> counts --[totals: RunningTotal]--> totals

``totals`` keeps a running sum of window counts per user: a window emitted twice (or
lost), or a record counted twice in one, changes every later total of its user.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tests.support import pipelines


def write_spec(tmp: Path, n: int, size_us: int, code_params: str) -> Path:
    """The pipeline as a YAML spec over ``pipelines.workload(n, users=6)`` (a JSON-lines
    file read in several injector batches); ``code_params``: the stage's other params."""
    events = pipelines.write_events_jsonl(tmp / "events.jsonl", pipelines.workload(n=n, users=6))
    spec = tmp / "pipeline.yaml"
    spec.write_text(f"""
injectors:
  - {{name: events, stream: events, file: {events.name}, max_disorder_us: 2000000}}
log_streams: [counts]
computations:
  - name: counts
    inputs: [{{stream: events, key: "json:user"}}]
    outputs: [counts]
    code: {{name: spark_aggregate, params: {{size_us: {size_us}, {code_params}}}}}
    options: {{key_ranges: 2}}
  - name: totals
    inputs: [counts]
    outputs: [totals]
    code: tests.support.pipelines:RunningTotal
    options: {{key_ranges: 2}}
""")
    return spec


def millwheel_run(spec: Path, url: str, crash_at: str | None = None,
                  extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``millwheel run`` at the CLI's own batch size (a Spark job per injector batch)."""
    return pipelines.millwheel_run(spec, url, crash_at, extra_env, batch_size=None)


def kill_once_the_job_runs(proc: subprocess.Popen[bytes], marker: Path, timeout_s: float) -> None:
    """kill -9 ``proc`` once ``marker`` exists (its stalling Spark task wrote it); the
    run must not end before, nor take longer than ``timeout_s`` to get there."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "the Spark job never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
