"""The service figures: the three-stage pipeline across ``millwheel up --workers 2``.

What a user of the service sees, measured from another process over gRPC:

* **backlog throughput**: a fixed workload is injected through ``Inject`` as fast as
  the service accepts it (messages built before the clock starts), and the clock stops
  when the sink stream (read by ``Subscribe``) holds every window row; the rows must
  equal the exact expected counts. Also reported: the rate at which ``Inject`` accepted
  the records, and CPU seconds per process (controller, workers, this client).
* **latency at 50%**: records injected in small messages paced at half that rate;
  a record's latency is injection -> its window row in the sink, minus the time the
  window could not close yet (event time runs 5x wall clock): reported as the
  window-result latency, from the message whose watermark closed a window to the
  window's first row arriving by ``Subscribe``.

Each case starts ``millwheel up`` (a controller and 2 workers as child processes) on a
fresh store: an SQLite file, or a private ``redis-server`` with AOF ``everysec``.
The workload has no late records: when a record counts as late depends on how far
watermarks moved meanwhile, which across processes is timing, not a fixed answer.

``--security`` (or ``secure=True``) runs the same with everything docs/service.md
"Security" offers switched on: client token + cluster secret on every call, TLS with
mutual authentication (mTLS) on every connection, certificates from a throwaway CA;
``--compare-security`` interleaves rounds with and without it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import pipelines, workload
from bench.harness import ROOT, STORE_KINDS, closed_windows, free_port, private_store, process_cpu_s
from bench.workload import DISORDER_US
from services.client import ControllerClient, inject_messages
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

SINK = "rows"
INJECTOR = "events"


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


class Service:
    """``millwheel up --workers N`` on ``store_url``, stopped by SIGINT like Ctrl-C."""

    def __init__(self, store_url: str, workers: int, tmp: Path, extra_env: dict[str, str] | None = None,
                 secure: bool = False, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = tmp / "up.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra_env or {}))
        self.security, secure_env = _security(tmp) if secure else (Security(), {})
        env.update(secure_env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--workers", str(workers), "--store", store_url,
             "--port", str(self.port), "--log-level", "WARNING",
             "--allow-code", "bench.pipelines",  # the three-stage pipeline's map functions
             *([] if secure else ["--no-auth"]), *extra_args],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.client = self.new_client()
        deadline = time.monotonic() + 60
        while True:
            try:
                if len([w for w in self.client.status().workers if w.alive]) >= workers:
                    break
            except Exception:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"millwheel up did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def new_client(self) -> ControllerClient:
        return ControllerClient(self.address, timeout_s=30, security=self.security)

    def pids(self) -> dict[str, int]:
        workers = sorted(int(w.worker_id.rsplit("/", 1)[1]) for w in self.client.status().workers)
        roles = {f"worker{i}": pid for i, pid in enumerate(workers)}
        for pid in _children(self.proc.pid):
            if pid not in workers:
                roles["controller"] = pid
        for i, pid in enumerate(workers):
            for child in _children(pid):  # the worker's watchdog process
                roles[f"watchdog{i}"] = child
        return roles

    def wait_balanced(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.client.status()
            live = [w for w in s.workers if w.alive]
            if s.ranges and all(r.worker_id for r in s.ranges) and \
                    max(w.ranges for w in live) - min(w.ranges for w in live) <= 1:
                return
            time.sleep(0.1)
        raise RuntimeError("ranges were not assigned in time")

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


class SinkReader:
    """Follows the sink stream by Subscribe; notes when each window's first row came."""

    def __init__(self, client: ControllerClient) -> None:
        self.client = client
        self.counts: Counter[tuple[str, int]] = Counter()
        self.rows = 0
        self.first_seen: dict[int, float] = {}
        self.changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for _seq, rec in self.client.subscribe(SINK, 0, follow=True):
                window = pipelines.row_window("three", rec)
                now = time.monotonic()
                with self.changed:
                    self.counts[window] += pipelines.row_count("three", rec)
                    self.rows += 1
                    self.first_seen.setdefault(window[1], now)
                    self.changed.notify_all()
        except Exception:
            pass

    def wait_rows(self, rows: int, timeout_s: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.rows >= rows, timeout_s)


