"""When to use a Spark stage: in-process vs Spark, end to end, per aggregation and window size.

For each size N (records in one 60 s window, over --keys keys, 2 key ranges, SQLite,
batches of 2,000) and each aggregation, the same records run through a one-stage
topology twice on a fresh store, in this process, one after the other:

* ``in-process``: ``window_aggregate`` (count and mean incremental per record; exact
  percentile, count_distinct and top_k buffered and computed in Python at the window's
  end); the user function's in-process twin is :class:`CategoryCounts`;
* ``spark``: ``spark_aggregate`` on a warm SparkSession (``--master``, default
  ``local[2]``), the same buffers, computed by one Spark job per key range.

Aggregations: ``count``, ``mean`` (of x), ``percentile`` (exact, p=99, of x),
``count_distinct`` (of user, ~N/10 distinct), ``top_k`` (k=10 most frequent terms of
500), and ``udf_join`` (a user DataFrame function: join each record's term with a
500-row dimension table term -> category, count per category). Every output is
checked against a plain-Python reference computed from the records; a run whose
output differs is reported and fails the benchmark.

Wall seconds from the first record to the last result (the SparkSession is started
and warmed before, so its start-up is excluded); also the part spent computing the
fired windows: the Spark jobs (``status["job_seconds"]``), or the in-process holistic
aggregation's Python (the same counter; count and mean have none, they aggregate
per record). Writes JSON and Markdown to
bench/results/ and a chart PNG (seconds per aggregation vs records per window).

    .venv/bin/python bench/cases/spark_crossover.py [--sizes 10000,100000] [--aggs count,percentile]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from millwheel.operators.holistic_window import HolisticWindowAggregate  # noqa: E402
from millwheel.record import Record  # noqa: E402
from millwheel.runtime.local_runner import LocalRunner  # noqa: E402
from millwheel.sources import ListSource  # noqa: E402
from millwheel.spark.aggregations import Aggregation, Group  # noqa: E402
from millwheel.spark.session import get_session  # noqa: E402
from millwheel.state.sqlite_store import SQLiteStore  # noqa: E402
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology  # noqa: E402

WINDOW_US = 60_000_000
TERMS = 500
CATEGORIES = 20
ME = "bench.cases.spark_crossover"
AGGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name -> (in-process, spark) code params
    "count": ({"aggregation": "count"}, {"aggregation": "count"}),
    "mean": ({"aggregation": "mean", "field": "x"}, {"aggregation": "mean", "field": "x"}),
    "percentile": ({"aggregation": "percentile", "p": 99, "field": "x"},
                   {"aggregation": "percentile", "p": 99, "field": "x"}),
    "count_distinct": ({"aggregation": "count_distinct", "field": "user"},
                       {"aggregation": "count_distinct", "field": "user"}),
    "top_k": ({"aggregation": "top_k", "k": 10, "field": "term"},
              {"aggregation": "top_k", "k": 10, "field": "term"}),
    "udf_join": ({"aggregation": "count_distinct", "field": "term"}, {"function": f"{ME}:category_counts"}),
}


def category(term: str) -> str:
    return f"c{int(term[1:]) * 7 % CATEGORIES}"


def category_counts(df: Any) -> Any:
    """The user DataFrame function: each record's term joined with the dimension table
    (term -> category), records per category, as ``[[category, n], ...]`` by category."""
    from pyspark.sql import functions as F

    dim = df.sparkSession.createDataFrame([(f"t{i}", category(f"t{i}")) for i in range(TERMS)],
                                          "term string, category string")
    terms = df.withColumn("term", F.get_json_object("value", "$.term"))
    counted = terms.join(F.broadcast(dim), "term").groupBy("key", "window_start", "category").count()
    return counted.groupBy("key", "window_start").agg(
        F.sort_array(F.collect_list(F.array(F.col("category"), F.col("count").cast("string")))).alias("value"))


class CategoryCounts(HolisticWindowAggregate):
    """In-process twin of :func:`category_counts`: the same join and count in Python
    over the window's buffered terms."""

    DIM = {f"t{i}": category(f"t{i}") for i in range(TERMS)}

    def reduce(self, values: list[Any]) -> Any:
        counts = Counter(self.DIM[t] for t in values if t in self.DIM)
        return [[c, str(n)] for c, n in sorted(counts.items())]


def workload(n: int, keys: int) -> list[Record]:
    step = WINDOW_US // n
    distinct = max(1, n // 10)
    out = []
    for i in range(n):
        term = f"t{(i * i + 7 * i) % TERMS if i % 3 else i % 37}"  # skewed: 37 terms a third of the time
        value = json.dumps({"x": (i * 7919) % 100_003 / 7.0, "user": f"u{(i * 31) % distinct}", "term": term})
        out.append(Record(f"k{i % keys}", value.encode(), i * step, f"r{i}"))
    return out


def reference(agg: str, records: list[Record]) -> dict[str, Any]:
    """key -> the expected value, in plain Python."""
    per_key: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        per_key.setdefault(r.key, []).append(json.loads(r.value))
    out: dict[str, Any] = {}
    for key, vals in per_key.items():
        if agg == "count":
            out[key] = len(vals)
        elif agg == "mean":
            out[key] = sum(v["x"] for v in vals) / len(vals)
        elif agg == "percentile":
            xs = sorted(v["x"] for v in vals)
            pos = (len(xs) - 1) * 0.99
            lo = math.floor(pos)
            hi = min(lo + 1, len(xs) - 1)
            out[key] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
        elif agg == "count_distinct":
            out[key] = len({v["user"] for v in vals})
        elif agg == "top_k":
            counts = Counter(v["term"] for v in vals)
            out[key] = [[t, c] for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:10]]
        else:
            cats = Counter(category(v["term"]) for v in vals)
            out[key] = [[c, str(n)] for c, n in sorted(cats.items())]
    return out


