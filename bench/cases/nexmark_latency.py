"""Nexmark latency at 50% of capacity (issue 32): p50/p95/max from the moment an output's
inputs were all sent to the moment the output reached a reader, in the service.

::

    python -m bench.cases.nexmark --latency --queries q0,q5,q8 --feed-s 40
    python -m bench.cases.nexmark_latency ...          # the same

**Capacity first.** Unless given (``--capacity 20000`` for every query, or
``--capacity q0=20000,q5=31000``), each query's capacity is measured in the same run, in
the same service set-up as its latency: ``--events`` events (default 100,000, at ``--rate``
events/s of event time) of the tables the query reads, loaded by the feeder process below
before the clock starts, then written all at once by its writers from ``t0`` (``done``
after the last), and capacity = all the events generated / (the last row read - ``t0``):
events of every table, as the per-core figures count them, so it is a rate of event time
(q3 and q8 read persons and auctions alone, 8% of the events: their capacities are high
for that reason). No process start is in that time; the rows must equal local mode's.

**Paced so that event time is wall time.** The events fed are generated afresh at the rate
fed, ``R = --load-pct`` (default 50) % of the capacity, ``R x --feed-s`` of them (the
generator stamps event ``n`` ``base + n / R`` seconds, to the millisecond:
``millwheel/nexmark/generator.py``, ``GeneratorConfig.timestamp_us``), so the data's event
time advances at the rate the wall clock does. A feeder process (its own, so that it and
the reader never share a GIL) loads the tables the query reads, then from a start moment
``t0`` loops: ``T = base + (now - t0)`` (event time due now); every record stamped ``<= T``
not sent yet is handed to an :class:`~services.inject_writer.InjectWriter` (one per
injector, straight to the workers owning the ranges), flushed (acked), and each writer is
told its watermark ``T + 1 - disorder`` (``advance``; the writer sends it at most every
``--watermark-every-s``, its own default 0.2 s, as a user's writer would). Each pass is a
*tick*, logged as ``(T, the moment its records were handed over)``; a pass that is late
(its records due before ``now``) is still logged at the moment it sent them, so a feeder
that falls behind never counts its delay as the service's. At the end every writer sends
``done``.

**Latency of one output** = the moment the reader read it (a ``millwheel subscribe QUERY
--json --follow`` process started before the feed; each line stamped as this process
reads it) minus the moment everything the output depends on had been sent, found in the
tick log from the output's timestamp ``ts`` (:func:`complete_at_us`):

* **stateless and join outputs (q0, q1, q2, q3)** are stamped with their input event's
  time (q0-q2: the bid's ``dateTime``; q3: ``stream_join``'s ``max(t_person,
  t_auction)``, the later of the pair): the first tick with ``T >= ts``, the moment the
  (later) input event was sent;
* **windowed outputs (q4, q5, q7, q8, q11)** are stamped ``end - 1`` of their window (q5:
  ``window_top``'s 2 s window over the sliding counts, its ``end`` in the row; q7:
  ``window_top``'s 10 s window; q8: ``window_join``'s 10 s window, ``starttime + 10 s``;
  q11: ``session_window``'s session, ``endtime`` = last bid + 10 s; q4: the auction's
  ``expires``, the end - 1 of its ``[expires, expires + 1)`` session and the running mean
  stamped with it): the first tick with ``T >= ts + disorder``, i.e. ``T + 1 - disorder >=
  end``: the moment the feed had sent every event stamped before ``end + disorder`` and
  could move the watermark past the window's end (for in-order data, the moment the first
  event at or past the end was due). So a window's length is not latency; what the
  service takes to see the watermark pass the end, fire the window and deliver the row,
  the writer's watermark cadence included, is.

Outputs whose inputs were complete in the first ``--warmup-s`` (default 5) seconds of
the feed are not measured (links opening, q5's first sliding windows partial), nor
those that depend on the final ``done`` (windows the feed never closed): the table
counts the outputs measured, and for windowed queries the distinct windows (moments)
they come from (q7 and q8 give one moment per 10 s window, so a 30 s feed gives 3).
The table also shows how late the feeder was at worst (*feeder late*: a tick's records
sent after they were due, the writers' flush having waited), which latency leaves out.

**Output checked.** The same data is run by ``millwheel run`` first (untimed); the rows the
service gave must equal them (q4: the final mean per category, its running means
interleaving differently), and the reader waits for that many rows after ``done``.

**q4** is paced like the others: its spec is rendered for the data fed (the interval
join's ``upper_us`` is that data's longest auction, which grows as the rate falls: at
400 events/s an auction lasts up to ~8.3 s of event time), and its latency counts from
the auction's ``expires``, not from its bids.

**Local mode is not measured**: ``millwheel run`` can follow a paced input (a ``files``
source without ``until: end`` reads lines appended to its files), but prints its output
streams only when the run ends (``--print``); a live output would have to go through a
Redis, NATS or PostgreSQL sink and read from there, measuring that system's delivery too.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any, Callable, cast

from bench.cases.nexmark_runs import (
    cli_env,
    commit,
    end_service,
    local_run,
    machine,
    registered_service,
    service_spec,
    write_data,
)
from bench.harness import ROOT, log
from bench.peers import nexmark_compare as nc
from millwheel.nexmark.meta import read_meta
from millwheel.nexmark.queries import QUERIES

#: How each query stamps its output, and so which moment an output's latency counts from
#: (:func:`complete_at_us`): "event", the (later) input event's time; "window", the
#: window's end - 1.
KINDS = {"q0": "event", "q1": "event", "q2": "event", "q3": "event", "q4": "window", "q5": "window",
         "q7": "window", "q8": "window", "q11": "window"}
#: The timestamp of each query's output that its latency is measured from (for the table).
OUTPUT_TIME = {
    "q0": "the bid's dateTime", "q1": "the bid's dateTime", "q2": "the bid's dateTime",
    "q3": "max(person, auction) dateTime (stream_join)",
    "q4": "the auction's expires (= session end - 1)", "q5": "end - 1 of the 2 s window_top (end in the row)",
    "q7": "end - 1 of the 10 s window", "q8": "end - 1 of the 10 s window (starttime + 10 s - 1)",
    "q11": "end - 1 of the session (endtime - 1)",
}
LOAD_PCT = 50.0
FEED_S = 30.0
WARMUP_S = 5.0
WATERMARK_EVERY_S = 0.2  #: InjectWriter's default
CAPACITY_EVENTS = 100_000
START_DELAY_S = 0.5  #: between the feeder's "ready" and its t0
MAX_SLEEP_S = 0.005  #: the longest the feeder waits between ticks (its watermark moves with time)


# -- the latency of an output -------------------------------------------------------------------

def complete_at_us(query: str, ts: int, disorder_us: int = 0) -> int:
    """The event time ``T`` the feed must have reached (every event stamped ``<= T`` sent,
    its watermark ``T + 1 - disorder`` handed to the writers) for everything an output of
    ``query`` stamped ``ts`` depends on to have been sent: ``ts`` for an output stamped with
    its (later) input event's time, ``ts + disorder`` for one stamped ``end - 1`` of its
    window (the watermark may then reach ``end``)."""
    kind = KINDS[query]
    if kind == "event":
        return ts
    return ts + disorder_us


class TickLog:
    """The feeder's ticks: ``T`` (event time sent up to, rising) and the wall moment
    (``time.monotonic()``) of each."""

    def __init__(self, event_times: list[int], moments: list[float]) -> None:
        if len(event_times) != len(moments):
            raise ValueError("a tick log needs one moment per event time")
        self.event_times = event_times
        self.moments = moments

    def sent_at(self, t_us: int) -> float | None:
        """The moment of the first tick that reached event time ``t_us``; None if none did
        (the output depends on what the feed's ``done`` closed)."""
        i = bisect.bisect_left(self.event_times, t_us)
        return self.moments[i] if i < len(self.moments) else None


def latencies(query: str, outputs: Iterable[tuple[int, float]], ticks: TickLog, disorder_us: int = 0,
              measure_from: float = float("-inf")) -> list[tuple[float, float]]:
    """``(sent, latency_s)`` of each output ``(ts, arrived)`` whose inputs were complete
    within the feed, at or after ``measure_from`` (the end of the warm-up)."""
    out = []
    for ts, arrived in outputs:
        sent = ticks.sent_at(complete_at_us(query, ts, disorder_us))
        if sent is not None and sent >= measure_from:
            out.append((sent, arrived - sent))
    return out


def quantile(sorted_xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of a sorted, non-empty list."""
    return sorted_xs[max(0, math.ceil(q * len(sorted_xs)) - 1)]


def summary(measured: list[tuple[float, float]]) -> dict[str, Any]:
    """Outputs measured, distinct moments they come from, p50/p95/max latency in ms."""
    xs = sorted(lat for _, lat in measured)
    if not xs:
        return {"outputs": 0, "moments": 0, "p50_ms": None, "p95_ms": None, "max_ms": None}
    return {"outputs": len(xs), "moments": len({sent for sent, _ in measured}),
            "p50_ms": round(quantile(xs, 0.5) * 1000, 1), "p95_ms": round(quantile(xs, 0.95) * 1000, 1),
            "max_ms": round(xs[-1] * 1000, 1), "min_ms": round(xs[0] * 1000, 1)}


# -- the feeder (a process of its own) ----------------------------------------------------------

def feed(conn: Connection, address: str, sources: list[tuple[str, str]], base_us: int, disorder_us: int,
         watermark_every_s: float, paced: bool = True) -> None:
    """Load each ``(injector, file)``, say ``ready``, take ``t0`` and feed by event time as the
    module docstring says (``paced=False``: everything at once, the capacity run); send back
    the tick log (or ``("error", text)``)."""
    try:
        conn.send(("result", _feed(conn, address, sources, base_us, disorder_us, watermark_every_s, paced)))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        conn.send(("error", f"{exc.__class__.__name__}: {exc}"))
    finally:
        conn.close()


def _feed(conn: Connection, address: str, sources: list[tuple[str, str]], base_us: int, disorder_us: int,
          watermark_every_s: float, paced: bool) -> dict[str, Any]:
    from millwheel.sources import parse_json_record
    from services.client import ControllerClient
    from services.inject_writer import InjectWriter

    tables = []
    for injector, path in sources:
        with open(path, "rb") as fh:
            records = [parse_json_record(line, path) for line in fh if line.strip()]
        tables.append((injector, records, [r.timestamp for r in records]))
    client = ControllerClient(address, timeout_s=30)
    writers = [InjectWriter(client, injector, stream=injector, writer="latency", watermark_every_s=watermark_every_s)
               for injector, _, _ in tables]
    last = max((stamps[-1] for _, _, stamps in tables if stamps), default=base_us)
    conn.send(("ready", sum(len(records) for _, records, _ in tables)))
    t0 = float(conn.recv())
    while time.monotonic() < t0:
        time.sleep(min(0.01, max(0.0, t0 - time.monotonic())))
    at = [0] * len(tables)
    event_times: list[int] = []
    moments: list[float] = []
    behind: list[float] = []  # per tick with records: how late its first record went
    sent = 0
    while True:
        now = time.monotonic()
        t = base_us + int((now - t0) * 1e6) if paced else last
        event_times.append(t)
        moments.append(now)
        first_due: int | None = None
        for k, (w, (_, records, stamps)) in enumerate(zip(writers, tables, strict=True)):
            j = bisect.bisect_right(stamps, t, lo=at[k])
            if j > at[k]:
                first_due = stamps[at[k]] if first_due is None else min(first_due, stamps[at[k]])
                w.write(records[at[k]:j])
                sent += j - at[k]
                at[k] = j
        for w in writers:
            w.flush()
        for w in writers:
            w.advance(t + 1 - disorder_us)
        if first_due is not None:
            behind.append(now - (t0 + (first_due - base_us) / 1e6))
        due = [stamps[at[k]] for k, (_, _, stamps) in enumerate(tables) if at[k] < len(stamps)]
        if not due:
            break
        wake = t0 + (min(due) - base_us) / 1e6
        time.sleep(max(0.0, min(wake, time.monotonic() + MAX_SLEEP_S) - time.monotonic()))
    ended = time.monotonic()
    for w in writers:
        w.done()
    done_at = time.monotonic()
    for w in writers:
        w.close()
    client.close()
    behind.sort()
    return {"event_times": event_times, "moments": moments, "t0": t0, "ended": ended, "done_at": done_at,
            "records": sent, "ticks": len(moments),
            "behind_p50_ms": round(quantile(behind, 0.5) * 1000, 1) if behind else None,
            "behind_max_ms": round(behind[-1] * 1000, 1) if behind else None}


class _Stamped:
    """A stream's lines as they are read, each non-blank one noted with the moment
    (``time.monotonic()``) it was read: what ``_Lines`` reads, in its thread."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.moments: list[float] = []

    def __iter__(self) -> Iterator[bytes]:
        for raw in self._stream:
            if raw.strip():
                self.moments.append(time.monotonic())
            yield raw


# -- one latency run in the service -------------------------------------------------------------

def same_rows(query: str, service: list[dict[str, Any]], local: list[dict[str, Any]]) -> nc.Verdict:
    """The service's rows against local mode's: equal as multisets; q4's by the final mean
    of each category (its running means are produced in the order finals reach a category,
    which differs between runs)."""
    if query != "q4":
        return nc.same_output(query, service, local)

    def finals(vals: list[dict[str, Any]]) -> dict[str, tuple[int, Any]]:
        last: dict[str, tuple[int, Any]] = {}
        for v in vals:
            if v["count"] >= last.get(v["key"], (0, None))[0]:
                last[v["key"]] = (v["count"], v["value"])
        return last

    a, b = finals(service), finals(local)
    ok = a == b and len(service) == len(local)
    return nc.Verdict(ok, f"final means {'equal' if ok else 'differ'} ({len(service):,} rows vs {len(local):,})",
                      len(service))


def latency_run(query: str, data: Path, expected: list[dict[str, Any]], work: Path, label: str,
                warmup_s: float = WARMUP_S, watermark_every_s: float = WATERMARK_EVERY_S,
                timeout_s: float = 300, paced: bool = True) -> dict[str, Any]:
    """``millwheel up`` + ``register`` (bench/cases/nexmark.py's), a ``subscribe --follow``
    reader, the paced feed in its own process, ``done``, every expected row read; the
    latency of each output (see the module docstring). ``paced=False`` is the capacity
    run: every record at once from ``t0``, capacity = the events / (the last row read - ``t0``)."""
    from bench.cases.cli_vs_local import _Lines

    meta = read_meta(data)
    spec, tables = service_spec(data, query)
    disorder = int(meta["max_disorder_us"])
    base_us = int(meta["config"]["base_time_us"])
    svc_dir = work / f"latency-{query}-{label}"
    svc_dir.mkdir()
    run: dict[str, Any] = {"query": query, "rate": meta["config"]["rate"], "events": meta["config"]["events"],
                           "event_time_s": meta["duration_us"] / 1e6, "disorder_us": disorder}
    svc = None
    try:
        started = time.monotonic()
        svc = registered_service(spec, svc_dir)
        log(f"    service up, {query} registered ({time.monotonic() - started:.1f} s)")
        with open(svc_dir / "subscribe.err", "w+b") as err_file:
            sub = subprocess.Popen([sys.executable, "-m", "services.cli", "subscribe", query, "--json", "--follow",
                                    "--controller", svc.address], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                                   stderr=err_file)
            assert sub.stdout is not None
            stamped = _Stamped(sub.stdout)
            reader = _Lines(cast("IO[bytes]", stamped))
            try:
                fed = _run_feeder(svc.address, [(name, str(data / meta["files"][table])) for name, table in tables],
                                  base_us, disorder, watermark_every_s, run["event_time_s"] + timeout_s, paced)
                complete = reader.wait(len(expected), timeout_s)
                log(f"    fed {fed['records']:,} records in {fed['ended'] - fed['t0']:.1f} s (behind at most "
                    f"{fed['behind_max_ms']} ms); {len(reader.lines):,} of {len(expected):,} rows read "
                    f"{time.monotonic() - fed['done_at']:.1f} s after done")
                time.sleep(0.3)  # a duplicate row would arrive after the last expected one
            finally:
                reader.stop(sub)
            if not complete:
                err_file.seek(0)
                run["error"] = (f"subscribe printed {len(reader.lines)} of {len(expected)} rows in time: "
                                f"{err_file.read().decode(errors='replace')[-800:]}")
        lines = reader.lines[:len(stamped.moments)]
        values = nc.values(lines)
        verdict = same_rows(query, values, expected)
        run["check"] = {"ok": verdict.ok and not run.get("error"), "detail": verdict.detail}
        ticks = TickLog(fed.pop("event_times"), fed.pop("moments"))
        outputs = [(json.loads(line)["timestamp"], at) for line, at in zip(lines, stamped.moments, strict=True)]
        if not paced:
            last = max((at for _, at in outputs), default=fed["done_at"])
            run.update(fed, rows=len(values), wall_s=round(last - fed["t0"], 3),
                       capacity_events_per_s=round(run["events"] / (last - fed["t0"]), 1))
            return run
        measured = latencies(query, outputs, ticks, disorder, fed["t0"] + warmup_s)
        feed_s = fed["ended"] - fed["t0"]
        run.update(fed, rows=len(values), feed_s=round(feed_s, 2),
                   events_per_s=round(run["events"] / feed_s, 1) if feed_s > 0 else None,
                   records_per_s=round(fed["records"] / feed_s, 1) if feed_s > 0 else None,
                   latency=summary(measured), latencies_ms=[round(lat * 1000, 2) for _, lat in measured])
    except Exception as exc:  # noqa: BLE001 - the run fails, the case goes on
        run["error"] = f"{exc.__class__.__name__}: {exc}"
    finally:
        end_service(svc, svc_dir, run)
    return run


def _run_feeder(address: str, sources: list[tuple[str, str]], base_us: int, disorder_us: int,
                watermark_every_s: float, timeout_s: float, paced: bool) -> dict[str, Any]:
    """:func:`feed` in a spawned process: its records loaded, then ``t0`` a moment later;
    its tick log."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=feed, args=(child, address, sources, base_us, disorder_us, watermark_every_s, paced),
                       name="nexmark-feeder", daemon=True)
    proc.start()
    child.close()
    try:
        def answer(wait_s: float) -> tuple[str, Any]:
            if not parent.poll(wait_s):
                raise TimeoutError(f"the feeder said nothing in {wait_s:.0f} s")
            kind, what = parent.recv()
            if kind == "error":
                raise RuntimeError(f"the feeder failed: {what}")
            return str(kind), what

        _, records = answer(300)
        log(f"    feeder: {records:,} records loaded; feeding")
        parent.send(time.monotonic() + START_DELAY_S)
        _, result = answer(timeout_s)
        return cast("dict[str, Any]", result)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        parent.close()


# -- the case -----------------------------------------------------------------------------------

def parse_capacity(text: str | None, queries: tuple[str, ...]) -> dict[str, float]:
    """``--capacity``: one events/s figure for every query, or ``q0=20000,q5=31000``."""
    if not text:
        return {}
    text = text.strip()
    if "=" not in text:
        return {q: float(text) for q in queries}
    given: dict[str, float] = {}
    for part in text.split(","):
        q, _, v = part.partition("=")
        if q.strip() not in QUERIES:
            raise ValueError(f"--capacity: no Nexmark query {q.strip()!r}")
        given[q.strip()] = float(v)
    return given


def case(queries: tuple[str, ...] = QUERIES, capacity_events: int = CAPACITY_EVENTS, rate: int = 10_000,
         seed: int = 32, feed_s: float = FEED_S, load_pct: float = LOAD_PCT, rounds: int = 1,
         capacity: dict[str, float] | None = None, warmup_s: float = WARMUP_S,
         watermark_every_s: float = WATERMARK_EVERY_S, disorder: int = 1, timeout_s: float = 600,
         emit: Callable[[dict[str, Any]], None] | None = None, workdir: Path | None = None) -> dict[str, Any]:
    """Capacities (measured or given), then per query and round a latency run at
    ``load_pct`` % of its capacity; the result per query (every run under ``runs``)."""
    given = dict(capacity or {})
    load_before = os.getloadavg()
    capacities: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mw-bench-nexmark-latency-", dir=workdir) as tmpdir:
        tmp = Path(tmpdir)
        work = tmp / "work"
        work.mkdir()
        todo = [q for q in queries if q not in given]
        if todo:
            log(f"nexmark latency: capacity of {', '.join(todo)} in the service ({capacity_events:,} events at "
                f"{rate:,} events/s of event time) ...")
            data = write_data(tmp / "capacity", capacity_events, rate, seed, disorder)
            for q in todo:
                ref = _reference(data, q, work, "capacity", timeout_s)
                r: dict[str, Any] = latency_run(q, data, ref["values"], work, "capacity", timeout_s=timeout_s,
                                                paced=False) if not ref.get("error") else \
                    {"error": f"local mode failed: {ref['error']}"}
                ok = not r.get("error") and r["check"]["ok"]
                capacities[q] = {"events_per_s": r["capacity_events_per_s"] if ok else None, "measured": True,
                                 "wall_s": r.get("wall_s"), "records": r.get("records"),
                                 "error": None if ok else (r.get("error") or r["check"]["detail"])}
                log(f"  {q}: capacity {capacities[q]['events_per_s'] or 0:,.0f} events/s "
                    f"({r.get('records', 0):,} records in {r.get('wall_s') or 0:.1f} s)"
                    + (f" ERROR {capacities[q]['error'][:300]}" if capacities[q]["error"] else ""))
            shutil.rmtree(data, ignore_errors=True)
        for q, v in given.items():
            if q in queries:
                capacities[q] = {"events_per_s": v, "measured": False, "wall_s": None, "error": None}
        for q in queries:
            cap = capacities[q]["events_per_s"]
            if not cap:
                continue
            fed_rate = max(1, round(cap * load_pct / 100))
            events = max(1, int(fed_rate * feed_s))
            log(f"nexmark latency {q}: {events:,} events at {fed_rate:,} events/s ({load_pct:g}% of {cap:,.0f}) ...")
            started = time.monotonic()
            data = write_data(tmp / f"latency-{q}", events, fed_rate, seed, disorder)
            log(f"    generated in {time.monotonic() - started:.1f} s")
            ref = _reference(data, q, work, "latency", timeout_s)
            for i in range(1, rounds + 1):
                if ref.get("error"):
                    r = {"query": q, "error": f"local mode failed: {ref['error']}"}
                else:
                    r = latency_run(q, data, ref["values"], work, str(i), warmup_s, watermark_every_s, timeout_s)
                r.update(round=i, capacity_events_per_s=cap, load_pct=load_pct)
                lat = r.get("latency") or {}
                log(f"  round {i} {q}: {lat.get('outputs', 0):,} outputs measured, p50 {lat.get('p50_ms')} ms, "
                    f"p95 {lat.get('p95_ms')} ms, max {lat.get('max_ms')} ms"
                    + (f" ERROR {r['error'][:300]}" if r.get("error") else f"; output {r['check']['detail']}"))
                runs.append(r)
                if emit is not None:
                    emit({k: v for k, v in r.items() if k != "latencies_ms"})
            shutil.rmtree(data, ignore_errors=True)
    out: dict[str, Any] = {
        "mode": "service", "workers": 2, "load_pct": load_pct, "feed_s": feed_s, "warmup_s": warmup_s,
        "watermark_every_s": watermark_every_s, "rounds": rounds, "seed": seed, "disorder_group": disorder,
        "capacity_events": capacity_events, "capacity_rate": rate, "capacities": capacities,
        "cpus": os.cpu_count(), "machine": machine(), "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()], "runs": runs,
        "local_mode": "not measured: millwheel run prints its output only when the run ends",
        "queries": {q: summarize_query(q, [r for r in runs if r["query"] == q], capacities.get(q, {}))
                    for q in queries},
    }
    for r in runs:  # summarized: the JSON keeps each run's figures, not every output's latency
        r.pop("latencies_ms", None)
    return out


def _reference(data: Path, query: str, work: Path, label: str, timeout_s: float) -> dict[str, Any]:
    """bench/cases/nexmark.py's ``local_run`` (``millwheel run``): the rows the service's must equal."""
    started = time.monotonic()
    ref = local_run(data, query, work, label, timeout_s)
    log(f"    local mode's rows: {len(ref['values']):,} ({time.monotonic() - started:.1f} s)")
    return ref


def summarize_query(query: str, runs: list[dict[str, Any]], capacity: dict[str, Any]) -> dict[str, Any]:
    """A query's latency over every round's outputs together; the rate fed (mean over rounds)."""
    good = [r for r in runs if not r.get("error") and r.get("check", {}).get("ok")]
    lat_ms = sorted(x for r in good for x in r["latencies_ms"])
    s: dict[str, Any] = {"ok": bool(runs) and len(good) == len(runs), "capacity_events_per_s":
                         capacity.get("events_per_s"), "capacity_measured": capacity.get("measured"),
                         "output_time": OUTPUT_TIME[query], "kind": KINDS[query], "runs": len(runs)}
    if capacity.get("error"):
        s["error"] = f"capacity: {capacity['error'][:300]}"
    bad = [r for r in runs if r not in good]
    if bad:
        s["error"] = "; ".join((r.get("error") or r.get("check", {}).get("detail", ""))[:300] for r in bad)
    if good:
        s.update(rate_fed=round(sum(r["rate"] for r in good) / len(good)),
                 events_per_s=round(sum(r["events_per_s"] for r in good) / len(good), 1),
                 records_per_s=round(sum(r["records_per_s"] for r in good) / len(good), 1),
                 outputs=len(lat_ms), moments=sum(r["latency"]["moments"] for r in good),
                 p50_ms=round(quantile(lat_ms, 0.5), 1) if lat_ms else None,
                 p95_ms=round(quantile(lat_ms, 0.95), 1) if lat_ms else None,
                 max_ms=round(lat_ms[-1], 1) if lat_ms else None,
                 feeder_behind_max_ms=max((r["behind_max_ms"] or 0) for r in good))
    return s


# -- the report ---------------------------------------------------------------------------------

def table_lines(res: dict[str, Any]) -> list[str]:
    """The markdown table: per query, the rate fed, outputs measured, p50/p95/max latency."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    lines = [
        f"Nexmark latency in the service (`millwheel up --workers 2`, SQLite), fed at {res['load_pct']:g}% of each "
        f"query's capacity for {res['feed_s']:g} s (event time = wall time), {res['warmup_s']:g} s warm-up not "
        f"measured, writer watermark every {res['watermark_every_s']:g} s, {res['rounds']} round(s), "
        f"{res['cpus']} CPUs here; latency = output read by `subscribe` - everything it depends on sent "
        f"(*feeder late*: how far behind its schedule the feeder sent a tick's records, which latency does not "
        f"count):", "",
        "| query | capacity (events/s) | rate fed (events/s) | records sent/s | outputs measured | windows | "
        "p50 ms | p95 ms | max ms | feeder late, max ms | latency from | output |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q, s in res["queries"].items():
        cap = s.get("capacity_events_per_s")
        cap_cell = "-" if not cap else f"{cap:,.0f}" + ("" if s.get("capacity_measured") else " (given)")
        windows = str(s["moments"]) if s.get("kind") == "window" and "moments" in s else "-"
        check = "equal to local mode" if s["ok"] else "**FAILED**: " + s.get("error", "")[:160]
        lines.append(
            f"| {q} | {cap_cell} | {s['rate_fed']:,} | {s['records_per_s']:,.0f} | {s['outputs']:,} | {windows} | "
            f"{ms(s['p50_ms'])} | {ms(s['p95_ms'])} | {ms(s['max_ms'])} | {ms(s['feeder_behind_max_ms'])} | "
            f"{s['output_time']} | {check} |"
            if "rate_fed" in s else
            f"| {q} | {cap_cell} | - | - | - | - | - | - | - | - | {s['output_time']} | {check} |")
    return lines


def report_lines(res: dict[str, Any]) -> list[str]:
    """What the command prints: the table, issue 32's latency rows and where it ran."""
    lines = [*table_lines(res), "", "Issue 32's latency rows (no bound in the issue: measured, not judged):", "",
             "| target | value | note |", "|---|---|---|"]
    for t in res["targets"]:
        lines.append(f"| {t['target']} | {'-' if t['value'] is None else format(t['value'], ',.0f')} {t['unit']} | "
                     f"{t['note']} |")
    return [*lines, "", f"Machine: {res['machine']['cpu_model']}, {res['cpus']} CPUs, {res['machine']['platform']}; "
            f"commit {res['commit']}; load average before {res['load_before']}, after {res['load_after']}; command "
            f"`{res['command']}`."]


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    """The ``nexmark-latency`` section of a bench run's markdown."""
    lines = ["", "## Nexmark latency at 50% of capacity, the service (bench/cases/nexmark_latency.py)", ""]
    for e in entries:
        r = e.get("result")
        lines += table_lines(r) if r is not None else [f"Failed: {e.get('error', '')}"]
    return lines


def section(queries: tuple[str, ...], feed_s: float, out: list[dict[str, Any]], run_case: Any) -> None:
    """The ``nexmark-latency`` section of ``python -m bench`` (opt-in): the case in a fresh process."""
    run_case(out, f"nexmark latency {', '.join(queries)}, {feed_s:g} s each",
             {"figure": "nexmark-latency", "queries": list(queries), "feed_s": feed_s}, case_checked, queries,
             feed_s, summary=lambda r: ", ".join(f"{q} p50 {s.get('p50_ms')} p95 {s.get('p95_ms')} ms"
                                                 for q, s in r["queries"].items()))


def case_checked(queries: tuple[str, ...], feed_s: float) -> dict[str, Any]:
    """:func:`case` with the suite's verdict (``correct``): every run's rows equal local mode's."""
    r = case(queries, feed_s=feed_s)
    bad = [q for q, s in r["queries"].items() if not s["ok"]]
    r["correct"] = {"ok": not bad, "detail": "every run's rows equal local mode's" if not bad else
                    "; ".join(f"{q}: {r['queries'][q].get('error', '')[:200]}" for q in bad)}
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cases.nexmark --latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Progress on stderr, one JSON line per run on stdout, then the table. "
                                        "Exits 1 if a run failed or its rows differed from local mode's.")
    ap.add_argument("--queries", default=",".join(QUERIES), help=f"comma-separated (default {','.join(QUERIES)})")
    ap.add_argument("--events", type=int, default=CAPACITY_EVENTS,
                    help=f"events of the capacity runs (default {CAPACITY_EVENTS:,})")
    ap.add_argument("--rate", type=int, default=10_000, help="events/s of event time of the capacity data (default "
                                                             "10000; the latency data's is the rate fed)")
    ap.add_argument("--capacity", metavar="N|qN=N,...",
                    help="events/s taken as capacity instead of measuring it: one figure, or per query")
    ap.add_argument("--load-pct", type=float, default=LOAD_PCT, help="share of capacity fed, %% (default 50)")
    ap.add_argument("--feed-s", type=float, default=FEED_S, help=f"seconds of feed per query (default {FEED_S:g})")
    ap.add_argument("--warmup-s", type=float, default=WARMUP_S,
                    help=f"first seconds of the feed not measured (default {WARMUP_S:g})")
    ap.add_argument("--watermark-every-s", type=float, default=WATERMARK_EVERY_S,
                    help="the writers' watermark cadence (InjectWriter's watermark_every_s, default 0.2)")
    ap.add_argument("--rounds", type=int, default=1, help="latency runs per query, outputs pooled (default 1)")
    ap.add_argument("--seed", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may wait (default 600)")
    ap.add_argument("--json-out", metavar="PATH", help="write the whole result as JSON to PATH")
    ap.add_argument("--md-out", metavar="PATH", help="write the markdown table to PATH")
    args = ap.parse_args(argv)
    queries = tuple(q.strip() for q in args.queries.split(",") if q.strip())
    unknown = [q for q in queries if q not in QUERIES]
    if unknown:
        ap.error(f"no Nexmark query {', '.join(unknown)}; there are {', '.join(QUERIES)}")
    if args.events < 1000 or args.rate < 1 or args.rounds < 1 or args.feed_s <= args.warmup_s or args.warmup_s < 0 \
            or not 0 < args.load_pct <= 100 or args.watermark_every_s < 0:
        ap.error("--events >= 1000, --rate and --rounds >= 1, 0 <= --warmup-s < --feed-s, 0 < --load-pct <= 100, "
                 "--watermark-every-s >= 0")
    try:
        given = parse_capacity(args.capacity, queries)
    except ValueError as exc:
        ap.error(str(exc))
    rev = commit()
    res = case(queries, args.events, args.rate, args.seed, args.feed_s, args.load_pct, args.rounds, given,
               args.warmup_s, args.watermark_every_s, timeout_s=args.timeout,
               emit=lambda r: print(json.dumps(r), flush=True))
    res["commit"] = rev
    res["command"] = "python -m bench.cases.nexmark --latency " + " ".join(
        argv if argv is not None else sys.argv[1:])
    from bench.report.targets import nexmark_latency_rows

    res["targets"] = nexmark_latency_rows(res)
    text = "\n".join(report_lines(res))
    print()
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")
    if args.md_out:
        Path(args.md_out).write_text(text + "\n")
    bad = [q for q, s in res["queries"].items() if not s["ok"]]
    if bad:
        print(f"FAILED or output differed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
