"""The Flink SQL side of :mod:`bench.peers.peer_flink`: run by the peer's own virtualenv.

It imports only the standard library and PyFlink (never millwheel: apache-flink's pins
clash with the project's, so it lives in ``bench/.peers/flink``). Usage::

    python flink_job.py SPEC_JSON

SPEC_JSON names the jobs to run in order (name, input CSV file), a work directory
(sinks, checkpoints), the parallelism, the checkpoint and the watermark intervals. One
JVM (a local mini-cluster) runs them one after another; :mod:`bench.peers.peer_flink` chooses
the plan (a warm-up, tiny "empty" runs, the measured job). Each job is timed from its
submission to its end (``TableResult.wait()``: the sink's files committed). It prints
one JSON line: the JVM start, each job's seconds and sink directory, the JVM's peak RSS.

The job: a CSV filesystem source ``(k, ts_ms, id)`` with a bounded-out-of-orderness
watermark of 2 s on ``ts`` (emitted every ``watermark_ms``), the window TVF
``TUMBLE(TABLE src, DESCRIPTOR(ts), INTERVAL '10' SECOND)``, ``GROUP BY k,
window_start, window_end`` with ``COUNT(*)``, into a CSV filesystem sink (its files are
committed by checkpoints: Flink's exactly-once sink). Hashmap state backend, aligned
EXACTLY_ONCE checkpoints every second to a local directory, STREAMING runtime mode.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _children() -> list[dict[str, str]]:
    """/proc status fields (plus ``Pid``) of this process's children: the py4j gateway's JVM."""
    me = str(os.getpid())
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == me:
            out.append({k: v.strip() for k, v in fields.items()})
    return out


def jvm_peak_rss_mb() -> float | None:
    """VmHWM of the JVM (the mini-cluster runs in it)."""
    sizes = [float(f["VmHWM"].split()[0]) / 1024.0 for f in _children() if "VmHWM" in f]
    return max(sizes) if sizes else None


def jvm_cpu_s() -> float:
    """User + system CPU seconds of the JVM so far (all its threads)."""
    total = 0.0
    for f in _children():
        try:
            stat = Path(f"/proc/{f['Pid']}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return total


def settings(t_env: Any, spec: dict[str, Any]) -> None:
    conf = t_env.get_config()
    checkpoints = Path(spec["workdir"]) / "checkpoints"
    for key, value in {
        "parallelism.default": str(spec["parallelism"]),
        "execution.runtime-mode": "streaming",
        "state.backend.type": "hashmap",
        "execution.checkpointing.interval": f"{spec['checkpoint_ms']} ms",
        "execution.checkpointing.mode": "EXACTLY_ONCE",
        "execution.checkpointing.storage": "filesystem",
        "execution.checkpointing.dir": checkpoints.as_uri(),
        "pipeline.auto-watermark-interval": f"{spec['watermark_ms']} ms",
        "table.local-time-zone": "UTC",  # window_start printed in UTC, parsed back by the bench
    }.items():
        conf.set(key, value)


def job(t_env: Any, name: str, source: str, sink_dir: Path) -> tuple[float, float]:
    """Create the tables of one job, run it: (seconds to submitted, seconds submission to end)."""
    t_env.execute_sql(f"""
        CREATE TEMPORARY TABLE src_{name} (
            k STRING, ts_ms BIGINT, id STRING,
            ts AS TO_TIMESTAMP_LTZ(ts_ms, 3),
            WATERMARK FOR ts AS ts - INTERVAL '2' SECOND
        ) WITH ('connector' = 'filesystem', 'path' = '{source}', 'format' = 'csv')""")
    t_env.execute_sql(f"""
        CREATE TEMPORARY TABLE out_{name} (k STRING, window_start STRING, n BIGINT)
        WITH ('connector' = 'filesystem', 'path' = '{sink_dir}', 'format' = 'csv')""")
    started = time.perf_counter()
    result = t_env.execute_sql(f"""
        INSERT INTO out_{name}
        SELECT k, CAST(window_start AS STRING) AS window_start, COUNT(*) AS n
        FROM TABLE(TUMBLE(TABLE src_{name}, DESCRIPTOR(ts), INTERVAL '10' SECOND))
        GROUP BY k, window_start, window_end""")
    submitted = time.perf_counter()
    result.wait()
    return submitted - started, time.perf_counter() - started


def main(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    from pyflink.table import EnvironmentSettings, TableEnvironment

    t_env = TableEnvironment.create(EnvironmentSettings.in_streaming_mode())
    settings(t_env, spec)
    work = Path(spec["workdir"])
    out: dict[str, Any] = {"jvm_start_s": time.perf_counter() - t0, "jobs": []}
    for name, source in spec["jobs"]:
        sink = work / f"sink-{name}"
        cpu = jvm_cpu_s()
        submit_s, seconds = job(t_env, name, source, sink)
        out["jobs"].append({"name": name, "seconds": seconds, "submit_s": submit_s, "sink": str(sink),
                            "jvm_cpu_s": jvm_cpu_s() - cpu})
    out["jvm_peak_rss_mb"] = jvm_peak_rss_mb()
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
