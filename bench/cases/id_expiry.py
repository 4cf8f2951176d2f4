"""``python -m bench.cases.id_expiry [--batches N] [--batch B] [--retention-batches R]
[--rounds K] [--stores sqlite,redis] TREE ...``: what remembering and forgetting consumed
record IDs costs a store at a steady rate (issue 31 target 4).

A soak at half the measured capacity (bench/results, c51bd8e) held for four minutes and
then fell behind from the moment consumed IDs reached their retention: each range
then forgets as many IDs as it remembers. This case isolates that: one key range,
``--batches`` checkpoints of ``--batch`` fresh record IDs (40 hex digits, as
``derive_record_id`` makes), one per simulated second, and every 60 simulated seconds
an ``expire_ids`` of what is older than ``--retention-batches`` seconds, as a range
worker does (``ids_generation`` as the worker gives it, on trees that have it). It
reports µs of store time per ID while the retention fills (inserts only) and once it
is full (inserts + expiry), and their ratio: 1.0 means forgetting is free.

A TREE is a directory holding a copy of the project (``git archive COMMIT | tar -x -C
TREE``) or this checkout; each run is a fresh process of that tree, rounds interleaved
(the order reversed every other round). Redis runs use one private redis-server (no
persistence), flushed before each run.
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

_CASE = r"""
import dataclasses, json, secrets, sys, tempfile, time
from millwheel.state.url import open_store
from millwheel.state.protocol import Checkpoint
url, batches, batch, retention = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if url == "sqlite":
    url = f"sqlite:///{tempfile.mkdtemp()}/ids.db"
gens = "ids_generation" in {f.name for f in dataclasses.fields(Checkpoint)}
s = open_store(url)
tok = s.acquire("c", 0)
second, width = 1_000_000, max(1, retention * 1_000_000 // 16)
spent = {"fill": 0.0, "steady": 0.0}
count = {"fill": 0, "steady": 0}
for b in range(batches):
    ids = [secrets.token_hex(20) for _ in range(batch)]
    now = (b + 1) * second
    extra = {"ids_generation": now - now % width} if gens else {}
    t0 = time.perf_counter()
    s.checkpoint(Checkpoint("c", 0, tok, now, consumed_ids=ids, **extra))
    if b % 60 == 59:
        s.expire_ids("c", 0, tok, now - retention * second)
    phase = "fill" if b < retention + 60 else "steady"
    spent[phase] += time.perf_counter() - t0
    count[phase] += batch
left = len(set(s.iter_ids("c", 0)))
s.close()
print(json.dumps({p: spent[p] / max(1, count[p]) * 1e6 for p in spent} | {"retained": left}))
"""


def run(tree: Path, url: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", _CASE, url, str(args.batches), str(args.batch), str(args.retention_batches)],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cases.id_expiry", description=__doc__.split("\n\n")[1])
    p.add_argument("trees", nargs="*", type=Path, default=[ROOT],
                   help="project copies to compare (default: this checkout)")
    p.add_argument("--batches", type=int, default=600, help="checkpoints (simulated seconds) per run")
    p.add_argument("--batch", type=int, default=500, help="record IDs per checkpoint")
    p.add_argument("--retention-batches", type=int, default=200, help="retention in simulated seconds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stores", default="sqlite,redis", help="comma-separated: sqlite, redis")
    args = p.parse_args(argv)
    if args.batches <= args.retention_batches + 60:
        p.error("--batches must exceed --retention-batches + 60 (else nothing is ever steady)")
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    server = None
    if "redis" in stores:
        sys.path.insert(0, str(ROOT))
        from tests.support.redis_server import RedisServer

        server = RedisServer()
        server.start()
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for rnd in range(args.rounds):
            order = args.trees if rnd % 2 == 0 else list(reversed(args.trees))
            for store in stores:
                for tree in order:
                    if store == "redis":
                        assert server is not None
                        __import__("redis").Redis(port=server.port).flushall()
                    r = run(tree, "sqlite" if store == "sqlite" else server.url, args)  # type: ignore[union-attr]
                    results.setdefault((store, str(tree)), []).append(r)
                    print(f"round {rnd + 1} {store:6} {tree}: fill {r['fill']:.2f} us/ID, "
                          f"steady {r['steady']:.2f} us/ID, retained {r['retained']}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    print("store   tree                              fill us/ID  steady us/ID  steady/fill")
    for (store, tree), rs in results.items():
        fill = statistics.median(r["fill"] for r in rs)
        steady = statistics.median(r["steady"] for r in rs)
        print(f"{store:7} {tree[-32:]:33} {fill:10.2f}  {steady:12.2f}  {steady / fill:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
