"""Rescale time for N keys: how long a computation's ranges pause, and the whole call.

A store is filled through the store protocol (bench/cases/savepoint.py's ``fill``) with
one window-count computation of FROM key ranges and ``keys`` keys: 64 bytes of state,
one timer and one consumed record ID each. A real controller process on that store (no
workers: the rescale fences every range all the same) is asked to rescale it to TO
ranges over gRPC (``RescaleComputation``). Measured: the answer's ``pause_us`` (every
range of the computation is fenced for that long, one pause, not one per range), the
call's wall time at the client, what moved (keys, timers, consumed IDs written:
every old range's IDs go into every new range, so TO x keys), and the longest a
ClusterStatus call took while the rescale ran (asked every 0.1 s from a second client:
it takes the controller's lock, as every worker's heartbeat does, so it is the longest
a heartbeat would have waited).

    python -m bench.cases.rescale [KEYS] [STORE] [FROM] [TO]   # STORE: sqlite (default), redis
    python -m bench.cases.rescale grid [STORE]                 # 10k and 100k keys, 2->8 and 8->3
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.cases.savepoint import controller, fill, poll_status
from bench.harness import private_store

GRID = [(10_000, 2, 8), (10_000, 8, 3), (100_000, 2, 8), (100_000, 8, 3)]


def run(keys: int, kind: str, old: int, new: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mw-bench-rescale-") as d:
        tmp = Path(d)
        url, server = private_store(kind, tmp)
        try:
            fill(url, keys, old)
            proc, client = controller(url, tmp, "ctl")
            try:
                client.timeout_s = 3600
                waits: list[float] = []
                done = threading.Event()
                poller = threading.Thread(target=poll_status, args=(client.address, done, waits))
                poller.start()
                started = time.monotonic()
                try:
                    resp = client.rescale("counts", new)
                finally:
                    wall_s = time.monotonic() - started
                    done.set()
                    poller.join()
            finally:
                client.close()
                proc.kill()
                proc.wait()
        finally:
            if server is not None:
                server.stop()
        assert resp.changed and resp.keys == keys, (resp.keys, keys)
        return {"keys": keys, "store": kind, "from": old, "to": new, "pause_s": round(resp.pause_us / 1e6, 3),
                "wall_s": round(wall_s, 3), "timers": resp.timers, "consumed_ids_written": resp.consumed_ids,
                "pause_s_per_million_keys": round(resp.pause_us / keys, 2),
                "status_calls": len(waits), "status_max_s": round(max(waits, default=0.0), 3),
                "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "grid":
        kind = sys.argv[2] if len(sys.argv) > 2 else "sqlite"
        for keys, old, new in GRID:
            print(json.dumps(run(keys, kind, old, new)), flush=True)
        return
    keys = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    kind = sys.argv[2] if len(sys.argv) > 2 else "sqlite"
    old = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    new = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    print(json.dumps(run(keys, kind, old, new), indent=2))


if __name__ == "__main__":
    main()
