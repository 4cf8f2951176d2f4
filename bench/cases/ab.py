"""``python -m bench.cases.ab [N] [REPS] [BATCH]``: backlog throughput of both pipelines on
SQLite, exactly-once strong, REPS times each in fresh processes. The quick before/after
check for a hot-path change (run it on the old and the new code, same machine)."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from bench.harness import in_fresh_process
from bench.run_local import WorkloadArgs, backlog_case


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 50_000
    reps = int(argv[1]) if len(argv) > 1 else 3
    batch = int(argv[2]) if len(argv) > 2 else 5000
    out: dict[str, list[int]] = {}
    for _ in range(reps):
        for pipe in ("single", "three"):
            d = tempfile.mkdtemp(prefix="bench-ab-")
            r = in_fresh_process(backlog_case, WorkloadArgs(n, 1000, "uniform"), pipe, f"sqlite:///{d}/ab.db",
                                 True, "strong", batch)
            if not r["correct"]["ok"]:
                raise SystemExit(f"{pipe}: output wrong: {r['correct']['detail']}")
            out.setdefault(pipe, []).append(round(r["records_per_s"]))
            out.setdefault(pipe + "_per_cpu_s", []).append(round(r["records_per_cpu_s"]))
    print(json.dumps({"records": n, "batch": batch, "records_per_s": out, "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main(sys.argv[1:])
