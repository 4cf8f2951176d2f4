"""``python -m bench.cases.growth [N ...]``: does a long run stay flat? (issue 14)

The single-stage pipeline (SQLite, exactly-once, strong productions, uniform 1k keys)
over N records from a *streamed* workload: records are generated chunk by chunk as
the injector reads them (never held all at once), so the runner's peak RSS is the
runner's, not the workload's. Reported per N: backlog records/s (whole run, and the
last 30%), peak RSS, store bytes per record (the database file after close, and the
database + WAL before it), and the
output checked exactly against counts computed by a separate process from the same
stream (its memory is not the runner's).

The stream has the properties of :mod:`bench.workload` (IDs ``r<i>``, 2 s disorder,
~1% late records stamped 22-32 s behind, density 2000 records per event second) but
its own seeded sequence (per chunk), so its records differ from ``generate``'s.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Iterator

from bench import pipelines
from bench.harness import in_fresh_process
from bench.workload import DISORDER_US, EPOCH_US, LATE_MIN_US, LATE_SPREAD_US, PAD, SECOND, WINDOW_US
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sensors import CountingSensors
from millwheel.sources import SourceBatch
from millwheel.state import open_store

CHUNK = 10_000
DENSITY = 2000  # records per event second
LATE_FRACTION = 0.01
LATE_FROM = 25 * SECOND * DENSITY // SECOND  # no late records in the first 25 event seconds


def chunk(seed: int, c: int, n: int, keys: int) -> list[tuple[Record, bool]]:
    """Records ``c * CHUNK`` .. of the stream (at most up to ``n``), each with "is late"."""
    rng = random.Random(seed * 1_000_003 + c)
    start, end = c * CHUNK, min(n, (c + 1) * CHUNK)
    out = []
    for i in range(start, end):
        key = f"k{rng.randrange(keys)}"
        base = EPOCH_US + i * (SECOND // DENSITY)
        late = i >= LATE_FROM and rng.random() < LATE_FRACTION
        ts = base - LATE_MIN_US - int(rng.random() * LATE_SPREAD_US) if late else \
            base - int(rng.random() * (DISORDER_US - 1))
        value = json.dumps({"k": key, "n": i, "p": PAD}, separators=(",", ":")).encode()
        out.append((Record(key, value, ts, f"r{i}"), late))
    return out


def stream(seed: int, n: int, keys: int) -> Iterator[tuple[Record, bool]]:
    for c in range((n + CHUNK - 1) // CHUNK):
        yield from chunk(seed, c, n, keys)


class StreamSource:
    """The stream as a replayable source; cursor ``{"i", "max"}``; 2 s disorder bound.
    Holds one chunk at a time."""

    def __init__(self, seed: int, n: int, keys: int) -> None:
        self.seed, self.n, self.keys = seed, n, keys
        self._chunk: tuple[int, list[Record]] = (-1, [])

    def _records(self, c: int) -> list[Record]:
        if self._chunk[0] != c:
            self._chunk = (c, [r for r, _late in chunk(self.seed, c, self.n, self.keys)])
        return self._chunk[1]

    def read(self, cursor: bytes | None, max_records: int) -> SourceBatch:
        state = json.loads(cursor) if cursor else {"i": 0, "max": MIN_TIMESTAMP}
        i, max_seen = state["i"], state["max"]
        end = min(i + max_records, self.n)
        batch: list[Record] = []
        while i + len(batch) < end:
            at = i + len(batch)
            c = at // CHUNK
            batch.extend(self._records(c)[at - c * CHUNK: end - c * CHUNK])
        for r in batch:
            if r.timestamp > max_seen:
                max_seen = r.timestamp
        done = end >= self.n
        wm = MAX_TIMESTAMP if done else (MIN_TIMESTAMP if max_seen == MIN_TIMESTAMP else max_seen - DISORDER_US)
        return SourceBatch(batch, json.dumps({"i": end, "max": max_seen}).encode(), wm, done)


def expected(seed: int, n: int, keys: int) -> tuple[dict[str, int], int]:
    """(key|window start -> count, number of late records), computed from the stream alone."""
    counts: Counter[str] = Counter()
    late = 0
    for r, is_late in stream(seed, n, keys):
        if is_late:
            late += 1
        else:
            counts[f"{r.key}|{r.timestamp - r.timestamp % WINDOW_US}"] += 1
    return dict(counts), late


def run(n: int, keys: int = 1000, seed: int = 7, batch_size: int = 5000) -> dict[str, Any]:
    """One run in this process: throughput, RSS, store size; output read back for the check."""
    d = tempfile.mkdtemp(prefix="bench-growth-")
    store = open_store(f"sqlite:///{d}/growth.db")
    sensors = CountingSensors()
    runner = LocalRunner(pipelines.topology("single"), store, {"events": StreamSource(seed, n, keys)},
                         sensors=sensors, batch_size=batch_size)
    started, cpu_started = time.perf_counter(), time.process_time()
    tail_at = tail_t = tail_cpu = None
    while True:
        moved = runner.step()
        if tail_at is None and runner.processed >= 0.7 * n:
            tail_at, tail_t, tail_cpu = runner.processed, time.perf_counter(), time.process_time()
        if runner.finished():
            break
        if not moved:
            time.sleep(0.0005)
    elapsed, cpu_end = time.perf_counter() - started, time.process_time()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    wal = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))  # database + WAL
    observed = {f"{k}|{w}": c for (k, w), c in pipelines.read_counts(runner.store, "single").items()}
    runner.store.close()  # the last connection's close moves the WAL into the database
    files = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    assert tail_at is not None and tail_t is not None and tail_cpu is not None
    return {
        "records": n, "seconds": elapsed, "records_per_s": n / elapsed,
        "tail_records_per_s": (n - tail_at) / (started + elapsed - tail_t),
        # less sensitive to other load on the machine than wall time
        "records_per_cpu_s": n / (cpu_end - cpu_started),
        "tail_records_per_cpu_s": (n - tail_at) / (cpu_end - tail_cpu),
        "peak_rss_mb": rss, "store_bytes": files, "store_bytes_per_record": files / n,
        "with_wal_bytes_per_record": wal / n,
        "late_dropped": sensors.counts["late_drop:count"], "observed": observed, "dir": d,
    }


def case(n: int) -> dict[str, Any]:
    r = in_fresh_process(run, n)
    want, late = in_fresh_process(expected, 7, n, 1000)
    got = r.pop("observed")
    wrong = [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]
    r["correct"] = {"ok": not wrong and r["late_dropped"] == late,
                    "detail": "exact" if not wrong and r["late_dropped"] == late
                    else f"{len(wrong)} windows differ; late {r['late_dropped']} vs {late}"}
    for f in os.listdir(r["dir"]):
        os.remove(os.path.join(r["dir"], f))
    os.rmdir(r.pop("dir"))
    return r


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [100_000, 1_000_000, 10_000_000]
    rows = []
    for n in sizes:
        r = case(n)
        rows.append(r)
        print(f"{n:>11,} records  {r['records_per_s']:>9,.0f}/s  last 30% {r['tail_records_per_s']:>9,.0f}/s"
              f"  per CPU-s {r['records_per_cpu_s']:>9,.0f} (last 30% {r['tail_records_per_cpu_s']:,.0f})"
              f"  peak RSS {r['peak_rss_mb']:>6.0f} MB  store {r['store_bytes_per_record']:>6.1f} B/record"
              f" ({r['with_wal_bytes_per_record']:.1f} with the WAL before close)"
              f"  {r['correct']['detail']}", file=sys.stderr, flush=True)
    base, cpu_base = rows[0]["records_per_s"], rows[0]["records_per_cpu_s"]
    # Both ratios: on this shared machine the wall-clock one moves with other load
    # between the cases (docs/bench.md, "Long runs"); the per-CPU-second one much less.
    cpu_ratios = [r["records_per_cpu_s"] / cpu_base for r in rows]
    print("ratio to the first size: " + ", ".join(
        f"{r['records']:,}: {r['records_per_s'] / base:.2f} wall, {c:.2f} per CPU-s"
        for r, c in zip(rows, cpu_ratios, strict=True)), file=sys.stderr, flush=True)
    print(json.dumps({"rows": rows, "rate_ratio_to_first": [r["records_per_s"] / base for r in rows],
                      "cpu_rate_ratio_to_first": cpu_ratios, "loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main(sys.argv[1:])
