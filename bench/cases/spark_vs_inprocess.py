"""Records per window at which the Spark stage beats the in-process windowed aggregation.

For each size N (records per window, over --keys keys), the same records run through
a one-stage topology three times on a fresh SQLite store, in this process:

* ``baseline``: a ``filter`` that drops everything (the framework's own cost:
  injection, dedup, checkpoints);
* ``in-process``: ``window_aggregate`` (incremental per record, in Python);
* ``spark``: ``spark_aggregate`` (records buffered in per-key state, one Spark job
  per key range when windows close), on a warm SparkSession.

It prints wall seconds of each, the aggregation's own cost (minus baseline), the
time inside Spark jobs, and the first N at which the Spark stage is faster.

    .venv/bin/python bench/cases/spark_vs_inprocess.py [--sizes 1000,10000,100000] [--aggregation mean]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from millwheel.record import Record  # noqa: E402
from millwheel.runtime.local_runner import LocalRunner  # noqa: E402
from millwheel.sources import ListSource  # noqa: E402
from millwheel.spark.aggregations import Aggregation, Group  # noqa: E402
from millwheel.spark.session import get_session  # noqa: E402
from millwheel.state.sqlite_store import SQLiteStore  # noqa: E402
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology  # noqa: E402

WINDOW_US = 60_000_000


def workload(per_window: int, windows: int, keys: int) -> list[Record]:
    step = WINDOW_US // per_window
    return [
        Record(f"k{i % keys}", json.dumps({"x": i % 97}).encode(), w * WINDOW_US + i * step, f"{w}-{i}")
        for w in range(windows) for i in range(per_window)
    ]


def run(code: str, params: dict[str, object], records: list[Record], ranges: int) -> tuple[float, float]:
    topo = Topology(
        (ComputationSpec("agg", (InputSpec("in"),), ("out",), CodeRef(code, params), Options(key_ranges=ranges)),),
        (InjectorSpec("in", "in"),),
    )
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(str(Path(tmp) / "b.db"))
        runner = LocalRunner(topo, store, {"in": ListSource(records)}, batch_size=2000)
        started = time.perf_counter()
        runner.run(idle_sleep_s=0.001)
        elapsed = time.perf_counter() - started
        spark_s = 0.0
        for w in runner.workers["agg"]:
            status = getattr(w.code, "status", None)
            if status is not None:
                spark_s = status.get("job_seconds", 0.0)
        store.close()
    return elapsed, spark_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,50000,200000", help="records per window, comma-separated")
    ap.add_argument("--windows", type=int, default=3, help="windows per run (default 3)")
    ap.add_argument("--keys", type=int, default=50, help="distinct keys (default 50)")
    ap.add_argument("--key-ranges", type=int, default=2, help="key ranges (default 2)")
    ap.add_argument("--aggregation", default="mean", help="count, sum, min, max or mean (default mean)")
    args = ap.parse_args()
    started = time.perf_counter()
    for _ in range(3):  # start Spark and warm its JIT and Python workers outside the measurements
        Aggregation("mean").compute(get_session(), [Group("k", 0, 1, [(0, 1.0)] * 1000)])
    print(f"Spark session warm in {time.perf_counter() - started:.1f}s; aggregation {args.aggregation}, "
          f"{args.keys} keys, {args.windows} windows, {args.key_ranges} key ranges", file=sys.stderr)
    agg = {"size_us": WINDOW_US, "aggregation": args.aggregation, "field": "x"}
    header = (f"{'records/window':>14} {'baseline s':>13} {'in-process s':>12} {'spark s':>8} "
              f"{'in Spark jobs s':>15} {'agg cost in-proc':>16} {'agg cost spark':>14} winner")
    print(header)
    crossover = jobs_cross = None
    for n in (int(s) for s in args.sizes.split(",")):
        records = workload(n, args.windows, args.keys)
        base, _ = run("filter", {"expr": "False"}, records, args.key_ranges)
        inproc, _ = run("window_aggregate", agg, records, args.key_ranges)
        spark, in_jobs = run("spark_aggregate", agg, records, args.key_ranges)
        winner = "spark" if spark < inproc else "in-process"
        if winner == "spark" and crossover is None:
            crossover = n
        if in_jobs < inproc - base and jobs_cross is None:
            jobs_cross = n
        print(f"{n:>14,} {base:>13.2f} {inproc:>12.2f} {spark:>8.2f} {in_jobs:>15.2f} "
              f"{inproc - base:>16.2f} {spark - base:>14.2f} {winner}", flush=True)
    if crossover is None:
        print(f"\nThe Spark stage did not beat the in-process aggregation up to {args.sizes.split(',')[-1]} "
              "records per window on this machine.")
    else:
        print(f"\nThe Spark stage beats the in-process aggregation from {crossover:,} records per window.")
    if jobs_cross is not None:
        print(f"The Spark jobs alone cost less than the in-process aggregation's own cost from "
              f"{jobs_cross:,} records per window (the rest of the stage's cost is buffering records "
              "in per-key state).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
