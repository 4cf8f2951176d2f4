"""Recovery after kill -9: a real ``millwheel run`` process, SIGKILLed mid-stream.

The runner (``python -m services.cli run bench.cases.recovery_target``) processes a paced
stream whose schedule is anchored to wall clock, so records keep arriving while it
is dead. Its count stage appends ``time lag`` samples to a probe file. We kill it
after ``before_s`` seconds, restart it at once on the same store, and read:

* time to first record: restart -> the first record processed by the new process
  (interpreter start, imports, token bump, timer/outbox/ID reload included);
* time to steady lag: restart -> the first sample whose lag (now - release time of
  the record) is back within max(100 ms, 2 x the p95 lag before the kill);
* that the final output is still exactly the expected counts (exactly-once across
  the kill), and each process's peak RSS (VmHWM).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import pipelines
from bench.harness import ROOT
from bench.run_local import WorkloadArgs
from bench.workload import check
from millwheel.state import open_store


def _vm_hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _start(spec: dict[str, Any], store_url: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BENCH_RECOVERY": json.dumps(spec), "PYTHONPATH": str(ROOT)}
    env.pop("MILLWHEEL_CRASH_AT", None)
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", "bench.cases.recovery_target", "--store", store_url, "--quiet"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def _watch(proc: subprocess.Popen[bytes], until: float | None) -> float:
    """Wait until ``until`` (or the process exits); returns its peak RSS seen."""
    peak = 0.0
    while proc.poll() is None and (until is None or time.time() < until):
        peak = max(peak, _vm_hwm_mb(proc.pid) or 0.0)
        time.sleep(0.05)
    return peak


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def recovery_case(wa: WorkloadArgs, pipeline: str, store_url: str, rate: float, before_s: float,
                  after_s: float) -> dict[str, Any]:
    probe = Path(tempfile.mkstemp(prefix="bench-probe-", suffix=".txt")[1])
    t0 = time.time() + 1.5  # the first process starts before its stream does
    n = int(rate * (1.5 + before_s + after_s))
    wa = WorkloadArgs(n, wa.keys, wa.distribution, wa.seed, density=wa.density)
    spec = {"n": n, "keys": wa.keys, "distribution": wa.distribution, "density": wa.density,
            "rate": rate, "t0": t0, "pipeline": pipeline, "probe": str(probe)}
    first = _start(spec, store_url)
    peak_first = _watch(first, t0 + before_s)
    if first.poll() is not None:
        raise RuntimeError(f"runner exited early: {first.stderr.read().decode() if first.stderr else ''}")
    t_kill = time.time()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    t_restart = time.time()
    second = _start(spec, store_url)
    peak_second = _watch(second, None)
    _, err = second.communicate()
    if second.returncode != 0:
        raise RuntimeError(f"restarted runner failed ({second.returncode}): {err.decode()[-2000:]}")
    samples = [tuple(map(float, line.split())) for line in probe.read_text().splitlines() if line.strip()]
    probe.unlink()
    before = [lag for t, lag in samples if t_kill - 3.0 <= t < t_kill]
    after = [(t, lag) for t, lag in samples if t > t_restart]
    threshold = max(0.1, 2 * _pct(before, 0.95)) if before else 0.1
    first_t = after[0][0] - t_restart if after else None
    steady = next((t - t_restart for t, lag in after if lag <= threshold), None)
    store = open_store(store_url)
    try:
        verdict = check(wa.build(), pipelines.read_counts(store, pipeline)).as_dict()
    finally:
        store.close()
    return {
        "rate": rate, "records": n, "killed_after_s": t_kill - t0,
        "downtime_s": t_restart - t_kill,
        "to_first_record_s": first_t, "to_steady_lag_s": steady,
        "lag_before_kill_p50_ms": _pct(before, 0.5) * 1000 if before else None,
        "lag_before_kill_p95_ms": _pct(before, 0.95) * 1000 if before else None,
        "steady_threshold_ms": threshold * 1000,
        "max_lag_after_restart_ms": max((lag for _, lag in after), default=0.0) * 1000,
        "peak_rss_mb": {"killed": peak_first, "restarted": peak_second},
        "correct": verdict,
    }
