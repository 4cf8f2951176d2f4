"""``python -m bench.cases.soak``: the service run for a long time at half its capacity.

What a user running the service for days would watch (issue 24 item 4, issue 27):
``millwheel up --workers 2``, the three-stage pipeline (parse -> windowed count with
a state TTL -> sink, the sink stream logged), fed over ``Inject`` at 50% of the
capacity measured first by a short backlog run (``--load-pct`` another share of it, or
``--rate``), for ``--minutes`` (default 30). Every ``--sample-s`` (default 60 s) it samples:

* RSS of every process: the controller, each worker, each worker's watchdog (and the
  private redis-server with ``--store redis``/``redis-aof``);
* store size: the SQLite file and its WAL; Redis ``used_memory`` and the AOF on disk;
* rows: consumed record IDs, stream-log rows, state, timers, outbox (SQLite read-only
  through a ``mode=ro`` connection; Redis ZCARD/HLEN/DBSIZE);
* watermark lag of the sink stage (``ClusterStatus``, polled every 5 s, the sample
  holding the interval's mean and max);
* records/s: injected, counted by the count stage (the workers' metrics), sink rows.

At the end it sends ``done``, waits for every window and compares the sink's rows
with the exact expected counts (every window once), then computes the targets
(:mod:`bench.cases.soak_series`): RSS and store-size growth <= 10% over the last 20
minutes (the last 2/3 of a shorter run), lag flat there, output exact. It writes
``STEM.csv`` (the samples), ``STEM.png`` (one panel per series family) and
``STEM.json`` (everything) into ``--out`` (default bench/results/).

The workload is streamed, never held: record ``i`` of user ``u(i)`` is stamped
``t0 + i / rate`` (the wall clock when it is due, minus up to 2 s of disorder) and
sent when due, so event time follows wall time and the lag means what it says; a
message's watermark is its largest timestamp minus 2 s, so no record is late. Users
come and go: ``--users`` are active at a time and the population slides by that many
every ``--turnover-s``, so keys go idle and their state expires (``--state-ttl-s``).
Consumed IDs are kept ``--id-retention-s`` (the store's consumed-ID rows level off
after that long).

``--tracemalloc-s N`` makes the workers write tracemalloc snapshots every N seconds
into the output directory (services/memory.py); tracing slows them down, so
run it at a modest ``--rate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import pipelines
from bench.cases import soak_series
from bench.cases.service import INJECTOR, Service, SinkReader
from bench.harness import ROOT, commit, log, private_store
from bench.workload import DISORDER_US, PAD, SECOND, WINDOW_US
from millwheel.nodes import is_injector
from millwheel.record import Record
from millwheel.topology import Topology
from services.client import ControllerClient, inject_messages
from services.inject_writer import InjectWriter
from services.rpc.convert import spec_to_proto

STORES = ("sqlite", "redis", "redis-aof")
RESULTS = ROOT / "bench" / "results"
LAG_POLL_S = 5.0
#: What the service's log says when a long run goes wrong: counted in the result.
INCIDENTS = {"workers declared dead": "declared dead", "leader lease lost": "is no longer the leader",
             "workers killed by their watchdog": "killed the worker", "processes restarted by up": "; restarting "}


@dataclasses.dataclass(frozen=True)
class Plan:
    minutes: float = 30.0
    rate: float | None = None  # records/s; None: load_pct% of a measured backlog rate
    load_pct: float = 50.0  # the share of the measured capacity fed when no rate is given
    store: str = "sqlite"
    sample_s: float = 60.0
    state_ttl_s: float = 60.0
    id_retention_s: float = 300.0
    log_retention_s: float = 300.0
    users: int = 500
    turnover_s: float = 300.0
    batch: int = 100
    capacity_records: int = 30_000
    tracemalloc_s: float | None = None
    out: str = str(RESULTS)
    #: how records go in: "inject" (the controller's Inject, a message of ``batch`` records
    #: at a time) or "writer" (InjectWriter: straight to the worker owning the range)
    feed: str = "inject"


def topology(plan: Plan) -> Topology:
    """The three-stage pipeline, the count stage with the state TTL, every stage keeping
    consumed IDs for ``id_retention_s`` and its logged streams for ``log_retention_s``
    (the default of 7 days would have the sink's log grow through any run of hours)."""
    base = pipelines.topology("three", state_ttl_us=int(plan.state_ttl_s * SECOND))
    retention = int(plan.id_retention_s * SECOND)
    logs = int(plan.log_retention_s * SECOND)
    comps = tuple(dataclasses.replace(c, options=dataclasses.replace(
        c.options, record_id_retention_us=retention, log_retention_us=logs)) for c in base.computations)
    return dataclasses.replace(base, computations=comps)


class Feed:
    """The streamed, paced workload and the exact counts it must produce."""

    def __init__(self, plan: Plan, rate: float, seed: int = 7) -> None:
        self.rate = rate
        self.users = plan.users
        # the population slides by ``users`` every turnover: one user every this many records
        self.shift_every = max(1, int(rate * plan.turnover_s / max(1, plan.users)))
        self.rng = random.Random(seed)
        self.expected: Counter[tuple[str, int]] = Counter()
        self.sent = 0  # records handed to the client so far
        self.t0_us = 0
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.t0_us = int(time.time() * SECOND)

    def behind_s(self) -> float:
        """How far the sender is behind its schedule (backpressure held it back)."""
        return max(0.0, time.monotonic() - (self.t0 + self.sent / self.rate))

    def records(self, until: float, batch: int) -> Iterator[Record]:
        rng, spacing = self.rng, SECOND / self.rate
        i = 0
        while True:
            if i % batch == 0:
                due = self.t0 + i / self.rate
                now = time.monotonic()
                if due >= until:
                    return
                if due > now:
                    time.sleep(due - now)
            user = f"u{i // self.shift_every + rng.randrange(self.users)}"
            ts = self.t0_us + int(i * spacing) - int(rng.random() * (DISORDER_US - 1))
            value = json.dumps({"k": user, "n": i, "p": PAD}, separators=(",", ":")).encode()
            self.expected[(user, ts - ts % WINDOW_US)] += 1
            yield Record(f"p{i % pipelines.PARTITIONS}", value, ts, f"s{i}")
            i += 1
            self.sent = i


# -- what a sample reads ------------------------------------------------------------------
def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sorted({int(c) for t in tasks for c in (t / "children").read_text().split()})
    except (OSError, ValueError):
        return []


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class Roles:
    """Which process is which under ``up``: the controller, ``workerN`` (a restarted
    worker takes the slot of the one that died, and counts as a restart) and its
    ``watchdogN``."""

    def __init__(self, up_pid: int) -> None:
        self.up_pid = up_pid
        self.slots: list[int] = []
        self.restarts = 0

    def current(self) -> dict[str, int]:
        roles: dict[str, int] = {}
        workers = []
        for pid in _children(self.up_pid):
            args = _cmdline(pid)
            if "controller" in args:
                roles["controller"] = pid
            elif "worker" in args:
                workers.append(pid)
        alive = set(workers)
        for pid in workers:
            if pid in self.slots:
                continue
            dead = next((i for i, p in enumerate(self.slots) if p not in alive), None)
            if dead is None:
                self.slots.append(pid)
            else:
                self.slots[dead] = pid
                self.restarts += 1
        for i, pid in enumerate(self.slots):
            if pid in alive:
                roles[f"worker{i}"] = pid
                for child in _children(pid):
                    roles[f"watchdog{i}"] = child
        return roles


def sqlite_stats(path: Path) -> dict[str, Any]:
    """File sizes and row counts, read through a read-only connection (never a writer)."""
    size = lambda p: p.stat().st_size if p.exists() else 0  # noqa: E731
    db, wal = size(path), size(Path(f"{path}-wal"))
    out: dict[str, Any] = {"store_mb.db": db / 2**20, "store_mb.wal": wal / 2**20, "store_mb.total": (db + wal) / 2**20}
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        for name, table in (("consumed_ids", "consumed_ids"), ("log", "stream_log"), ("state", "state"),
                            ("timers", "timers"), ("outbox", "outbox")):
            out[f"rows.{name}"] = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608
    finally:
        con.close()
    return out


def redis_stats(url: str, data_dir: Path | None) -> dict[str, Any]:
    import redis

    r = redis.Redis.from_url(url)
    try:
        out: dict[str, Any] = {"store_mb.used_memory": r.info("memory")["used_memory"] / 2**20}
        if data_dir is not None and (data_dir / "appendonlydir").exists():
            out["store_mb.aof"] = sum(f.stat().st_size for f in (data_dir / "appendonlydir").iterdir()) / 2**20
        count = {"consumed_ids": 0, "log": 0, "state": 0, "timers": 0, "outbox": 0}
        for raw in r.scan_iter(match="mw:*", count=1000):
            key = raw.decode()
            if key.endswith(":ids") and key.startswith("mw:r:"):
                count["consumed_ids"] += r.zcard(raw)
            elif key.endswith(":entries") and key.startswith("mw:log:"):
                count["log"] += r.zcard(raw)
            elif key.endswith("}:state"):
                count["state"] += r.hlen(raw)
            elif key.endswith("}:timers"):
                count["timers"] += r.hlen(raw)
            elif key.endswith("}:outbox"):
                count["outbox"] += r.hlen(raw)
        out.update({f"rows.{k}": v for k, v in count.items()})
        out["rows.redis_keys"] = r.dbsize()
        return out
    finally:
        r.close()


class Sampler:
    """Every ``sample_s``: one row of every series; meanwhile the lag every 5 s."""

    def __init__(self, svc: Service, plan: Plan, store_url: str, server: Any, feed: Feed,
                 reader: SinkReader) -> None:
        self.svc, self.plan, self.store_url, self.server, self.feed, self.reader = \
            svc, plan, store_url, server, feed, reader
        self.client = svc.new_client()
        self.roles = Roles(svc.proc.pid)
        self.samples: list[dict[str, Any]] = []
        self.lags: list[float] = []
        self.lag_max: list[float] = []
        self._last: tuple[float, int, float, int] | None = None  # (when, sent, count_in, sink rows)

    def poll_lag(self) -> None:
        try:
            wms = self.client.status().watermarks
        except Exception:  # noqa: BLE001 - a missed poll is a gap, not a failure
            return
        lags = [w.lag_us / SECOND for w in wms if not is_injector(w.node)]
        if lags:
            self.lags.append(max(lags))

    def count_in(self) -> float:
        from services.metrics import scrape

        total = 0.0
        for w in self.client.status().workers:
            if w.alive and w.metrics_address:
                try:
                    total += scrape(w.metrics_address, 2.0).get(
                        ("millwheel_records_in_total", (("computation", "count"),)), 0.0)
                except OSError:
                    pass
        return total

    def sample(self, started: float) -> dict[str, Any]:
        now = time.monotonic()
        row: dict[str, Any] = {"t_min": round((now - started) / 60, 3)}
        for role, pid in sorted(self.roles.current().items()):
            row[f"rss_mb.{role}"] = _rss_mb(pid)
        if self.server is not None and getattr(self.server, "proc", None) is not None:
            row["rss_mb.redis-server"] = _rss_mb(self.server.proc.pid)
        try:
            if self.store_url.startswith("sqlite:///"):
                row.update(sqlite_stats(Path(self.store_url[len("sqlite:///"):])))
            else:
                row.update(redis_stats(self.store_url, getattr(self.server, "data_dir", None)))
        except Exception as exc:  # noqa: BLE001 - one failed read is a gap in the series
            log(f"  store read failed: {exc.__class__.__name__}: {exc}")
        lags, self.lags = self.lags, []
        row["lag_s.mean"] = sum(lags) / len(lags) if lags else None
        row["lag_s.max"] = max(lags) if lags else None
        sent, counted, rows = self.feed.sent, self.count_in(), self.reader.rows
        if self._last is not None:
            when, sent0, counted0, rows0 = self._last
            dt = max(1e-9, now - when)
            row["rate.injected"] = (sent - sent0) / dt
            row["rate.count_stage_in"] = (counted - counted0) / dt if counted >= counted0 else None
            row["rate.sink_rows"] = (rows - rows0) / dt
        row["lag_s.inject_behind"] = round(self.feed.behind_s(), 2)
        self._last = (now, sent, counted, rows)
        self.samples.append(row)
        return row


def measure_capacity(plan: Plan) -> float:
    """The service's backlog rate on the same store kind (bench/cases/service.py)."""
    from bench.cases.service import backlog

    r = backlog(plan.capacity_records, plan.store)
    if not r["correct"]["ok"] or not r["records_per_s"]:
        raise RuntimeError(f"capacity run failed: {r['correct']['detail']}")
    return float(r["records_per_s"])


def _register(client: ControllerClient, topo: Topology) -> None:
    for inj in topo.injectors:
        client.register_injector(inj.name, inj.stream)
    for spec in topo.computations:
        logged = [s for s in spec.all_outputs() if s in topo.log_streams]
        client.register_computation(spec_to_proto(spec), logged)


def compare(expected: Counter[tuple[str, int]], observed: Counter[tuple[str, int]]) -> dict[str, Any]:
    """Every expected window with its exact count, and no other."""
    differ = [k for k in expected if observed.get(k) != expected[k]]
    extra = [k for k in observed if k not in expected]
    problems = []
    if differ:
        k = differ[0]
        problems.append(f"{len(differ)} windows differ (first {k}: expected {expected[k]}, got {observed.get(k)})")
    if extra:
        problems.append(f"{len(extra)} unexpected windows (first {extra[0]})")
    return {"ok": not problems, "windows_expected": len(expected), "windows_seen": len(observed),
            "windows_wrong": len(differ) + len(extra), "detail": "; ".join(problems) or "exact"}


def run(plan: Plan) -> dict[str, Any]:
    """The soak; returns its result (samples, summary, targets, file paths)."""
    load_before = os.getloadavg()
    capacity = None
    if plan.rate is None:
        log(f"  measuring capacity: backlog of {plan.capacity_records:,} records on {plan.store} ...")
        capacity = measure_capacity(plan)
        log(f"  capacity {capacity:,.0f} records/s")
    rate = plan.rate or capacity * plan.load_pct / 100  # type: ignore[operator]
    out_dir = Path(plan.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{commit()}-soak-{plan.store}-{plan.minutes:g}min"
    env = {}
    if plan.tracemalloc_s:
        env = {"MILLWHEEL_TRACEMALLOC_S": str(plan.tracemalloc_s), "MILLWHEEL_TRACEMALLOC_ROLES": "worker",
               "MILLWHEEL_TRACEMALLOC_DIR": str((out_dir / f"{stem}-tracemalloc").resolve())}
        Path(env["MILLWHEEL_TRACEMALLOC_DIR"]).mkdir(parents=True, exist_ok=True)
    feed = Feed(plan, rate)
    duration_s = plan.minutes * 60
    with tempfile.TemporaryDirectory(prefix="mw-bench-soak-") as tmpdir:
        tmp = Path(tmpdir)
        url, server = private_store(plan.store, tmp)
        svc = Service(url, 2, tmp, extra_env=env)
        try:
            _register(svc.client, topology(plan))
            svc.wait_balanced()
            reader = SinkReader(svc.new_client())
            sampler = Sampler(svc, plan, url, server, feed, reader)
            feed.start()
            started = feed.t0
            until = started + duration_s
            errors: list[BaseException] = []

            writer: InjectWriter | None = None

            def inject() -> None:
                nonlocal writer
                try:
                    if plan.feed == "writer":  # parallel ingestion: no controller on the data path
                        writer = InjectWriter(svc.new_client(), INJECTOR, stream=INJECTOR, writer="soak")
                        chunk: list[Record] = []
                        for record in feed.records(until, plan.batch):
                            chunk.append(record)
                            if len(chunk) >= plan.batch:  # as Inject's messages: its largest time - disorder
                                writer.write(chunk)
                                writer.advance(max(r.timestamp for r in chunk) - DISORDER_US)
                                chunk = []
                        writer.write(chunk)
                        writer.flush()
                        return
                    svc.new_client().inject(inject_messages(INJECTOR, INJECTOR, feed.records(until, plan.batch),
                                                            plan.batch, DISORDER_US))
                except BaseException as exc:  # noqa: BLE001 - reported with the result
                    errors.append(exc)

            sender = threading.Thread(target=inject, name="soak-inject", daemon=True)
            sender.start()
            sampler.sample(started)
            next_sample = started + plan.sample_s
            correct: dict[str, Any] | None = None
            complete, after_done, interrupted = False, {}, False
            try:
                while True:
                    now = time.monotonic()
                    if now >= next_sample:
                        row = sampler.sample(started)
                        next_sample += plan.sample_s
                        log("  " + _line(row))
                    if now >= until and not sender.is_alive():
                        break
                    time.sleep(min(LAG_POLL_S, max(0.05, next_sample - time.monotonic())))
                    sampler.poll_lag()
            except KeyboardInterrupt:  # keep what was sampled: the files are still written
                interrupted = True
                log("  interrupted: writing the samples taken so far")
            if not interrupted:
                sender.join()
                if errors:
                    raise RuntimeError(f"injection failed: {errors[0]!r}")
                if time.monotonic() - started - sampler.samples[-1]["t_min"] * 60 > plan.sample_s / 2:
                    sampler.sample(started)  # the end of the run, before done
                log("  done: closing the injector, waiting for every window ...")
                if writer is not None:
                    writer.done()
                    writer.close()
                else:
                    svc.client.inject(inject_messages(INJECTOR, INJECTOR, [], done=True))
                complete = reader.wait_rows(len(feed.expected), 300)
                time.sleep(1.0)  # a duplicate row would arrive after the last expected one
                correct = compare(feed.expected, reader.counts)
                after_done = {k: v for k, v in sampler.sample(started).items() if k.startswith("rss_mb.")}
                sampler.samples.pop()  # after done is not part of the series the targets judge
            restarts = sampler.roles.restarts
            reader.client.close()
        finally:
            svc.stop()
            if server is not None:
                server.stop()
            up_log = svc.log_path.read_text(errors="replace") if svc.log_path.exists() else ""
    incidents = {what: up_log.count(pattern) for what, pattern in INCIDENTS.items()}
    samples = sampler.samples
    if interrupted:
        duration_s = samples[-1]["t_min"] * 60
    summary = soak_series.summary(samples, duration_s)
    targets = soak_series.targets(samples, duration_s, correct, restarts)
    csv_path, png_path, json_path = (out_dir / f"{stem}.{ext}" for ext in ("csv", "png", "json"))
    soak_series.write_csv(csv_path, samples)
    soak_series.plot(png_path, samples, duration_s,
                     f"soak: millwheel up --workers 2, three stages, {plan.store}, {rate:,.0f} records/s "
                     f"({f'{plan.load_pct:g}% of ' + format(capacity, ',.0f') if capacity else 'given'}), "
                     f"{plan.minutes:g} min")
    result = {
        "plan": dataclasses.asdict(plan), "capacity_records_per_s": capacity, "rate": rate,
        "minutes": plan.minutes, "store": plan.store, "samples": samples, "summary": summary,
        "targets": targets, "rss_after_done_mb": after_done, "worker_restarts": restarts,
        "complete": complete, "correct": correct, "records": feed.sent,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "files": {"csv": str(csv_path), "png": str(png_path), "json": str(json_path)},
        "interrupted": interrupted, "incidents": incidents,
        "up_log_tail": up_log[-4000:] if not (correct or {}).get("ok") or restarts or any(incidents.values()) else "",
    }
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def _line(row: dict[str, Any]) -> str:
    rss = " ".join(f"{k[7:]} {v:.0f}" for k, v in row.items() if k.startswith("rss_mb.") and v is not None)
    store = row.get("store_mb.total", row.get("store_mb.used_memory"))
    return (f"{row['t_min']:6.1f} min  RSS MB: {rss}  store {store or 0:.1f} MB  "
            f"IDs {row.get('rows.consumed_ids', 0):,}  log {row.get('rows.log', 0):,}  "
            f"lag {row.get('lag_s.mean') or 0:.1f} s  "
            f"{row.get('rate.injected') or 0:,.0f} rec/s (count {row.get('rate.count_stage_in') or 0:,.0f})"
            f"  behind {row['lag_s.inject_behind']:.1f} s")


def table(result: dict[str, Any]) -> list[str]:
    """The targets as markdown rows, and what they are computed from."""
    lines = ["| target | measured | bound | met | detail |", "|---|---|---|---|---|"]
    for t in result["targets"]:
        v = "n/a" if t["value"] is None else f"{t['value']:,.2f} {t['unit']}"
        lines.append(f"| {t['target']} | {v} | {t['bound']:,.2f} | "
                     f"{ {True: 'yes', False: '**no**', None: 'n/a'}[t['met']]} | {t['detail']} |")
    return lines


# -- the opt-in "soak" section of ``python -m bench`` ----------------------------------------
def section(minutes: float, out_dir: Path, out: list[dict[str, Any]], case: Any,
            load_pct: float = 50.0) -> None:
    """The soak fed through ``InjectWriter`` (parallel ingestion): the controller's
    ``Inject``, one process, cannot keep the schedule at 70% of today's capacity."""
    case(out, f"soak {minutes:g} min, sqlite, {load_pct:g}% of capacity",
         {"figure": "soak", "store": "sqlite", "minutes": minutes, "load_pct": load_pct},
         run, Plan(minutes=minutes, load_pct=load_pct, out=str(out_dir), feed="writer"),
         summary=lambda r: "; ".join(f"{t['target'].split(' (')[0]}: "
                                     f"{'n/a' if t['value'] is None else format(t['value'], '.2f')} "
                                     f"{'met' if t['met'] else 'NOT met'}" for t in r["targets"]))


def entry_from(path: Path) -> dict[str, Any]:
    """A soak run alone (``python -m bench.cases.soak``, its ``STEM.json``) as the soak
    section's entry, for ``python -m bench --soak-from PATH``: an hour's soak need not
    be run again beside every other section. Raises ValueError naming what is missing."""
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a soak result: {exc}") from None
    missing = [k for k in ("plan", "minutes", "rate", "targets", "correct", "store") if k not in r] \
        if isinstance(r, dict) else ["an object"]
    if missing:
        raise ValueError(f"{path}: not a soak result (python -m bench.cases.soak writes one): "
                         f"no {', '.join(missing)}")
    return {"figure": "soak", "store": r["store"], "minutes": r["minutes"],
            "load_pct": r["plan"].get("load_pct", 50.0), "result": r, "from": path.name}


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for e in entries:
        r = e.get("result")
        lines += ["", f"## Soak: millwheel up --workers 2, three stages, {e.get('store')}", ""]
        if e.get("from"):
            lines += [f"Not run here: the soak run alone whose result is `{e['from']}` (`--soak-from`).", ""]
        if r is None:
            lines.append(f"Failed: {e.get('error', '')}")
            continue
        cap = r["capacity_records_per_s"]
        pct = r["plan"].get("load_pct", 50.0)
        lines += [f"{r['minutes']:g} minutes at {r['rate']:,.0f} records/s "
                  f"({f'{pct:g}% of the measured ' + format(cap, ',.0f') if cap else 'given'}), "
                  f"{r['records']:,} records; samples in `{Path(r['files']['csv']).name}`, "
                  f"plot `{Path(r['files']['png']).name}`.", ""] + table(r)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cases.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long to inject (default 30)")
    ap.add_argument("--rate", type=float, help="records/s (default: --load-pct of a backlog run measured first)")
    ap.add_argument("--load-pct", type=float, default=50.0,
                    help="without --rate: the share of the measured capacity to feed, in %% (default 50; "
                         "issue 31's soak: 70 for 60 minutes)")
    ap.add_argument("--store", default="sqlite", choices=STORES)
    ap.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples (default 60)")
    ap.add_argument("--state-ttl-s", type=float, default=60.0, help="the count stage's state TTL (default 60)")
    ap.add_argument("--id-retention-s", type=float, default=300.0,
                    help="record-ID retention of every stage (default 300)")
    ap.add_argument("--log-retention-s", type=float, default=300.0,
                    help="retention of every stage's logged streams, the sink's included (default 300)")
    ap.add_argument("--users", type=int, default=500, help="users active at a time (default 500)")
    ap.add_argument("--turnover-s", type=float, default=300.0,
                    help="the user population is replaced over this many seconds (default 300)")
    ap.add_argument("--batch", type=int, default=100, help="records per Inject message (default 100)")
    ap.add_argument("--feed", choices=("inject", "writer"), default="inject",
                    help="inject: the controller's Inject (default); writer: InjectWriter, straight to "
                         "the workers (parallel ingestion), which keeps up with today's capacity")
    ap.add_argument("--capacity-records", type=int, default=30_000,
                    help="records of the backlog run that measures capacity (default 30,000)")
    ap.add_argument("--tracemalloc-s", type=float,
                    help="workers write tracemalloc snapshots every this many seconds (slows them)")
    ap.add_argument("--out", default=str(RESULTS), help=f"output directory (default {RESULTS})")
    a = ap.parse_args(argv)
    if a.minutes <= 0 or a.sample_s <= 0 or (a.rate is not None and a.rate <= 0) or a.users < 1 \
            or a.load_pct <= 0:
        ap.error("--minutes, --sample-s, --rate, --load-pct and --users must be positive")
    if a.log_retention_s < 1:
        ap.error("--log-retention-s must be at least 1 (the store's smallest log retention)")
    plan = Plan(minutes=a.minutes, rate=a.rate, load_pct=a.load_pct, store=a.store, sample_s=a.sample_s,
                state_ttl_s=a.state_ttl_s,
                id_retention_s=a.id_retention_s, log_retention_s=a.log_retention_s, users=a.users,
                turnover_s=a.turnover_s, batch=a.batch, feed=a.feed,
                capacity_records=a.capacity_records, tracemalloc_s=a.tracemalloc_s, out=a.out)
    result = run(plan)
    print("\n".join(table(result)))
    after = {k[7:]: round(v or 0, 1) for k, v in result["rss_after_done_mb"].items()}
    print(f"RSS after done (MB): {json.dumps(after)}")
    print(f"wrote {result['files']['csv']}, .png and .json", file=sys.stderr)
    if any(result["incidents"].values()):
        print(f"incidents in the service's log: {json.dumps(result['incidents'])}")
    return 0 if (result["correct"] or {}).get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
