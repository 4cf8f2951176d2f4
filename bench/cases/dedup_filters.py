"""``python -m bench.cases.dedup_filters [--minutes M] [--rate R] [--retention-s S]
[--rounds K] TREE ...``: the memory and lookup cost of a range's record-ID Bloom filters
over a long run (issue 31 target 4: RSS flat for an hour).

A 20-minute soak's worker stepped up by 57 MB between minutes 8 and 13 and stayed
there. This case isolates the filters: one key range on a SQLite store, ``--rate``
fresh record IDs a simulated second (40 hex digits, as ``derive_record_id`` makes),
checkpointed in the generation a range worker gives them, an expiry pass each
simulated minute, for ``--minutes``. It reports the filters' bytes (rbloom's bit
arrays) each minute, their mean and largest over the run's second half against the
IDs the store retains, how many rebuilds the run took, and µs per ID of ``seen``
(the lookup every batch makes). A TREE is a copy of the project (``git archive COMMIT
| tar -x -C TREE``) or this checkout; each run is a fresh process, rounds interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

_CASE = r"""
import inspect, json, secrets, sys, tempfile, time
from millwheel.dedup import Deduplicator
from millwheel.state.protocol import Checkpoint
from millwheel.state.url import open_store
minutes, rate, retention_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
s = open_store(f"sqlite:///{tempfile.mkdtemp()}/ids.db")
tok = s.acquire("c", 0)
second = 1_000_000
retention, width = retention_s * second, retention_s * second // 16
generational = "forget_expired" in dir(Deduplicator)
d = (Deduplicator(s, "c", 0, retention // 4) if generational else Deduplicator(s, "c", 0))

def filter_bytes():
    if generational:
        blooms = [f for b in d._buckets.values() for f in b.bloom._filters]
    else:
        blooms = d._bloom._filters
    return sum(f.size_in_bits for f in blooms) // 8

series, seen_s, seen_n = [], 0.0, 0
for t in range(1, minutes * 60 + 1):
    now = t * second
    gen = now - now % width
    ids = [secrets.token_hex(20) for _ in range(rate)]
    t0 = time.perf_counter()
    d.seen(ids)
    seen_s += time.perf_counter() - t0
    seen_n += len(ids)
    s.checkpoint(Checkpoint("c", 0, tok, now, consumed_ids=ids, ids_generation=gen))
    d.remember(ids, gen) if generational else d.remember(ids)
    if t % 60 == 0:
        removed = s.expire_ids("c", 0, tok, now - retention)
        if generational:
            if removed:
                d.forget_expired(now - retention)
        else:
            d.expired(removed)
        series.append({"minute": t // 60, "filter_bytes": filter_bytes(), "held": d.held})
retained = sum(1 for _ in s.iter_ids("c", 0))
s.close()
print(json.dumps({"series": series, "retained": retained, "rebuilds": d.rebuilds,
                  "seen_us_per_id": seen_s / seen_n * 1e6}))
"""


def run_tree(tree: Path, minutes: int, rate: int, retention_s: int) -> dict[str, Any]:
    python = tree / ".venv" / "bin" / "python"
    if not python.exists():
        python = Path(sys.executable)
    out = subprocess.run([str(python), "-c", _CASE, str(minutes), str(rate), str(retention_s)],
                         cwd=tree, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    late = result["series"][len(result["series"]) // 2:]
    sizes = [p["filter_bytes"] for p in late]
    result["second_half_mb"] = {"mean": statistics.mean(sizes) / 1e6, "max": max(sizes) / 1e6,
                                "min": min(sizes) / 1e6}
    result["bytes_per_retained_id"] = statistics.mean(sizes) / max(1, result["retained"])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", type=Path, help="project copies to compare (or this checkout)")
    ap.add_argument("--minutes", type=int, default=30, help="simulated minutes (default 30)")
    ap.add_argument("--rate", type=int, default=2_000, help="IDs per simulated second (default 2,000)")
    ap.add_argument("--retention-s", type=int, default=300, help="ID retention in seconds (default 300)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write every run's result here")
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {str(t): [] for t in args.trees}
    for r in range(args.rounds):
        order = args.trees if r % 2 == 0 else list(reversed(args.trees))
        for tree in order:
            res = run_tree(tree.resolve(), args.minutes, args.rate, args.retention_s)
            runs[str(tree)].append(res)
            h = res["second_half_mb"]
            print(f"{tree}: filters {h['min']:.1f}-{h['max']:.1f} MB (mean {h['mean']:.1f}) over the second half "
                  f"for {res['retained']:,} retained IDs ({res['bytes_per_retained_id']:.2f} B/ID), "
                  f"{res['rebuilds']} rebuilds, seen {res['seen_us_per_id']:.3f} us/ID", flush=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
