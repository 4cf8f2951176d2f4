"""Zeitgeist: spike and dip detection on a stream of search queries (MillWheel §2).

A seeded synthetic stream of queries (popularity Zipf-like, event times up to a few
seconds out of order) with spikes and dips planted at known one-minute windows runs
through two stages, exactly-once on the chosen store:

  queries --[counts: window_aggregate, 1-minute tumbling count per query]--> counts
  counts  --[detector: per-query EWMA model in state; spike/dip records]---> anomalies

It prints progress while it runs and ends with the detected anomalies beside the
planted ones, with precision and recall.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from millwheel.computation import Computation, Context
from millwheel.record import Record
from millwheel.sources import ListSource
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology

MINUTE_US = 60_000_000
EPOCH_US = 1_699_999_980_000_000  # event times start here, on a minute boundary (2023-11-14)
SPIKE_FACTOR = 4.0
DIP_FACTOR = 0.2


@dataclass(frozen=True)
class Anomaly:
    query: str
    window_start: int
    kind: str  # "spike" or "dip"


@dataclass(frozen=True)
class Workload:
    records: list[Record]
    planted: list[Anomaly]
    max_disorder_us: int


def generate(records: int, keys: int, seed: int, minutes: int = 60,
             max_disorder_us: int = 2_000_000, anomalies: int = 8) -> Workload:
    """The seeded query stream. Same arguments, same records, same IDs."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** 0.9 for k in range(keys)]
    total_w = sum(weights)
    per_window = records / minutes
    base = [per_window * w / total_w for w in weights]
    queries = [f"q{k:04d}" for k in range(keys)]
    # Plant anomalies on queries busy enough to tell from noise, away from the warm-up.
    eligible = [k for k in range(keys) if base[k] >= 40]
    planted: dict[tuple[int, int], str] = {}
    attempts = 0
    while eligible and len(planted) < anomalies and attempts < 10_000 and minutes > 14:
        attempts += 1
        k, w = rng.choice(eligible), rng.randrange(10, minutes - 2)
        if any(pk == k and abs(pw - w) < 4 for pk, pw in planted):
            continue
        planted[(k, w)] = rng.choice(("spike", "dip"))
    events: list[tuple[float, int, int]] = []  # (emit order key, timestamp, query index)
    for k in range(keys):
        for w in range(minutes):
            kind = planted.get((k, w))
            lam = base[k] * (SPIKE_FACTOR if kind == "spike" else DIP_FACTOR if kind == "dip" else 1.0)
            start = EPOCH_US + w * MINUTE_US
            for _ in range(_poisson(rng, lam)):
                ts = start + rng.randrange(MINUTE_US)
                events.append((ts + rng.randrange(max_disorder_us), ts, k))
    events.sort()
    recs = [
        Record(queries[k], b"", ts, f"zg-{seed}-{i}") for i, (_order, ts, k) in enumerate(events)
    ]
    plant_list = sorted(
        (Anomaly(queries[k], EPOCH_US + w * MINUTE_US, kind) for (k, w), kind in planted.items()),
        key=lambda a: (a.window_start, a.query),
    )
    return Workload(recs, plant_list, max_disorder_us)


def _poisson(rng: random.Random, lam: float) -> int:
    if lam > 30:
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


class SpikeDetector(Computation):
    """Stage 2: per query, an EWMA of window counts and their variance in state.

    A window whose count departs from the model by more than ``z`` standard
    deviations and by a factor of ``ratio`` is reported; anomalous windows do not
    update the model, so one spike does not mask the next.
    """

    def __init__(self, *, alpha: float = 0.2, z: float = 4.0, ratio: float = 2.0,
                 warmup: int = 5, output: str = "anomalies") -> None:
        self.alpha, self.z, self.ratio, self.warmup, self.output = alpha, z, ratio, warmup, output

    def process_record(self, ctx: Context, record: Record) -> None:
        window = json.loads(record.value)
        count = float(window["count"])
        model: dict[str, Any] = json.loads(ctx.state) if ctx.state else {"n": 0, "mean": 0.0, "var": 0.0}
        kind = None
        if model["n"] >= self.warmup:
            mean = model["mean"]
            sd = math.sqrt(max(model["var"], mean, 1.0))
            if count > mean * self.ratio and (count - mean) / sd > self.z:
                kind = "spike"
            elif count < mean / self.ratio and (mean - count) / sd > self.z:
                kind = "dip"
        if kind is not None:
            payload = {"query": ctx.key, "window_start": window["start"], "kind": kind,
                       "count": int(count), "expected": round(model["mean"], 1)}
            ctx.produce(self.output, ctx.key, json.dumps(payload).encode(), record.timestamp)
        else:
            if model["n"] == 0:
                model["mean"] = count
            diff = count - model["mean"]
            model["mean"] += self.alpha * diff
            model["var"] = (1 - self.alpha) * (model["var"] + self.alpha * diff * diff)
            model["n"] += 1
        ctx.set_state(json.dumps(model).encode())


