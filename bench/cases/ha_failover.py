"""Controller failover as a user of the service sees it: how long after ``kill -9`` of
the leading controller does the next window result arrive? (Part of ``bench/cases/ha.py``.)

Two controllers (one leads, one stands by) and two workers run as separate processes
on one store (a private redis-server, AOF ``everysec``, or SQLite); client, workers
and controllers are given both controller addresses. The single-stage pipeline
(window_aggregate, 10 s tumbling count, exactly-once) gets records injected steadily
in 0.1 s messages, event time running ``speedup`` (20) times the wall clock, so a
window closes every 0.5 s. A reader follows the sink by ``Subscribe`` (resuming after
the last sequence number when its controller goes away).

After a warm-up the leader is killed with SIGKILL, ``kills`` times ``gap_s`` apart (the
killed controller is restarted at once as a standby, so there is always one to take
over). For each kill:

- ``takeover_s``: kill -> a controller names a new leader (ClusterStatus);
- ``to_first_result_s``: kill -> the first row of the first window whose closing
  watermark was injected after the kill (a result nothing could produce before the
  kill). Without a kill this is the wait for the next window to close (up to 0.5 s)
  plus the result latency (``result_latency_ms`` before the first kill, for
  comparison).

The output must equal the exact expected window counts (checked at the end).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import pipelines, workload
from bench.harness import ROOT, closed_windows, free_port, private_store
from bench.workload import DISORDER_US
from services.client import ControllerClient, inject_messages
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

SINK = pipelines.sink_stream("single")


class Deployment:
    """``controllers`` controllers and ``workers`` workers on ``store_url``, by PID."""

    def __init__(self, store_url: str, tmp: Path, controllers: int = 2, workers: int = 2,
                 lease_ttl_s: float | None = None) -> None:
        self.store_url, self.tmp = store_url, tmp
        self.ports = [free_port() for _ in range(controllers)]
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.lease_args = ["--lease-ttl", str(lease_ttl_s)] if lease_ttl_s else []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []
        self.client = self.new_client()
        try:
            for i in range(controllers):
                self.start_controller(i)
            self._wait(lambda: self.leader() is not None, 30, "a leader")
            for i in range(workers):
                self._spawn(f"worker{i}", ["worker", "--store", store_url, "--controller", ",".join(self.addresses),
                                           "--port", "0", "--metrics-port", "-1"])
            self._wait(lambda: len([w for w in self.client.status().workers if w.alive]) >= workers, 30,
                       "the workers to join")
        except BaseException:
            self.stop()
            raise

    def new_client(self) -> ControllerClient:
        return ControllerClient(",".join(self.addresses), timeout_s=10, security=Security())

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        self._logs.append(log)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}, "PYTHONPATH": str(ROOT)}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args, "--log-level", "WARNING"], cwd=ROOT, env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_controller(self, i: int) -> None:
        self._spawn(f"controller{i}", ["controller", "--store", self.store_url, "--port", str(self.ports[i]),
                                       "--metrics-port", "-1", *self.lease_args])

    def leader(self) -> int | None:
        """Index of the controller the cluster names as leader (None: none yet)."""
        try:
            name = self.client.status().leader
        except Exception:
            return None
        return self.addresses.index(name) if name in self.addresses else None

    def kill(self, i: int) -> None:
        proc = self.procs[f"controller{i}"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    @staticmethod
    def _wait(pred: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.client.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for log in self._logs:
            log.close()


class Reader:
    """Follows the sink; notes when each window's first row arrived."""

    def __init__(self, client: ControllerClient) -> None:
        self.client = client
        self.counts: Counter[tuple[str, int]] = Counter()
        self.first_seen: dict[int, float] = {}
        self.rows = 0
        self.resumed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        after = 0
        while not self._stop.is_set():
            try:
                for seq, rec in self.client.subscribe(SINK, after, follow=True):
                    after = seq
                    key, start = pipelines.row_window("single", rec)
                    self.counts[(key, start)] += pipelines.row_count("single", rec)
                    self.rows += 1
                    self.first_seen.setdefault(start, time.monotonic())
            except Exception:
                self.resumed += 1  # its controller went away: resume after `after`
                self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()