def _register(client: ControllerClient, productions: str) -> None:
    topo = pipelines.topology("three", productions=productions)
    for inj in topo.injectors:
        client.register_injector(inj.name, inj.stream)
    for spec in topo.computations:
        logged = [s for s in spec.all_outputs() if s in topo.log_streams]
        client.register_computation(spec_to_proto(spec), logged)


def _security(tmp: Path) -> tuple[Security, dict[str, str]]:
    """(client settings, server environment): tokens + TLS + mTLS from a throwaway CA."""
    import secrets

    from tests.support.certs import CertificateAuthority

    ca = CertificateAuthority(tmp / "pki")
    node, user = ca.issue("node"), ca.issue("user")
    token, secret = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    client = Security(client_token=token, tls_cert=str(user.cert), tls_key=str(user.key), tls_ca=str(ca.pem))
    return client, {"MILLWHEEL_AUTH_TOKEN": token, "MILLWHEEL_CLUSTER_SECRET": secret,
                    "MILLWHEEL_TLS_CERT": str(node.cert), "MILLWHEEL_TLS_KEY": str(node.key),
                    "MILLWHEEL_TLS_CA": str(ca.pem)}


@contextlib.contextmanager
def _running_service(store: str, workers: int, productions: str, secure: bool = False,
                     extra_args: tuple[str, ...] = ()) -> Iterator[Service]:
    """A controller and ``workers`` workers on a fresh store, the pipeline registered and
    balanced; everything (a private Redis too) stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix="mw-bench-svc-") as tmpdir:
        tmp = Path(tmpdir)
        url, redis = private_store(store, tmp)
        svc = Service(url, workers, tmp, secure=secure, extra_args=extra_args)
        try:
            _register(svc.client, productions)
            svc.wait_balanced()
            yield svc
        finally:
            svc.stop()
            if redis is not None:
                redis.stop()


def backlog(n: int, store: str = "sqlite", workers: int = 2, batch: int = 1000,
            productions: str = "strong", timeout_s: float = 600, secure: bool = False,
            watchdog: bool = True) -> dict[str, Any]:
    """Backlog throughput of the three-stage pipeline across ``workers`` workers
    (``watchdog=False``: workers without their watchdog process, to measure its cost)."""
    w = workload.generate(n, late_fraction=0.0)
    expected = workload.expected_counts(w)
    records = pipelines.injected(w.records, "three")
    with _running_service(store, workers, productions, secure,
                          () if watchdog else ("--no-watchdog",)) as svc:
        pids = svc.pids()
        msgs = list(inject_messages(INJECTOR, INJECTOR, records, batch, DISORDER_US, done=True))
        reader = SinkReader(svc.new_client())
        cpu0 = {role: process_cpu_s(pid) for role, pid in pids.items()}
        self_cpu0 = time.process_time()
        started = time.monotonic()
        resp = svc.client.inject(iter(msgs))
        injected_s = time.monotonic() - started
        complete = reader.wait_rows(len(expected), timeout_s)
        elapsed = time.monotonic() - started
        cpu = {role: round(process_cpu_s(pid) - cpu0[role], 2) for role, pid in pids.items()}
        cpu["client"] = round(time.process_time() - self_cpu0, 2)
        time.sleep(0.3)  # a duplicate row would arrive after the last expected one
        verdict = workload.check(w, reader.counts)
        reader.client.close()
    return {
        "records": n, "accepted": resp.accepted, "store": store, "workers": workers,
        "productions": productions, "inject_batch": batch, "secure": secure, "watchdog": watchdog,
        "records_per_s": n / elapsed if complete else None,
        "inject_records_per_s": n / injected_s, "elapsed_s": elapsed, "complete": complete,
        "cpu_s": cpu, "records_per_cpu_s": n / max(1e-9, sum(cpu.values())),
        "correct": verdict.as_dict(),
    }


def latency(n: int, rate: float, store: str = "sqlite", workers: int = 2, batch: int = 100,
            productions: str = "strong") -> dict[str, Any]:
    """Window-result latency at ``rate`` records/s (paced messages of ``batch`` records):
    from sending the message whose watermark closed a window to the window's first row."""
    density = max(1, int(rate / 5))  # event time runs 5x wall clock
    w = workload.generate(n, late_fraction=0.0, density=density)
    expected = workload.expected_counts(w)
    records = pipelines.injected(w.records, "three")
    msgs = list(inject_messages(INJECTOR, INJECTOR, records, batch, DISORDER_US, done=True))
    with _running_service(store, workers, productions) as svc:
        reader = SinkReader(svc.new_client())
        closes: dict[int, float] = {}  # window start -> when its closing message was sent
        interval = batch / rate

        def paced() -> Any:
            t0 = time.monotonic()
            for i, msg in enumerate(msgs):
                delay = t0 + i * interval - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                if msg.HasField("watermark"):
                    now = time.monotonic()
                    for start in closed_windows(msg.watermark, closes):
                        closes[start] = now
                yield msg

        svc.client.inject(paced())
        complete = reader.wait_rows(len(expected), 120)
        time.sleep(0.3)
        verdict = workload.check(w, reader.counts)
        lat = [reader.first_seen[s] - t for s, t in closes.items() if s in reader.first_seen]
        reader.client.close()
    lat_ms = sorted(x * 1000 for x in lat)
    return {
        "records": n, "rate": rate, "store": store, "workers": workers, "inject_batch": batch,
        "complete": complete, "windows": len(lat_ms),
        "result_latency_ms": {"p50": _pct(lat_ms, 50), "p95": _pct(lat_ms, 95), "max": max(lat_ms, default=None)},
        "correct": verdict.as_dict(),
    }


