"""``python -m bench.cases.redis_ab [--records N] [--rounds R] [--batch B] TREE ...``: the
single-stage backlog case (EO + strong productions) on Redis with AOF everysec and on
SQLite, run from several source trees, interleaved, each run a fresh process, with
the raw Lua checkpoint limit (``bench.cases.limits.redis_lua_checkpoint``, batch 1000, depth
1) measured in the same rounds: the before/after check of a change to the Redis store.

A TREE is a directory holding a copy of the project at some commit (``git archive
COMMIT | tar -x -C TREE``), or this checkout. One redis-server (AOF everysec, own port
and data directory) serves every Redis run; it is flushed before each. Each round runs
the trees in order, reversed every other round (the machine's load drifts). Every
run's output is checked exactly (``bench.workload.check``); a wrong output stops the
bench. Prints each run, then per tree the medians, Redis / SQLite of the same round,
and Redis / the Lua limit of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CASE = """
import json, sys
from bench.run_local import WorkloadArgs, backlog_case
r = backlog_case(WorkloadArgs({n}, 1000, "uniform"), "single", {url!r}, True, "strong", {batch})
print(json.dumps({{"rate": r["records_per_s"], "cpu": r["records_per_cpu_s"], "correct": r["correct"]}}))
"""

_LIMIT = """
import json
from bench.cases import limits
from bench.workload import generate
r = limits.redis_lua_checkpoint({url!r}, generate(20_000), 1000, 1, {seconds})
print(json.dumps({{"rate": r["records_per_s"]}}))
"""


def _run(tree: str, code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=tree))
    if out.returncode != 0:
        raise SystemExit(f"{tree}: failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.splitlines()[-1]))


def _flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cases.redis_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=5000, help="the runner's batch size")
    ap.add_argument("--limit-seconds", type=float, default=3.0)
    ap.add_argument("--no-sqlite", action="store_true", help="Redis runs only")
    ap.add_argument("trees", nargs="*", default=[str(ROOT)])
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.support.redis_server import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="mw-redis-ab-"))
    (tmp / "redis").mkdir()
    server = RedisServer(appendonly=True, appendfsync="everysec", data_dir=tmp / "redis")
    runs: dict[tuple[str, str], list[dict[str, object]]] = {}
    limit: list[float] = []
    try:
        for i in range(args.rounds):
            _flush(server.url)
            limit.append(float(_run(str(ROOT), _LIMIT.format(url=server.url, seconds=args.limit_seconds))["rate"]))
            print(i, "lua limit", round(limit[-1]), flush=True)
            for tree in args.trees if i % 2 == 0 else args.trees[::-1]:
                stores = [("redis", server.url)]
                if not args.no_sqlite:
                    stores.append(("sqlite", f"sqlite:///{tmp}/{sum(map(len, runs.values()))}.db"))
                for kind, url in stores if i % 2 == 0 else stores[::-1]:
                    if kind == "redis":
                        _flush(url)
                    r = _run(tree, _CASE.format(n=args.records, url=url, batch=args.batch))
                    correct = r["correct"]
                    assert isinstance(correct, dict)
                    if not correct["ok"]:
                        raise SystemExit(f"{tree} {kind}: output wrong: {correct['detail']}")
                    runs.setdefault((tree, kind), []).append(r)
                    print(i, tree, kind, round(float(r["rate"])), "per CPU-s", round(float(r["cpu"])),
                          "exact", flush=True)
    finally:
        server.stop()
    lim = statistics.median(limit)
    print(f"lua limit (AOF everysec, batch 1000, depth 1): median {lim:,.0f} "
          f"[{', '.join(f'{x:,.0f}' for x in limit)}]")
    for tree in args.trees:
        redis_rates = [float(r["rate"]) for r in runs[(tree, "redis")]]
        line = (f"{tree}: redis median {statistics.median(redis_rates):,.0f} "
                f"[{', '.join(f'{x:,.0f}' for x in redis_rates)}] per CPU-s "
                f"{statistics.median(float(r['cpu']) for r in runs[(tree, 'redis')]):,.0f}; "
                f"/ lua limit {statistics.median(a / b for a, b in zip(redis_rates, limit, strict=True)):.2f}")
        if not args.no_sqlite:
            sq = [float(r["rate"]) for r in runs[(tree, "sqlite")]]
            ratios = [a / b for a, b in zip(redis_rates, sq, strict=True)]
            line += (f"; sqlite median {statistics.median(sq):,.0f} [{', '.join(f'{x:,.0f}' for x in sq)}]; "
                     f"redis / sqlite per round {', '.join(f'{x:.2f}' for x in ratios)}"
                     f" (median {statistics.median(ratios):.2f})")
        print(line)
    print("loadavg", os.getloadavg())
    return 0


if __name__ == "__main__":
    sys.exit(main())
