"""``python -m bench.cases.latency_ab [--stores ...] [--rounds R] [--seconds S] [TREE ...]``:
the suite's paced case (single stage, EO + strong, 1k keys) at a fraction of a measured
backlog rate, on SQLite and on Redis with AOF everysec, from several source trees
alternated in one run: the before/after check of a change to record latency.

The sustainable rate of each store is measured at the start of every round, with this
tree's code, as the suite does (``backlog_case``, 1k uniform keys), and every tree is
then paced at the same ``--load`` of it (default 50%), so the trees are compared at
the same load, and a load that drifts (the machine is shared) moves the rate with it.
A TREE is a directory holding a copy of the project at some commit (``git archive
COMMIT | tar -x -C TREE``; give it this tree's ``bench/`` so that only the runner
differs); no TREE means this one. Each round
runs the trees in order, reversed every other round (the machine's load drifts). Each
run is a fresh process with a fresh SQLite file or a flushed private redis-server;
every run's output is checked exactly. Prints each run, then per tree and store the
medians of p50/p95/p99 record latency (release -> count-stage checkpoint committed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from bench.harness import ROOT, Stores, in_fresh_process
from bench.run_local import WorkloadArgs, backlog_case

_PACED = """
import json, sys
from bench.run_local import WorkloadArgs, paced_case
n, rate, url, batch = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
wa = WorkloadArgs(n, 1_000, "uniform", density=max(1, int(rate / 5)))
print(json.dumps(paced_case(wa, "single", url, rate, True, "strong", batch)))
"""


def paced(tree: str, n: int, rate: float, url: str, batch: int) -> dict[str, Any]:
    """One paced case from ``tree``'s code in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _PACED, str(n), str(rate), url, str(batch)], cwd=tree,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=tree), check=True)
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if not r["correct"]["ok"]:
        raise SystemExit(f"{tree}: output wrong: {r['correct']['detail']}")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cases.latency_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", nargs="+", default=["sqlite", "redis-aof"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0, help="paced run length (the full suite's 8 s)")
    ap.add_argument("--load", type=float, default=50.0, help="percent of the backlog rate")
    ap.add_argument("--backlog", type=int, default=50_000, help="records of the rate-setting backlog case")
    ap.add_argument("--rate", type=float, nargs="*", default=None,
                    help="backlog rate per store (skips measuring it), in --stores order")
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("trees", nargs="*")
    args = ap.parse_args(argv)
    trees: list[str] = args.trees or [str(ROOT)]
    stores = Stores()
    got: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for rnd in range(args.rounds):
            for i, kind in enumerate(args.stores):
                if args.rate:
                    top = args.rate[i]
                else:
                    url = stores.url(kind)
                    assert url is not None, stores.redis_error
                    r = in_fresh_process(backlog_case, WorkloadArgs(args.backlog, 1_000, "uniform"), "single", url)
                    assert r["correct"]["ok"], r["correct"]
                    top = float(r["records_per_s"])
                    print(f"{rnd} {kind:9} backlog {top:,.0f} rec/s", flush=True)
                rate = top * args.load / 100
                for tree in trees if rnd % 2 == 0 else trees[::-1]:
                    url = stores.url(kind)
                    assert url is not None
                    r = paced(tree, int(rate * args.seconds), rate, url, args.batch)
                    lat = r["record_latency_ms"]
                    got.setdefault((tree, kind), []).append(lat)
                    print(f"{rnd} {kind:9} {tree}: rate {rate:,.0f} p50 {lat['p50']:.1f} p95 {lat['p95']:.1f} "
                          f"p99 {lat['p99']:.1f} ms; result p95 {r['result_latency_ms']['p95']}", flush=True)
    finally:
        stores.close()
    for (tree, kind), lats in got.items():
        med = {q: statistics.median(x[q] for x in lats) for q in ("p50", "p95", "p99")}
        runs = "; ".join(f"{x['p50']:.1f}/{x['p95']:.1f}/{x['p99']:.1f}" for x in lats)
        print(f"{kind:9} {tree}: median p50 {med['p50']:.1f} p95 {med['p95']:.1f} p99 {med['p99']:.1f} ms"
              f" [p50/p95/p99 per run: {runs}]")
    print("loadavg", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
