"""One client holding many streams: what the rest of the service sees.

A controller (listening on ``localhost``: 127.0.0.1 and [::1]) and two workers run as
separate processes on one store. A canary pipeline (inject -> window_aggregate, 1 s
tumbling count -> logged sink) gets ``records`` records injected as fast as the
service takes them, ``done`` at the end; its time is inject start -> the sink's
watermark at the end, every window checked exact. It runs, in turn:

- **alone**;
- while one other client (on [::1], another host as the controller sees it) holds
  ``held`` follow-mode ``Subscribe`` streams on the canary's own sink (they read every
  row too);
- while that client holds ``held`` ``Inject`` streams that send nothing.

Meanwhile ClusterStatus is sampled every 0.2 s: its latency, and any worker not alive.
Before the Cluster service had its own listener and client calls were admitted,
either of the held sets filled the controller's 32-thread pool and both workers were
declared dead (tests/integration/test_service_admission.py reproduces it); the canary
could not run at all.

    python -m bench.cases.admission [RUNS] [STORE] [RECORDS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import grpc

from bench.harness import ROOT, free_port, private_store, wait_until
from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.client import ControllerClient, inject_messages
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.rpc.controller_link import await_start
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

SECOND = 1_000_000
BASE_US = 1_700_000_000 * SECOND


class Sampler:
    def __init__(self, address: str) -> None:
        self.client = ControllerClient(address, timeout_s=5, security=Security(), failover_s=0)
        self.latencies: list[float] = []
        self.failures = 0
        self.not_alive = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            t = time.monotonic()
            try:
                workers = self.client.status().workers
            except Exception:  # noqa: BLE001 - counted
                self.failures += 1
                continue
            self.latencies.append((time.monotonic() - t) * 1000)
            self.not_alive += sum(not w.alive for w in workers) + max(0, 2 - len(workers))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        self.client.close()
        lat = sorted(self.latencies)
        return {"status_p50_ms": round(statistics.median(lat), 1) if lat else None,
                "status_max_ms": round(lat[-1], 1) if lat else None,
                "status_failures": self.failures, "workers_not_alive_samples": self.not_alive}


def _canary(client: ControllerClient, name: str, n: int) -> float:
    """Register, inject, wait for every window; the seconds it took (windows checked)."""
    out = f"{name}_counts"
    client.register_injector(name, name)
    client.register_computation(spec_to_proto(ComputationSpec(
        out, (InputSpec(name),), (out,), CodeRef("window_aggregate", {"size_us": SECOND}),
        Options(key_ranges=2))), [out])
    records = [Record(f"k{i % 20}", b"1", BASE_US + i * 2_000, f"{name}-{i}") for i in range(n)]
    t0 = time.monotonic()
    client.inject(inject_messages(name, name, records, 500, 0, done=True))
    while not (wm := client.watermarks(out)) or wm[0].low_watermark < MAX_TIMESTAMP:
        if time.monotonic() - t0 > 600:
            raise RuntimeError(f"canary {name}: no final watermark in 600 s")
        time.sleep(0.02)
    took = time.monotonic() - t0
    got: Counter[tuple[str, int]] = Counter()
    for _seq, rec in client.subscribe(out):
        w = json.loads(rec.value)
        got[(rec.key, w["start"])] += w["count"]
    want = Counter((r.key, r.timestamp - (r.timestamp - BASE_US) % SECOND) for r in records)
    if got != want:
        raise RuntimeError(f"canary {name}: windows differ from the expected ones")
    return took


class _Silent:
    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def __iter__(self) -> Iterator[Any]:
        self.release.wait(600)
        return
        yield


def admission(runs: int = 3, store: str = "sqlite", records: int = 20_000, held: int = 48) -> dict[str, Any]:
    phases: dict[str, list[dict[str, Any]]] = {"alone": [], "subscribes": [], "idle_injects": []}
    with tempfile.TemporaryDirectory(prefix="mw-bench-adm-") as tmpdir:
        tmp = Path(tmpdir)
        url, server = private_store(store, tmp)
        port = free_port()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}, "PYTHONPATH": str(ROOT)}
        procs: list[subprocess.Popen[bytes]] = []

        def spawn(name: str, args: list[str]) -> None:
            with open(tmp / f"{name}.log", "ab") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", *args, "--log-level", "WARNING"],
                                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        client = ControllerClient(f"127.0.0.1:{port}", timeout_s=10, security=Security())
        other = grpc.insecure_channel(f"[::1]:{port}")
        try:
            spawn("controller", ["controller", "--store", url, "--host", "localhost", "--port", str(port),
                                 "--metrics-port", "-1", "--max-client-streams", str(held)])
            _wait(lambda: client.status() is not None, "the controller")
            for i in range(2):
                spawn(f"worker{i}", ["worker", "--store", url, "--controller", f"127.0.0.1:{port}",
                                     "--port", "0", "--metrics-port", "-1"])
            _wait(lambda: sum(w.alive for w in client.status().workers) == 2, "the workers")
            stub = pb_grpc.ControllerStub(other)
            for run in range(runs):
                for phase in phases:
                    release = threading.Event()
                    calls: list[Any] = []
                    if phase == "subscribes":
                        calls = [stub.Subscribe(pb.SubscribeRequest(stream=f"r{run}alone_counts", follow=True))
                                 for _ in range(held)]
                    elif phase == "idle_injects":
                        calls = [stub.Inject.future(iter(_Silent(release))) for _ in range(held)]
                    for call in calls:
                        await_start(call, "controller", 10)
                    sampler = Sampler(f"127.0.0.1:{port}")
                    try:
                        took = _canary(client, f"r{run}{phase.replace('_', '')}", records)
                    finally:
                        figures = sampler.stop()
                        release.set()
                        for call in calls:
                            call.cancel()
                    phases[phase].append({"seconds": round(took, 3), "records_per_s": round(records / took),
                                          **figures})
        finally:
            other.close()
            client.close()
            for p in procs:
                p.kill()
                p.wait(10)
            if server is not None:
                server.stop()
    return {"store": store, "records": records, "held": held, "runs": runs, "phases": phases,
            "median_records_per_s": {k: statistics.median(r["records_per_s"] for r in v) for k, v in phases.items()}}


def _wait(pred: Any, what: str, timeout_s: float = 30) -> None:
    wait_until(pred, what, timeout_s, poll_s=0.05)


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(admission(int(args[0]) if args else 3, args[1] if len(args) > 1 else "sqlite",
                               int(args[2]) if len(args) > 2 else 20_000), indent=2))
