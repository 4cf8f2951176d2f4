"""``python -m bench.cases.service_ab [--records N] [--rounds R] TREE ...``: the service's
backlog case (``python -m bench.cases.service``) run from several source trees, alternated
with local mode's three-stage backlog (this tree), in one run: the before/after check
of a change to the service, with each tree's ratio to local mode.

A TREE is a directory holding a copy of the project at some commit, made e.g. with
``git archive COMMIT | tar -x -C TREE`` plus ``cp -r services/generated TREE/services/``
(the gRPC stubs are not in git); a commit older than ``bench/cases/`` has the case at
``bench/service.py``: copy this tree's ``bench/`` into its TREE. Each round runs local
mode first, then the trees in order, the order reversed every other round (the
machine's load drifts). Prints each run, then per tree the median, the runs, and the
ratio of medians to local mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _service(tree: str, n: int) -> tuple[float, dict[str, float]]:
    out = subprocess.run([sys.executable, "-m", "bench.cases.service", "--records", str(n)], cwd=tree,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=tree), check=True)
    r = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    if not r["correct"]["ok"]:
        raise SystemExit(f"{tree}: output wrong: {r['correct']['detail']}")
    return float(r["records_per_s"]), r["cpu_s"]


def _local(n: int) -> float:
    code = (f"from bench.cases.service import _local_three; r = _local_three({n}); "
            "assert r['correct']['ok'], r['correct']; print(r['records_per_s'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cases.service_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("trees", nargs="+")
    args = ap.parse_args(argv)
    got: dict[str, list[float]] = {t: [] for t in args.trees}
    cpu: dict[str, list[float]] = {t: [] for t in args.trees}
    local: list[float] = []
    for i in range(args.rounds):
        local.append(_local(args.records))
        print(i, "local", round(local[-1]), flush=True)
        for tree in args.trees if i % 2 == 0 else args.trees[::-1]:
            rate, cpu_s = _service(tree, args.records)
            got[tree].append(rate)
            cpu[tree].append(sum(v for k, v in cpu_s.items() if k != "client"))
            print(i, tree, round(rate), cpu_s, flush=True)
    base = statistics.median(local)
    print(f"local: median {base:,.0f} [{', '.join(f'{x:,.0f}' for x in local)}]")
    for tree, rates in got.items():
        med = statistics.median(rates)
        print(f"{tree}: median {med:,.0f} [{', '.join(f'{x:,.0f}' for x in rates)}]; ratio to local "
              f"{med / base:.3f} (per round {', '.join(f'{a / b:.2f}' for a, b in zip(rates, local, strict=True))}); "
              f"CPU s of controller + workers, median {statistics.median(cpu[tree]):.2f}")
    print("loadavg", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
