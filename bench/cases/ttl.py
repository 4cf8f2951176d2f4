"""``python -m bench.cases.ttl [N] [ROUNDS]``: what a per-key state TTL costs (issue 14).

The single-stage windowed count (1k keys, backlog, SQLite, exactly-once strong) with
the count stage's ``state_ttl_us`` unset and set to one hour, alternated ROUNDS times
in fresh processes; both outputs checked exact. With a TTL every state write that
moves the key's expiry also writes its timer row in the same checkpoint (at most once
per TTL/16 per key: millwheel/runtime/ttl.py); an hour never fires inside the run, so
this is the write-side cost. Prints each run and the median ratio (TTL / none).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any

from bench.harness import in_fresh_process
from bench.run_local import WorkloadArgs, backlog_case

HOUR_US = 3_600_000_000


def compare(n: int = 200_000, rounds: int = 3, verbose: bool = False) -> dict[str, Any]:
    """ROUNDS interleaved pairs (no TTL, a one-hour TTL) of N records, fresh processes;
    raises if an output is wrong."""
    runs: dict[str, list[float]] = {"none": [], "ttl": [], "none_cpu": [], "ttl_cpu": []}
    for _ in range(rounds):
        for name, ttl in (("none", None), ("ttl", HOUR_US)):
            d = tempfile.mkdtemp(prefix="bench-ttl-")
            r = in_fresh_process(backlog_case, WorkloadArgs(n, 1000, "uniform"), "single",
                                 f"sqlite:///{d}/ttl.db", True, "strong", 5000, ttl)
            shutil.rmtree(d, ignore_errors=True)
            if not r["correct"]["ok"]:
                raise RuntimeError(f"{name}: output wrong: {r['correct']['detail']}")
            runs[name].append(r["records_per_s"])
            runs[name + "_cpu"].append(r["records_per_cpu_s"])
            if verbose:
                print(f"{name:5} {r['records_per_s']:>10,.0f} records/s  {r['records_per_cpu_s']:>10,.0f} per CPU-s",
                      flush=True)
    ratio = [t / b for t, b in zip(runs["ttl"], runs["none"], strict=True)]
    ratio_cpu = [t / b for t, b in zip(runs["ttl_cpu"], runs["none_cpu"], strict=True)]
    return {"records": n, "rounds": rounds, "ttl_over_none": round(statistics.median(ratio), 3),
            "ttl_over_none_per_cpu_s": round(statistics.median(ratio_cpu), 3),
            "runs": {k: [round(v) for v in vs] for k, vs in runs.items()},
            "correct": {"ok": True, "detail": "exact"}}


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 200_000
    rounds = int(argv[1]) if len(argv) > 1 else 3
    try:
        result = compare(n, rounds, verbose=True)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc
    print(json.dumps({**result, "loadavg": os.getloadavg()}))

if __name__ == "__main__":
    main(sys.argv[1:])