def matches(got: Any, want: Any) -> bool:
    if isinstance(want, float):
        return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    return bool(got == want)


def run(code: str, params: dict[str, Any], records: list[Record],
        ranges: int) -> tuple[float, float | None, dict[str, Any]]:
    """(wall seconds, seconds computing the fired windows or None, key -> value)."""
    spec = ComputationSpec("agg", (InputSpec("in"),), ("out",), CodeRef(code, {"size_us": WINDOW_US, **params}),
                           Options(key_ranges=ranges))
    topo = Topology((spec,), (InjectorSpec("in", "in"),), log_streams=("out",))
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(str(Path(tmp) / "b.db"))
        runner = LocalRunner(topo, store, {"in": ListSource(records)}, batch_size=2000)
        started = time.perf_counter()
        runner.run(idle_sleep_s=0.001)
        elapsed = time.perf_counter() - started
        statuses = [getattr(w.code, "status", None) for w in runner.workers["agg"]]
        firing = (sum(st["job_seconds"] for st in statuses if st) if any(statuses) else None)
        results = {json.loads(r.value)["key"]: json.loads(r.value)["value"]
                   for _s, r in store.read_log("out", 0, 10**9)}
        store.close()
    return elapsed, firing, results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000", help="records per window, comma-separated "
                    "(default 10000,100000: a few minutes; 1000000 adds ~15 minutes on 2 cores)")
    ap.add_argument("--aggs", default=",".join(AGGS), help=f"comma-separated, of {list(AGGS)}")
    ap.add_argument("--keys", type=int, default=1000, help="distinct keys (default 1000)")
    ap.add_argument("--key-ranges", type=int, default=2)
    ap.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"))
    args = ap.parse_args()
    os.environ["MILLWHEEL_SPARK_MASTER"] = args.master
    aggs = args.aggs.split(",")
    started = time.perf_counter()
    for _ in range(3):  # start Spark and warm it outside the measurements
        Aggregation("percentile", p=50).compute(get_session(), [Group("k", 0, 1, [(0, 1.0)] * 1000)])
    print(f"Spark session ({args.master}) warm in {time.perf_counter() - started:.1f}s; "
          f"{args.keys} keys, {args.key_ranges} key ranges; load {os.getloadavg()}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    ok = True
    for n in (int(s) for s in args.sizes.split(",")):
        records = workload(n, args.keys)
        for agg in aggs:
            ip_params, sp_params = AGGS[agg]
            want = reference(agg, records)
            ip_code = f"{ME}:CategoryCounts" if agg == "udf_join" else "window_aggregate"
            load = os.getloadavg()[0]
            t_ip, f_ip, got_ip = run(ip_code, ip_params, records, args.key_ranges)
            t_sp, f_sp, got_sp = run("spark_aggregate", sp_params, records, args.key_ranges)
            good = {side: set(got) == set(want) and all(matches(got[k], want[k]) for k in want)
                    for side, got in (("in-process", got_ip), ("spark", got_sp))}
            ok = ok and all(good.values())
            row = {"records": n, "aggregation": agg, "in_process_s": round(t_ip, 2), "spark_s": round(t_sp, 2),
                   "spark_speedup": round(t_ip / t_sp, 2), "correct": good, "load1": load,
                   "in_process_firing_s": None if f_ip is None else round(f_ip, 2),
                   "spark_jobs_s": None if f_sp is None else round(f_sp, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write(rows, args, Path(args.out))
    return 0 if ok else 1


def write(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{datetime.date.today().isoformat()}-spark-crossover"
    meta = {"keys": args.keys, "key_ranges": args.key_ranges, "master": args.master, "cpus": os.cpu_count(),
            "load_at_end": os.getloadavg()}
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"Spark crossover: {meta}", "",
             "| records/window | aggregation | in-process s | Spark s | Spark speed-up | in-process firing s "
             "| Spark jobs s | outputs correct | load |",
             "|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        correct = "yes" if all(r["correct"].values()) else f"NO {r['correct']}"
        lines.append(f"| {r['records']:,} | {r['aggregation']} | {r['in_process_s']:.2f} | {r['spark_s']:.2f} "
                     f"| {r['spark_speedup']:.2f}x | {_s(r.get('in_process_firing_s'))} "
                     f"| {_s(r.get('spark_jobs_s'))} | {correct} | {r['load1']:.1f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    chart(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.json/.md/.png", file=sys.stderr)


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, agg in enumerate(dict.fromkeys(r["aggregation"] for r in rows)):
        mine = [r for r in rows if r["aggregation"] == agg]
        xs = [r["records"] for r in mine]
        color = f"C{i}"
        ax.plot(xs, [r["in_process_s"] for r in mine], "--o", color=color, label=f"{agg} in-process")
        ax.plot(xs, [r["spark_s"] for r in mine], "-s", color=color, label=f"{agg} Spark")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("records per window")
    ax.set_ylabel("seconds, end to end")
    ax.set_title("In-process (dashed) vs Spark stage (solid)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