def _pct(xs: list[float], p: int) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]


# -- the "service" section of ``python -m bench`` --------------------------------------
def plan(n: int, full: bool) -> list[tuple[str, dict[str, Any]]]:
    """(kind, arguments) of each case: backlog on SQLite and Redis AOF everysec, then
    latency at 50% of the measured SQLite (and, in full runs, Redis) rate."""
    cases = [("backlog", {"n": n, "store": "sqlite"}), ("backlog", {"n": n, "store": "redis-aof"})]
    cases.append(("latency", {"store": "sqlite"}))
    if full:
        cases.append(("latency", {"store": "redis-aof"}))
    return cases


def section(n: int, full: bool, out: list[dict[str, Any]], case: Any) -> None:
    """Run the plan; ``case(results, label, meta, fn, *args, summary=..., **kwargs)`` is
    the suite's runner (a fresh process per case, errors recorded)."""
    rates: dict[str, float] = {}
    for kind, args in plan(n, full):
        store = args["store"]
        meta = {"figure": kind, "store": store, "workers": 2, "pipeline": "three"}
        if kind == "backlog":
            e = case(out, f"service backlog {store} {n:,}", meta, backlog, n, store,
                     summary=lambda r: f"{r['records_per_s'] or 0:,.0f} rec/s "
                                       f"(inject {r['inject_records_per_s']:,.0f} rec/s)")
            if "result" in e and e["result"]["records_per_s"]:
                rates[store] = e["result"]["records_per_s"]
        else:
            rate = rates.get(store)
            if rate is None:
                out.append({**meta, "error": "no backlog rate measured"})
                continue
            records = int(rate / 2 * (16 if full else 8))  # 8 s (16 s) of paced injection
            case(out, f"service latency {store} at 50% ({rate / 2:,.0f} rec/s)", {**meta, "load_pct": 50},
                 latency, records, rate / 2, store,
                 summary=lambda r: f"window result p50 {r['result_latency_ms']['p50'] or 0:.0f} ms "
                                   f"p95 {r['result_latency_ms']['p95'] or 0:.0f} ms")


