"""Checkpointed throughput of the Redis store against the SQLite store, same run.

One window_aggregate stage (10 s tumbling count, exactly-once on, strong
productions, 4 key ranges) fed by an in-memory source through ``LocalRunner``: every
batch is deduplicated, processed and checkpointed, so the figure is records/s of
exactly-once work including the store round trips. Both backends get the same seeded
workload and must produce the same windows (checked).

    .venv/bin/python bench/cases/redis_vs_sqlite.py [--records N] [--keys K] [--redis URL]

Without ``--redis`` it starts its own redis-server (AOF on) on a free port, once with
``appendfsync everysec`` and once with ``always``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from millwheel.record import Record  # noqa: E402
from millwheel.runtime.local_runner import LocalRunner  # noqa: E402
from millwheel.sources import ListSource  # noqa: E402
from millwheel.state import open_store  # noqa: E402
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology  # noqa: E402

SECOND = 1_000_000


def workload(n: int, keys: int, seed: int) -> list[Record]:
    rng = random.Random(seed)
    start = 1_700_000_000 * SECOND
    return [
        Record(f"q{rng.randrange(keys)}", b"1", start + i * 5_000 + rng.randrange(SECOND), f"r{i}")
        for i in range(n)
    ]


def topology() -> Topology:
    return Topology(
        computations=(ComputationSpec(
            "counts", (InputSpec("queries"),), ("windows",),
            CodeRef("window_aggregate", {"size_us": 10 * SECOND}), Options(key_ranges=4),
        ),),
        injectors=(InjectorSpec("queries", "queries"),),
    )


def measure(url: str, records: list[Record], batch_size: int) -> tuple[float, list[tuple[str, bytes]]]:
    store = open_store(url)
    try:
        runner = LocalRunner(topology(), store, {"queries": ListSource(records, SECOND)},
                             batch_size=batch_size)
        started = time.perf_counter()
        runner.run()
        elapsed = time.perf_counter() - started
        windows = sorted((r.key, r.value) for _s, r in store.read_log("windows", 0, 10**9))
    finally:
        store.close()
    return len(records) / elapsed, windows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--batch-size", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--redis", help="use this Redis URL instead of starting redis-server")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    records = workload(args.records, args.keys, args.seed)
    results: dict[str, float] = {}
    reference: list[tuple[str, bytes]] | None = None
    with tempfile.TemporaryDirectory(prefix="mw-bench-") as tmp:
        cases = [
            ("sqlite synchronous=NORMAL", f"sqlite:///{tmp}/normal.db"),
            ("sqlite synchronous=FULL", f"sqlite:///{tmp}/full.db?synchronous=FULL"),
        ]
        servers = []
        if args.redis:
            cases.append(("redis (given)", args.redis + ("&" if "?" in args.redis else "?") + "prefix=bench"))
        else:
            from tests.support.redis_server import RedisServer

            for fsync in ("everysec", "always"):
                server = RedisServer(appendonly=True, appendfsync=fsync)
                servers.append(server)
                cases.append((f"redis appendfsync={fsync}", server.url))
        try:
            for name, url in cases:
                rate, windows = measure(url, records, args.batch_size)
                if reference is None:
                    reference = windows
                elif windows != reference:
                    print(f"{name}: OUTPUT DIFFERS from {cases[0][0]}", file=sys.stderr)
                    return 1
                results[name] = rate
                if not args.json:
                    print(f"{name:<28} {rate:>10,.0f} records/s", flush=True)
        finally:
            for server in servers:
                server.stop()
    if args.json:
        print(json.dumps({"records": args.records, "keys": args.keys, "records_per_s": results}))
    else:
        print(f"({args.records:,} records, {args.keys:,} keys, batch {args.batch_size}, "
              f"{len(reference or [])} windows, outputs identical on every backend)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
