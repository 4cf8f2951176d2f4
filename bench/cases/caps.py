"""The controller's leader lease at the documented caps, on a loaded machine (issue 34 item 9).

``millwheel up`` (one controller, two workers, ``--no-auth``) on a private store, while
``--load`` busy processes keep the machine's cores busy; then the registry is filled
to a cap, ``--batch`` computations per RegisterTopology call (timed each):

* ``ranges``: 16,384 key ranges in all (the cap, ``MAX_TOTAL_KEY_RANGES``): one
  injector's range and computations of at most 4,096 ranges (``window_aggregate``);
* ``computations``: 1,000 one-range computations (``MAX_COMPUTATIONS``) whose user
  code carries 64 KiB of parameters each (``MAX_PARAMS_BYTES``), and their injector.

Then it waits until every range is owned by a live worker, and runs ``--steady`` seconds
more. Three phases (register, settle, steady), each with:

* the lease, read from the store every 50 ms (its ``lease/until`` is the renewal time
  plus the TTL, so each renewal's time is known to the millisecond, however late it is
  read): the longest gap between two renewals and how many were over 1 s (the leader
  stops believing it leads 1.5 s after it sent a renewal: ``--lease-ttl`` 2 s x 0.75);
* a probe heartbeating as a draining worker every 0.2 s (as a worker would, with the
  incremental fields): p50, p95 and max of its answer time, failures;
* the log of ``up``: "is no longer the leader (epoch" (the elector gave up the lease),
  "(its lease ran out)" (a write refused because the leader was no longer sure it
  leads), "declared dead", "; restarting ".

A registration refused (UNAVAILABLE while the leader is unsure) is counted and sent
again after 1 s, as a user would. Over the whole run: renewal gaps over the TTL (the
lease ran out in the store) and the 50 ms samples that saw it run out.

    python -m bench.cases.caps [--case ranges,computations] [--store sqlite|redis]
        [--load 2] [--batch 50] [--steady 60] [--root DIR]

``--root`` runs the service from another checkout (the same case "before" a change);
``CAPS_KEEP_LOG=FILE`` keeps the log of ``up``; ``CAPS_EXTRA_PATH=DIR:`` is put first on
the service's PYTHONPATH (a ``sitecustomize.py`` there can time the service's threads).
Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench.cases.registry_scale import CODE, Probe, _pct
from bench.harness import ROOT, free_port, private_store, wait_until
from millwheel.limits import MAX_COMPUTATIONS, MAX_KEY_RANGES, MAX_PARAMS_BYTES, MAX_TOTAL_KEY_RANGES
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.client import ControllerClient
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

TTL_MS = 2000  # the controller's default --lease-ttl
BUSY = "while True: pass"


def specs(case: str) -> list[ComputationSpec]:
    """The computations that fill the registry to the cap, with one injector ``events``."""
    if case == "ranges":
        left, out, i = MAX_TOTAL_KEY_RANGES - 1, [], 0  # the injector has one range
        while left:
            n = min(MAX_KEY_RANGES, left)
            out.append(ComputationSpec(f"agg{i}", (InputSpec("events"),), (f"agg{i}_out",),
                                       CodeRef("window_aggregate", {"size_us": 1_000_000}), Options(key_ranges=n)))
            left, i = left - n, i + 1
        return out
    pad = "x" * (MAX_PARAMS_BYTES - 64)  # the params' JSON just under 64 KiB
    return [ComputationSpec(f"c{i}", (InputSpec("events"),), (f"c{i}_out",),
                            CodeRef("regscale_code:Padded", {"pad": pad}), Options(key_ranges=1))
            for i in range(MAX_COMPUTATIONS)]


class LeaseWatch:
    """Reads the lease from the store every 50 ms: each distinct ``until`` is one renewal."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.renewals: list[int] = []  # ms since the epoch, as the store's clock wrote them
        self.lapsed = 0  # samples with the lease run out or held by another
        self.holders: set[str] = set()
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _reader(self) -> Callable[[], tuple[str, int, int, int]]:
        """() -> (holder, epoch, until ms, now ms)."""
        if self.url.startswith("sqlite"):
            db = sqlite3.connect(f"file:{self.url.split('///', 1)[1]}?mode=ro", uri=True, timeout=5,
                                 check_same_thread=False)

            def sqlite_read() -> tuple[str, int, int, int]:
                rows = dict(db.execute("SELECT name, value FROM meta WHERE name LIKE 'lease/%'").fetchall())
                return (bytes(rows.get("lease/holder", b"")).decode(), int(bytes(rows.get("lease/epoch", b"0"))),
                        int(bytes(rows.get("lease/until", b"0"))), time.time_ns() // 1_000_000)
            return sqlite_read
        import redis

        r = redis.Redis.from_url(self.url)

        def redis_read() -> tuple[str, int, int, int]:
            holder, epoch, until = r.hmget("mw:meta", "lease/holder", "lease/epoch", "lease/until")
            sec, usec = r.time()
            name = holder.decode() if isinstance(holder, bytes) else str(holder or "")
            return name, int(epoch or 0), int(until or 0), sec * 1000 + usec // 1000
        return redis_read

    def _run(self) -> None:
        read = None
        last_until = 0
        while not self._stop.wait(0.05):
            try:
                read = read or self._reader()
                holder, _epoch, until, now = read()
            except Exception:  # noqa: BLE001 - the store not made yet, or busy: counted
                self.errors += 1
                continue
            if not holder:
                continue
            self.holders.add(holder)
            if until != last_until:
                self.renewals.append(until - TTL_MS)
                last_until = until
            if until <= now or len(self.holders) > 1:
                self.lapsed += 1

    def start(self) -> None:
        self._thread.start()

    def gaps(self, from_ms: float, to_ms: float) -> list[int]:
        """Gaps between renewals made in [from_ms, to_ms) (the first one counted from the
        renewal before it)."""
        r = self.renewals
        return [b - a for a, b in zip(r, r[1:], strict=False) if from_ms <= b < to_ms]

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(10)
        gaps = self.gaps(0, float("inf"))
        return {"renewals": len(self.renewals), "renewal_gap_max_ms": max(gaps, default=None),
                "renewal_gaps_over_ttl": sum(g >= TTL_MS for g in gaps), "lease_lapsed_samples": self.lapsed,
                "lease_holders": len(self.holders), "lease_read_errors": self.errors}


def _wait(pred: Callable[[], bool], what: str, timeout_s: float) -> None:
    wait_until(pred, what, timeout_s)


#: What the service's log says when leadership or liveness fails, counted per phase.
INCIDENTS = {"leader_lost": r"is no longer the leader \(epoch",  # the elector gave the lease up
             "lapsed_writes": r"\(its lease ran out\)",  # a write refused: the leader unsure it still leads
             "declared_dead": r"declared dead", "restarted": r"; restarting "}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _incidents(text: str, phases: list[tuple[str, float, float]]) -> dict[str, int]:
    """Each incident's log lines per phase (by the line's time; the shutdown's excluded)."""
    text = text.split("millwheel up: stopping", 1)[0]
    out = {f"{name}_{phase}": 0 for name in INCIDENTS for phase, _a, _b in phases}
    for line in text.splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        phase = next((ph for ph, a, b in phases if a <= t < b), None)
        for name, pattern in INCIDENTS.items():
            if phase and re.search(pattern, line):
                out[f"{name}_{phase}"] += 1
    return out


def case(which: str = "ranges", store: str = "sqlite", load: int = 2, batch: int = 50, steady_s: float = 60.0,
         settle_timeout_s: float = 900.0, root: str | None = None) -> dict[str, Any]:
    code_root = Path(root or ROOT)
    comps = specs(which)
    out: dict[str, Any] = {"case": which, "store": store, "load": load, "batch": batch,
                           "computations": len(comps), "ranges": sum(c.options.key_ranges for c in comps) + 1,
                           "root": str(code_root)}
    with tempfile.TemporaryDirectory(prefix="mw-bench-caps-") as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "regscale_code.py").write_text(CODE)
        url, server = private_store(store, tmp)
        port = free_port()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")},
               "PYTHONPATH": f"{os.environ.get('CAPS_EXTRA_PATH', '')}{code_root}:{tmp}"}
        log_path = tmp / "up.log"
        with open(log_path, "ab") as log:
            up = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--no-auth", "--workers", "2", "--store", url,
                 "--port", str(port), "--ui-port", "-1", "--log-level", "INFO", "--allow-code", "regscale_code.*"],
                cwd=code_root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        client = ControllerClient(f"127.0.0.1:{port}", timeout_s=900, security=Security())
        watch = LeaseWatch(url)
        probe = Probe(f"127.0.0.1:{port}")
        stop = threading.Event()
        marks: list[tuple[str, float, int, int]] = []  # phase starting, wall time, probe answers, failures

        def mark(phase: str) -> None:
            marks.append((phase, time.time(), len(probe.latencies), probe.failures))
        busy: list[subprocess.Popen[bytes]] = []
        try:
            # (started here, so the finally below stops them whatever fails: a failed start
            # of `up` once left two of them spinning for good)
            busy += [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
            _wait(lambda: sum(w.alive for w in client.status().workers) == 2, "the controller and two workers", 120)
            watch.start()

            def beat() -> None:
                while not stop.wait(0.2):
                    probe.once()
            threading.Thread(target=beat, daemon=True).start()
            mark("register")
            calls: list[float] = []
            refused: list[str] = []
            for i in range(0, len(comps), batch):
                for _attempt in range(10):  # as a user would: a refused call is sent again
                    t = time.monotonic()
                    try:
                        client.register_topology([spec_to_proto(c) for c in comps[i:i + batch]],
                                                 [("events", "events")])
                    except Exception as exc:  # noqa: BLE001 - counted, sent again
                        refused.append(str(exc)[:200])
                        time.sleep(1.0)
                        continue
                    calls.append(time.monotonic() - t)
                    break
            out["register_s"] = round(time.time() - marks[0][1], 1)
            out["register_call_p50_s"] = _pct(calls, 0.5)
            out["register_call_max_s"] = round(max(calls), 2) if calls else None
            out["register_refused"] = len(refused)
            out["register_refused_first"] = refused[:1]
            mark("settle")
            want = out["ranges"]

            def settled() -> bool:
                st = client.status()
                alive = {w.worker_id for w in st.workers if w.alive}
                return bool(sum(1 for r in st.ranges if r.worker_id in alive) >= want)
            _wait(settled, "every range owned by a live worker", settle_timeout_s)
            out["settle_s"] = round(time.time() - marks[-1][1], 1)
            mark("steady")
            time.sleep(steady_s)
        except Exception as exc:  # noqa: BLE001 - recorded with what was measured
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            stop.set()
            mark("end")
            out.update(watch.stop())
            probe.channel.close()
            phases = [(a[0], a[1], b[1]) for a, b in zip(marks, marks[1:], strict=False)]
            for (phase, t0, n0, f0), (_next, t1, n1, f1) in zip(marks, marks[1:], strict=False):
                lat = probe.latencies[n0:n1]
                gaps = watch.gaps(t0 * 1000, t1 * 1000)
                out[phase] = {"s": round(t1 - t0, 1), "renewal_gap_max_ms": max(gaps, default=None),
                              "renewal_gaps_over_1s": sum(g > 1000 for g in gaps),
                              "heartbeat_p50_ms": _pct(lat, 0.5), "heartbeat_p95_ms": _pct(lat, 0.95),
                              "heartbeat_max_ms": _pct(lat, 1.0), "heartbeat_failures": f1 - f0}
            client.close()
            for b in busy:
                b.kill()
                b.wait()
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
            text = log_path.read_text(errors="replace")
            for key, n in _incidents(text, phases).items():
                name, phase = key.rsplit("_", 1)
                out.setdefault(phase, {})[name] = n
            if os.environ.get("CAPS_KEEP_LOG"):
                Path(os.environ["CAPS_KEEP_LOG"]).write_text(text)
            if server is not None:
                server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="ranges,computations")
    ap.add_argument("--store", default="sqlite")
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the service (default 2)")
    ap.add_argument("--batch", type=int, default=50, help="computations per RegisterTopology call (default 50)")
    ap.add_argument("--steady", type=float, default=60.0)
    ap.add_argument("--root", default=None, help="checkout the service runs from (default: this one)")
    args = ap.parse_args()
    if args.root is not None and not (Path(args.root) / "services" / "cli").is_dir():
        ap.error(f"--root {args.root}: not a millwheel checkout (no services/cli there)")
    for which in args.case.split(","):
        print(json.dumps(case(which, args.store, args.load, args.batch, args.steady, root=args.root)), flush=True)


if __name__ == "__main__":
    main()