def best_backlog(entries: list[dict[str, Any]]) -> float | None:
    rates = [e["result"]["records_per_s"] for e in entries
             if e.get("figure") == "backlog" and "result" in e and e["result"]["correct"]["ok"]
             and e["result"]["records_per_s"]]
    return max(rates, default=None)


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Service: three stages across `millwheel up --workers 2` (EO + strong productions)", "",
             "Backlog: the workload injected through `Inject` (1000-record messages) as fast as the service "
             "accepts it; time until `Subscribe` on the sink has every window row; rows checked exactly. "
             "CPU: seconds of each process during the run.", "",
             "| store | records | records/s | inject records/s | CPU s (controller / workers / client) | output |",
             "|---|---|---|---|---|---|"]
    for e in entries:
        if e.get("figure") != "backlog":
            continue
        r = e.get("result")
        if r is None:
            lines.append(f"| {e['store']} | | {e.get('error', '')} | | | |")
            continue
        cpu = r["cpu_s"]
        workers = " + ".join(str(v) for k, v in sorted(cpu.items()) if k.startswith("worker"))
        lines.append(f"| {e['store']} | {r['records']:,} | {r['records_per_s'] or 0:,.0f} | "
                     f"{r['inject_records_per_s']:,.0f} | {cpu.get('controller')} / {workers} / {cpu.get('client')} | "
                     f"{'exact' if r['correct']['ok'] else 'WRONG: ' + r['correct']['detail']} |")
    lat = [e for e in entries if e.get("figure") == "latency"]
    if lat:
        lines += ["", "Latency at 50% of that rate (paced 100-record messages, event time 5x wall clock): "
                  "from sending the message whose watermark closed a window to the window's first row "
                  "arriving by `Subscribe` (watermarks travel through the controller by heartbeats, "
                  "sent at most every 25 ms while they move, else every 100 ms).", "",
                  "| store | rate | windows | result latency p50 ms | p95 ms | max ms | output |",
                  "|---|---|---|---|---|---|---|"]
        for e in lat:
            r = e.get("result")
            if r is None:
                lines.append(f"| {e['store']} | {e.get('error', '')} | | | | | |")
                continue
            q = r["result_latency_ms"]
            lines.append(f"| {e['store']} | {r['rate']:,.0f} | {r['windows']} | {q['p50'] or 0:.0f} | "
                         f"{q['p95'] or 0:.0f} | {q['max'] or 0:.0f} | "
                         f"{'exact' if r['correct']['ok'] else 'WRONG: ' + r['correct']['detail']} |")
    return lines


def _watchdog_ab(n: int, store: str, batch: int, repeat: int) -> int:
    import json

    got: dict[bool, list[float]] = {True: [], False: []}
    per_cpu: dict[bool, list[float]] = {True: [], False: []}  # records per CPU s of workers + watchdogs
    for i in range(repeat):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            r = backlog(n, store, batch=batch, watchdog=on)
            if not r["correct"]["ok"]:
                raise SystemExit(f"watchdog={on}: output wrong: {r['correct']['detail']}")
            got[on].append(r["records_per_s"] or 0.0)
            cpu = sum(v for k, v in r["cpu_s"].items() if k.startswith(("worker", "watchdog")))
            per_cpu[on].append(n / max(cpu, 1e-9))
            print(json.dumps({"watchdog": on, "records_per_s": round(r["records_per_s"] or 0),
                              "cpu_s": r["cpu_s"]}), flush=True)
    on, off = statistics.median(got[True]), statistics.median(got[False])
    con, coff = statistics.median(per_cpu[True]), statistics.median(per_cpu[False])
    print(json.dumps({"records": n, "store": store, "repeats": repeat,
                      "median_records_per_s": {"watchdog": round(on), "no_watchdog": round(off)},
                      "drop_pct": round(100 * (off - on) / off, 1),
                      "median_records_per_worker_cpu_s": {"watchdog": round(con), "no_watchdog": round(coff)},
                      "cpu_drop_pct": round(100 * (coff - con) / coff, 1)}), flush=True)
    return 0


