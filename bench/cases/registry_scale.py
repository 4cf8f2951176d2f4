"""Registry size vs the control plane: heartbeat latency, worker RSS, ClusterStatus, flaps.

A controller and two workers run as separate processes on one store. One case
registers either ``ranges`` key ranges (computations of at most 4,096 ranges each,
``window_aggregate`` over one injector's stream) or ``computations`` computations of
one range each whose user code carries ``params_bytes`` of parameters (a class in a
module written to a temp dir, allowed by ``--allow-code``), in one RegisterTopology
(timed). It then waits until every range is owned by a live worker, and for
``steady_s`` seconds samples:

* heartbeat latency: a probe heartbeats as a draining worker (it is given no range)
  every 0.2 s, exactly as a worker would (its known registry version, and the newer
  incremental fields and the registry as changes where the stubs have them); p50/p95
  of the RPC's time;
* ClusterStatus: its time, every second;
* each worker's RSS (``/proc/PID/status``), the maximum seen;
* flaps: the controller's "declared dead" log lines over the whole case, and the
  ClusterStatus samples with a worker not alive.

``--root`` runs the processes from another checkout (the same case "before" a
change: ``python -m bench.cases.registry_scale --root /work/main``); the probe adapts to
the stubs of this checkout, and an older controller ignores fields it does not know.

    python -m bench.cases.registry_scale [--root DIR] [--store sqlite] [--steady 20]
        [--ranges 512,2048,8192] [--computations 100,500]
``python -m bench --only registry`` runs 512/2048/8192 ranges and 100/500 computations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import grpc

from bench.harness import ROOT, free_port, private_store, wait_until
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

PER_COMPUTATION = 4096
CODE = '''
from millwheel.computation import Computation


class Padded(Computation):
    """Carries large params; does nothing with them."""

    def __init__(self, **params):
        self.params = params
'''


def _specs(ranges: int, computations: int, params_bytes: int) -> tuple[list[ComputationSpec], list[tuple[str, str]]]:
    if ranges:
        n = math.ceil(ranges / PER_COMPUTATION)
        sizes = [PER_COMPUTATION] * (n - 1) + [ranges - PER_COMPUTATION * (n - 1)]
        return [ComputationSpec(f"agg{i}", (InputSpec("events"),), (f"agg{i}_out",),
                                CodeRef("window_aggregate", {"size_us": 1_000_000}), Options(key_ranges=size))
                for i, size in enumerate(sizes)], [("events", "events")]
    pad = "x" * max(0, params_bytes - 64)
    return [ComputationSpec(f"c{i}", (InputSpec("events"),), (f"c{i}_out",),
                            CodeRef("regscale_code:Padded", {"pad": pad}), Options(key_ranges=1))
            for i in range(computations)], [("events", "events")]


class Probe:
    """Heartbeats as a draining worker (never assigned a range) and times each call."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 1 << 30)])
        self.stub = pb_grpc.ClusterStub(self.channel)
        self.topology_version = 0
        self.assignments_version = 0
        self.assignments_epoch = 0
        self.latencies: list[float] = []
        self.failures = 0
        self.bytes: list[int] = []
        fields = pb.HeartbeatRequest.DESCRIPTOR.fields_by_name
        self.incremental = "incremental" in fields
        self.deltas = "topology_deltas" in fields  # the registry as changes, as a current worker asks

    def once(self) -> None:
        req = pb.HeartbeatRequest(worker_id="bench-probe", address="127.0.0.1:1", draining=True,
                                  known_topology_version=self.topology_version)
        if self.deltas:
            req.topology_deltas = True
        if self.incremental:
            req.incremental = True
            req.known_assignments_version = self.assignments_version
            req.known_assignments_epoch = self.assignments_epoch
        t = time.monotonic()
        try:
            resp = self.stub.Heartbeat(req, timeout=10)
        except grpc.RpcError:
            self.failures += 1
            return
        self.latencies.append((time.monotonic() - t) * 1000)
        self.bytes.append(resp.ByteSize())
        self.topology_version = resp.topology_version
        if self.incremental:
            self.assignments_version = resp.assignments_version
            self.assignments_epoch = resp.assignments_epoch


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