def build_topology(key_ranges: int = 4, spark: bool = False) -> Topology:
    """``spark=True`` counts with the Spark stage (``spark_aggregate``) instead."""
    opts = Options(key_ranges=key_ranges)
    counter = "spark_aggregate" if spark else "window_aggregate"
    return Topology(
        computations=(
            ComputationSpec("counts", (InputSpec("queries"),), ("counts",),
                            CodeRef(counter, {"size_us": MINUTE_US}), opts),
            ComputationSpec("detector", (InputSpec("counts"),), ("anomalies",),
                            CodeRef("millwheel.demo.zeitgeist:SpikeDetector"), opts),
        ),
        injectors=(InjectorSpec("queries", "queries"),),
    )


def detected_anomalies(store: Any) -> list[Anomaly]:
    found = []
    for _seq, rec in store.read_log("anomalies", 0, 10**9):
        a = json.loads(rec.value)
        found.append(Anomaly(a["query"], a["window_start"], a["kind"]))
    return sorted(found, key=lambda a: (a.window_start, a.query))


def score(planted: list[Anomaly], detected: list[Anomaly]) -> tuple[float, float]:
    hits = len(set(planted) & set(detected))
    precision = hits / len(detected) if detected else 1.0
    recall = hits / len(planted) if planted else 1.0
    return precision, recall


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--records", type=int, default=200_000, help="records to inject (default 200000)")
    parser.add_argument("--keys", type=int, default=50, help="distinct queries (default 50)")
    parser.add_argument("--minutes", type=int, default=60, help="event-time span in minutes (default 60)")
    parser.add_argument("--seed", type=int, default=7, help="random seed (default 7)")
    parser.add_argument("--store", default=None,
                        help="store URL (default: a fresh SQLite file in a temporary directory)")
    parser.add_argument("--key-ranges", type=int, default=4, help="key ranges per computation (default 4)")
    parser.add_argument("--spark", action="store_true",
                        help="count per query per window with a Spark stage (PySpark, local[*])")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (for scripts)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def main(args: argparse.Namespace) -> int:
    from millwheel.runtime.crash import crash_hook_from_env
    from millwheel.runtime.local_runner import LocalRunner, print_progress
    from millwheel.state import open_store
    from millwheel.state.url_display import describe_store

    with tempfile.TemporaryDirectory(prefix="zeitgeist-") as tmp:
        url = args.store or f"sqlite:///{Path(tmp) / 'zeitgeist.db'}"
        work = generate(args.records, args.keys, args.seed, args.minutes)
        if not args.quiet:
            print(f"Zeitgeist: {len(work.records):,} queries over {args.keys} keys, "
                  f"{args.minutes} min of event time, {len(work.planted)} planted anomalies; "
                  f"store {describe_store(url)}", file=sys.stderr)
        store = open_store(url)
        try:
            runner = LocalRunner(
                build_topology(args.key_ranges, getattr(args, "spark", False)), store,
                {"queries": ListSource(work.records, work.max_disorder_us)},
                crash=crash_hook_from_env(),
            )
            result = runner.run(on_progress=None if args.quiet else print_progress)
            detected = detected_anomalies(store)
        finally:
            store.close()
    precision, recall = score(work.planted, detected)
    why = small_run_note(work, detected, args)
    if args.json:
        print(json.dumps({
            "planted": [a.__dict__ for a in work.planted],
            "detected": [a.__dict__ for a in detected],
            "precision": precision, "recall": recall,
            "records": len(work.records), "seconds": round(result.elapsed_s, 3),
            **({"note": why} if why else {}),
        }))
        return 0
    print_table(work.planted, detected)
    rate = result.processed / result.elapsed_s if result.elapsed_s else 0
    print(f"\nprecision {precision:.2f}  recall {recall:.2f}  "
          f"({len(work.records):,} records in {result.elapsed_s:.1f}s, {rate:,.0f} deliveries/s)")
    if why:
        print(why)
    return 0


def small_run_note(work: Workload, detected: list[Anomaly], args: argparse.Namespace) -> str:
    """Why a small run scores lower, in a line ("" when nothing needs saying): anomalies
    are planted only on queries busy enough to tell from noise, and the fewer queries a
    window counts, the more often chance alone crosses the detector's thresholds."""
    per_minute = len(work.records) / max(1, args.minutes) / max(1, args.keys)
    more = "more --records (default 200,000) or fewer --keys"
    if not work.planted:
        return (f"note: no query is busy enough (40 a minute) to plant an anomaly in: {per_minute:.1f} "
                f"queries per query and minute on average; use {more}")
    unplanted = len(set(detected) - set(work.planted))
    if unplanted:
        return (f"note: {unplanted} detected window(s) were not planted: with {per_minute:.1f} queries per "
                "query and minute on average, chance variation in small counts crosses the detector's "
                f"thresholds; {more} make the counts larger and the score better")
    return ""


def print_table(planted: list[Anomaly], detected: list[Anomaly]) -> None:
    rows = sorted(set(planted) | set(detected), key=lambda a: (a.window_start, a.query, a.kind))
    print(f"\n{'window (UTC)':<20} {'query':<8} {'kind':<6} {'planted':<8} {'detected':<8}")
    import datetime as dt

    for a in rows:
        when = dt.datetime.fromtimestamp(a.window_start / 1e6, dt.UTC).strftime("%Y-%m-%d %H:%M")
        print(f"{when:<20} {a.query:<8} {a.kind:<6} {'yes' if a in planted else '-':<8} "
              f"{'yes' if a in detected else '-':<8}")