def _local_three(n: int) -> dict[str, Any]:
    """Local mode's three-stage figure as ``python -m bench`` measures it (the suite's
    backlog case: SQLite, exactly-once, strong productions, 1k uniform keys), in a
    fresh process."""
    from bench.harness import in_fresh_process
    from bench.run_local import WorkloadArgs, backlog_case

    with tempfile.TemporaryDirectory(prefix="mw-bench-local-") as d:
        r: dict[str, Any] = in_fresh_process(backlog_case, WorkloadArgs(n, 1000, "uniform"), "three",
                                             f"sqlite:///{d}/local.db", True, "strong")
    return r


def _vs_local(n: int, batch: int, repeat: int) -> int:
    """Local mode's three stages and the service's, alternated ``repeat`` times (the
    order flipped each round), on SQLite: both medians and the ratio of each round."""
    import json

    local: list[float] = []
    service: list[float] = []
    for i in range(repeat):
        for kind in (("local", "service") if i % 2 == 0 else ("service", "local")):
            if kind == "local":
                r = _local_three(n)
                rate = r["records_per_s"]
                local.append(rate)
            else:
                r = backlog(n, "sqlite", batch=batch)
                rate = r["records_per_s"] or 0.0
                service.append(rate)
            if not r["correct"]["ok"]:
                raise SystemExit(f"{kind}: output wrong: {r['correct']['detail']}")
            print(json.dumps({"round": i, "mode": kind, "records_per_s": round(rate),
                              "cpu_s": r.get("cpu_s")}), flush=True)
    ratios = [s / loc for s, loc in zip(service, local, strict=True)]
    print(json.dumps({"records": n, "repeats": repeat,
                      "local": [round(x) for x in local], "service": [round(x) for x in service],
                      "median_local": round(statistics.median(local)),
                      "median_service": round(statistics.median(service)),
                      "ratio_of_medians": round(statistics.median(service) / statistics.median(local), 3),
                      "ratios": [round(x, 3) for x in ratios], "loadavg": os.getloadavg()}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m bench.cases.service",
                                 description="the service figures alone (see bench/cases/service.py)")
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--store", default="sqlite", choices=STORE_KINDS)
    ap.add_argument("--batch", type=int, default=1000, help="records per Inject message")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--latency", action="store_true", help="also the latency at 50%% of the rate")
    ap.add_argument("--security", action="store_true",
                    help="client token + cluster secret + TLS + mTLS on every call and connection")
    ap.add_argument("--compare-security", action="store_true",
                    help="interleave --repeat rounds without and with --security")
    ap.add_argument("--watchdog-ab", action="store_true",
                    help="each repeat runs the backlog twice, workers with and without their "
                         "watchdog process, in alternating order; prints both medians and the drop")
    ap.add_argument("--vs-local", action="store_true",
                    help="alternate local mode's three-stage backlog and the service's (SQLite), "
                         "--repeat rounds; prints both medians and the service/local ratio")
    args = ap.parse_args(argv)
    if args.vs_local:
        return _vs_local(args.records, args.batch, args.repeat)
    if args.watchdog_ab:
        return _watchdog_ab(args.records, args.store, args.batch, args.repeat)
    modes = [False, True] if args.compare_security else [args.security]
    rates: dict[bool, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeat):
        for secure in modes:
            r = backlog(args.records, args.store, batch=args.batch, secure=secure)
            rates[secure].append(r["records_per_s"] or 0.0)
            print(json.dumps(r), flush=True)
    for secure, got in rates.items():
        print(f"{'auth+TLS+mTLS' if secure else 'no security'}: median {statistics.median(got):,.0f} "
              f"records/s over {len(got)} ({', '.join(f'{x:,.0f}' for x in got)})", file=sys.stderr)
    rates_all = [x for got in rates.values() for x in got]
    if args.latency:
        print(json.dumps(latency(args.records // 2, statistics.median(rates_all) / 2, args.store)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