def case(ranges: int = 0, computations: int = 0, params_bytes: int = 64 * 1024, store: str = "sqlite",
         steady_s: float = 20.0, settle_timeout_s: float = 600.0, root: str | None = None) -> dict[str, Any]:
    code_root = Path(root or ROOT)
    with tempfile.TemporaryDirectory(prefix="mw-bench-reg-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "regscale_code.py").write_text(CODE)
        url, server = private_store(store, tmp)
        port = free_port()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")},
               "PYTHONPATH": f"{code_root}:{tmp}"}
        procs: list[subprocess.Popen[bytes]] = []

        def spawn(name: str, args: list[str]) -> None:
            with open(tmp / f"{name}.log", "ab") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "services.cli", *args, "--log-level", "WARNING"], cwd=code_root, env=env,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        client = ControllerClient(f"127.0.0.1:{port}", timeout_s=600, security=Security())
        out: dict[str, Any] = {"ranges": ranges, "computations": computations, "store": store,
                               "params_bytes": params_bytes if computations else 0, "root": str(code_root)}
        try:
            spawn("controller", ["controller", "--store", url, "--port", str(port), "--metrics-port", "-1",
                                 "--allow-code", "regscale_code.*"])
            _wait(lambda: client.status() is not None, "the controller", 60)
            for i in range(2):
                spawn(f"worker{i}", ["worker", "--store", url, "--controller", f"127.0.0.1:{port}", "--port", "0",
                                     "--metrics-port", "-1", "--allow-code", "regscale_code.*"])
            _wait(lambda: sum(w.alive for w in client.status().workers) == 2, "the workers", 60)
            comps, injectors = _specs(ranges, computations, params_bytes)
            t = time.monotonic()
            client.register_topology([spec_to_proto(c) for c in comps], injectors)
            out["register_s"] = round(time.monotonic() - t, 2)
            t = time.monotonic()
            want = sum(c.options.key_ranges for c in comps) + len(injectors)

            rss = {i: 0.0 for i in range(2)}

            def settled() -> bool:
                for i in range(2):
                    rss[i] = max(rss[i], _rss_mb(procs[1 + i].pid))
                st = client.status()
                alive = {w.worker_id for w in st.workers if w.alive}
                owned = sum(1 for r in st.ranges if r.worker_id in alive)
                return owned >= want and len(st.ranges) >= want
            _wait(settled, "every range owned by a live worker", settle_timeout_s)
            out["settle_s"] = round(time.monotonic() - t, 2)
            probe = Probe(f"127.0.0.1:{port}")
            stop = threading.Event()
            status_ms: list[float] = []
            not_alive = [0]
            status_failures = [0]

            def sample_status() -> None:
                while not stop.wait(1.0):
                    t0 = time.monotonic()
                    try:
                        st = client.status()
                    except Exception:  # noqa: BLE001 - counted
                        status_failures[0] += 1
                        continue
                    status_ms.append((time.monotonic() - t0) * 1000)
                    not_alive[0] += sum(not w.alive for w in st.workers if w.worker_id != "bench-probe")
                    for i in range(2):
                        rss[i] = max(rss[i], _rss_mb(procs[1 + i].pid))
            sampler = threading.Thread(target=sample_status, daemon=True)
            sampler.start()
            end = time.monotonic() + steady_s
            while time.monotonic() < end:
                probe.once()
                time.sleep(0.2)
            stop.set()
            sampler.join(30)
            probe.channel.close()
            controller_log = (tmp / "controller.log").read_text(errors="replace")
            worker_logs = "".join((tmp / f"worker{i}.log").read_text(errors="replace") for i in range(2))
            out.update({
                "heartbeat_p50_ms": _pct(probe.latencies, 0.5), "heartbeat_p95_ms": _pct(probe.latencies, 0.95),
                "heartbeat_failures": probe.failures,
                "heartbeat_response_bytes_p50": int(statistics.median(probe.bytes)) if probe.bytes else None,
                "status_p50_ms": _pct(status_ms, 0.5), "status_max_ms": _pct(status_ms, 1.0),
                "status_failures": status_failures[0],
                "worker_rss_mb_max": round(max(rss.values()), 1),
                "declared_dead": len(re.findall(r"declared dead", controller_log)),
                "worker_heartbeat_failed_lines": len(re.findall(r"heartbeat to controller failed", worker_logs)),
                "not_alive_samples": not_alive[0],
                "flapped": bool(re.search(r"declared dead", controller_log)) or not_alive[0] > 0,
            })
        finally:
            client.close()
            for p in procs:
                p.kill()
                p.wait(10)
            if server is not None:
                server.stop()
    return out


def section(results: list[dict[str, Any]], run_case: Callable[..., Any], ranges: tuple[int, ...] = (512, 2048, 8192),
            computations: tuple[int, ...] = (100, 500), **kw: Any) -> None:
    for n in ranges:
        run_case(results, f"registry {n} ranges", {"case": "registry_scale", "ranges": n}, case, ranges=n,
                 summary=_summary, **kw)
    for n in computations:
        run_case(results, f"registry {n} computations x 64 KiB params", {"case": "registry_scale", "computations": n},
                 case, computations=n, summary=_summary, **kw)


def _summary(r: dict[str, Any]) -> str:
    return (f"register {r['register_s']} s, settle {r['settle_s']} s, heartbeat p50 {r['heartbeat_p50_ms']} ms "
            f"p95 {r['heartbeat_p95_ms']} ms, status p50 {r['status_p50_ms']} ms, worker RSS "
            f"{r['worker_rss_mb_max']} MB, flapped {r['flapped']}")


def _wait(pred: Callable[[], bool], what: str, timeout_s: float) -> None:
    wait_until(pred, what, timeout_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=None, help="checkout the processes run from (default: this one)")
    ap.add_argument("--store", default="sqlite")
    ap.add_argument("--steady", type=float, default=20.0)
    ap.add_argument("--ranges", default="512,2048,8192")
    ap.add_argument("--computations", default="100,500")
    ap.add_argument("--params-bytes", type=int, default=64 * 1024)
    ap.add_argument("--settle-timeout", type=float, default=600.0)
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    plan = [{"ranges": int(n)} for n in args.ranges.split(",") if n] + \
        [{"computations": int(n)} for n in args.computations.split(",") if n]
    for p in plan:
        try:
            r = case(**p, params_bytes=args.params_bytes, store=args.store, steady_s=args.steady,
                     settle_timeout_s=args.settle_timeout, root=args.root)
        except Exception as exc:  # noqa: BLE001 - recorded, the next size runs
            r = {**p, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(r), flush=True)
        runs.append(r)


if __name__ == "__main__":
    main()