def _inject(client: ControllerClient, msgs: list[Any], interval_s: float, closes: dict[int, float],
            errors: list[str]) -> None:
    """Message i at t0 + i * interval (or as soon as the service takes it again), each
    retried until accepted: record ids make a resent message a no-op."""
    t0 = time.monotonic()
    for i, msg in enumerate(msgs):
        delay = t0 + i * interval_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.inject([msg])
                break
            except Exception as exc:  # UNAVAILABLE while no controller leads
                if time.monotonic() > deadline:
                    errors.append(f"message {i} not accepted in 60 s: {exc}")
                    return
                time.sleep(0.05)
        if msg.HasField("watermark"):
            now = time.monotonic()
            for start in closed_windows(msg.watermark, closes):
                closes[start] = now


def failover(kills: int = 3, store: str = "redis-aof", rate: float = 1000, gap_s: float = 8.0,
             warmup_s: float = 4.0, speedup: int = 20, lease_ttl_s: float | None = None) -> dict[str, Any]:
    """See the module docstring; ``rate`` records/s, event time ``speedup`` x wall clock."""
    batch = max(1, int(rate / 10))
    seconds = warmup_s + kills * gap_s + 2.0
    w = workload.generate(int(rate * seconds), keys=100, late_fraction=0.0, density=max(1, int(rate / speedup)))
    msgs = list(inject_messages("events", "events", w.records, batch, DISORDER_US, done=True))
    with tempfile.TemporaryDirectory(prefix="mw-bench-ha-") as tmpdir:
        tmp = Path(tmpdir)
        url, server = private_store(store, tmp)
        dep = None
        try:
            dep = Deployment(url, tmp, lease_ttl_s=lease_ttl_s)
            topo = pipelines.topology("single")
            dep.client.register_topology([spec_to_proto(c) for c in topo.computations],
                                         [(i.name, i.stream) for i in topo.injectors], [SINK])
            reader = Reader(dep.new_client())
            closes: dict[int, float] = {}
            errors: list[str] = []
            injector = threading.Thread(target=_inject, args=(dep.new_client(), msgs, batch / rate, closes, errors),
                                        daemon=True)
            injector.start()
            events = []
            time.sleep(warmup_s)
            for _ in range(kills):
                old = dep.leader()
                if old is None:
                    raise RuntimeError("no leader to kill")
                t_kill = time.monotonic()
                dep.kill(old)
                dep._wait(lambda o=old: dep.leader() not in (None, o), 30, "a new leader")
                t_lead = time.monotonic()
                dep.start_controller(old)  # back as a standby
                events.append((t_kill, t_lead))
                time.sleep(max(0.0, t_kill + gap_s - time.monotonic()))
            injector.join(120)
            expected = workload.expected_counts(w)
            deadline = time.monotonic() + 60
            while len(reader.counts) < len(expected) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.3)  # a duplicate row would come right after the last expected one
            reader.stop()
            verdict = workload.check(w, reader.counts)
        finally:
            if dep is not None:
                dep.stop()
            if server is not None:
                server.stop()
    per_kill: list[dict[str, float | None]] = []
    firsts: list[float] = []
    takeovers: list[float] = []
    for t_kill, t_lead in events:
        after = sorted((t, s) for s, t in closes.items() if t > t_kill and s in reader.first_seen)
        first = round(reader.first_seen[after[0][1]] - t_kill, 3) if after else None
        takeovers.append(round(t_lead - t_kill, 3))
        firsts += [] if first is None else [first]
        per_kill.append({"takeover_s": takeovers[-1], "to_first_result_s": first})
    before = sorted((reader.first_seen[s] - t) * 1000 for s, t in closes.items()
                    if s in reader.first_seen and events and t < events[0][0])
    return {
        "kills": kills, "store": store, "rate": rate, "speedup": speedup, "gap_s": gap_s,
        "lease_ttl_s": lease_ttl_s, "records": w.size, "per_kill": per_kill,
        "to_first_result_s": {"median": statistics.median(firsts) if firsts else None,
                              "max": max(firsts, default=None)},
        "takeover_s": {"median": statistics.median(takeovers) if takeovers else None,
                       "max": max(takeovers, default=None)},
        "result_latency_ms_before": {"p50": statistics.median(before) if before else None,
                                     "max": max(before, default=None)},
        "subscribe_resumed": reader.resumed, "inject_errors": errors, "correct": verdict.as_dict(),
    }
