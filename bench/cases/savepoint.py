"""Savepoint create and restore time and file size for N keys.

A store is filled through the store protocol with one computation (8 key ranges) of
``keys`` keys: 64 bytes of state, one timer and one consumed record ID each. A real
controller process (no workers: the cut fences every range all the same) on that
SQLite store takes a savepoint over gRPC (``CreateSavepoint``: its summary's
``pause_us`` is how long processing would pause); a second controller on a fresh store
of kind STORE restores it (``RestoreSavepoint``). Also measured: the longest a
ClusterStatus call took while the savepoint was taken (asked every 0.1 s from a second
client, as bench/cases/rescale.py does: it takes the controller's lock, as every
worker's heartbeat does, so it is the longest a heartbeat would have waited).

    python -m bench.cases.savepoint [KEYS] [STORE]     # STORE: sqlite (default), redis
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import ROOT, free_port, private_store
from millwheel.keys import key_range
from millwheel.record import TimeDomain, Timer
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options
from services.client import ControllerClient
from services.controller.registry import Registry
from services.generated import millwheel_pb2 as pb

RANGES = 8
CHUNK = 5000


def fill(url: str, keys: int, ranges: int = RANGES) -> None:
    """Register one window-count computation of ``ranges`` key ranges on the store at
    ``url`` and give it ``keys`` keys: 64 bytes of state, a timer, a consumed ID each."""
    store = open_store(url)
    try:
        spec = ComputationSpec("counts", (InputSpec("events"),), ("counts",),
                               CodeRef("window_aggregate", {"size_us": 1_000_000, "aggregation": "count"}),
                               Options(key_ranges=ranges))
        Registry(store).register_topology([spec], [InjectorSpec("events", "events")], ["counts"])
        by_range: dict[int, list[str]] = {}
        for i in range(keys):
            k = f"key-{i:09d}"
            by_range.setdefault(key_range(k, ranges), []).append(k)
        for r, ks in by_range.items():
            token = store.acquire("counts", r)
            for j in range(0, len(ks), CHUNK):
                part = ks[j:j + CHUNK]
                store.checkpoint(Checkpoint(
                    "counts", r, token, int(time.time() * 1e6), state_writes={k: os.urandom(32).hex().encode()
                                                                             for k in part},
                    timer_sets=[Timer(k, "end:1", 2_000_000_000, TimeDomain.EVENT, True) for k in part],
                    consumed_ids=[f"id-{k}" for k in part]))
    finally:
        store.close()


def poll_status(address: str, done: threading.Event, waits: list[float]) -> None:
    """ClusterStatus every 0.1 s until ``done``: how long each took."""
    with ControllerClient(address, timeout_s=3600) as other:
        while not done.wait(0.1):
            t = time.monotonic()
            other.status()
            waits.append(time.monotonic() - t)


def controller(url: str, tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], ControllerClient]:
    port = free_port()
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 (the process keeps it)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "controller", "--store", url,
                             "--port", str(port)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=log, stderr=subprocess.STDOUT)
    client = ControllerClient(f"127.0.0.1:{port}", timeout_s=10)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.status()
            return proc, client
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run(keys: int, kind: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mw-bench-savepoint-") as d:
        tmp = Path(d)
        src_url = f"sqlite:///{tmp}/src.db"
        fill(src_url, keys)
        path = tmp / "bench.mwsp"
        proc, client = controller(src_url, tmp, "src")
        try:
            waits: list[float] = []
            done = threading.Event()
            poller = threading.Thread(target=poll_status, args=(client.address, done, waits))
            poller.start()
            started = time.monotonic()
            summary = None
            try:
                with open(path, "wb") as out:
                    for msg in client.stub.CreateSavepoint(pb.CreateSavepointRequest()):
                        out.write(msg.chunk)
                        if msg.phase == "done":
                            summary = msg.summary
            finally:
                create_s = time.monotonic() - started
                done.set()
                poller.join()
        finally:
            client.close()
            proc.kill()
            proc.wait()
        assert summary is not None
        dst_url, server = private_store(kind, tmp)
        proc, client = controller(dst_url, tmp, "dst")
        try:
            started = time.monotonic()
            with open(path, "rb") as f:
                chunks = iter(lambda: f.read(1 << 20), b"")
                resp = client.stub.RestoreSavepoint(pb.RestoreSavepointRequest(chunk=c) for c in chunks)
            restore_s = time.monotonic() - started
        finally:
            client.close()
            proc.kill()
            proc.wait()
            if server is not None:
                server.stop()
        return {"keys": keys, "store": kind, "file_bytes": summary.bytes, "bytes_per_key": summary.bytes / keys,
                "create_s": round(create_s, 3), "cut_pause_s": round(summary.pause_us / 1e6, 3),
                "restore_s": round(restore_s, 3), "restored_ranges": resp.summary.counts.get("ranges", 0),
                "status_calls": len(waits), "status_max_s": round(max(waits, default=0.0), 3),
                "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> None:
    keys = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    kind = sys.argv[2] if len(sys.argv) > 2 else "sqlite"
    print(json.dumps(run(keys, kind), indent=2))


if __name__ == "__main__":
    main()
