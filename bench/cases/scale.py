"""The scale-out figure: the three-stage pipeline across ``millwheel up --workers W``,
fed by parallel ingestion (several writer processes, ``InjectWriter``).

For each store (SQLite, a private ``redis-server`` without AOF, or ``redis-cluster-noaof``: a
private Redis Cluster of 3 masters without replicas or AOF, the store sharded) and each worker count W,
on a fresh store:

* ``millwheel up --workers W``; the three-stage pipeline (bench/pipelines.py: parse ->
  count -> sink, exactly-once, strong productions) registered with 2 x W key ranges per
  computation and 2 x W injector key ranges; the ranges balanced over the workers first.
* The workload (``bench.workload.generate(n, late_fraction=0.0)``, keyed by source
  partition as every three-stage figure) split round-robin among the writer processes
  (``records[i::writers]``): each share keeps timestamp order within the 2 s disorder bound
  and spans the whole time range, so no record is late. Each writer is a spawned process
  with its own ``ControllerClient`` and ``InjectWriter``; it generates its share, registers
  as a writer, and waits at a start event (none of that is timed). Then it writes its share
  in chunks of ``--batch`` records, advancing its watermark after each chunk to (newest
  timestamp written - 2 s), and says ``done()``.
* The clock starts when the writers are told to go and stops when the sink stream (read by
  ``Subscribe`` in this process) holds every window row; the rows must equal the exact
  expected counts (``bench.workload.check``).

Reported per run: records/s end to end; CPU seconds of every process during the run
(controller, each worker, each worker's watchdog, each writer as its own
``time.process_time()``, and the Redis server when there is one); CPU microseconds per
record summed over those processes; the busiest of them and its share of that CPU. The
process following the sink (this one) is the measurement, not the service: its CPU is
reported apart (``reader_cpu_s``) and counted in neither sum nor share.

Local mode's three-stage backlog (``bench.cases.service._local_three``: SQLite, one process,
in a fresh process) runs once per repeat, before that repeat's service runs, as the
"x local" yardstick of every store.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import pipelines, workload
from bench.cases.service import INJECTOR, Service, SinkReader, _local_three
from bench.harness import log, private_store, process_cpu_s
from bench.workload import DISORDER_US
from millwheel.record import MIN_TIMESTAMP
from services.client import ControllerClient
from services.rpc.convert import spec_to_proto

STORES = ("sqlite", "redis", "redis-cluster-noaof")


# -- the writer processes --------------------------------------------------------------
def _writer(index: int, writers: int, n: int, address: str, batch: int,
            results: Any, go: Any) -> None:
    """One writer process: its share of the workload, written once ``go`` is set.

    Puts ``{"index", "ready"}`` on ``results`` when set up (records built, writer
    registered), then ``{"index", "cpu_s", ...}`` when done, or ``{"index", "error"}``."""
    import logging

    logging.basicConfig(level=logging.WARNING, format=f"writer{index}: %(name)s %(levelname)s %(message)s")
    try:
        from services.generated import millwheel_pb2 as pb
        from services.inject_writer import InjectWriter
        from services.rpc.security import Security

        w = workload.generate(n, late_fraction=0.0)
        share = pipelines.injected(w.records, "three")[index::writers]
        del w
        msgs = [pb.Record(key=r.key, value=r.value, timestamp=r.timestamp, id=r.record_id) for r in share]
        del share
        client = ControllerClient(address, timeout_s=30, security=Security())
        try:
            with InjectWriter(client, INJECTOR, stream=INJECTOR, writer=f"w{index}", batch=batch,
                              window=8) as writer:
                results.put({"index": index, "ready": True})
                go.wait()
                cpu0 = time.process_time()
                t0 = time.monotonic()
                newest = MIN_TIMESTAMP
                for start in range(0, len(msgs), batch):
                    chunk = msgs[start:start + batch]
                    writer.write(chunk)
                    newest = max(newest, max(m.timestamp for m in chunk))
                    writer.advance(newest - DISORDER_US)
                writer.done()
                finished = time.monotonic()
                # closing its links is no news (PeerLink.close logs each as a reset): those
                # while writing still show
                logging.getLogger("millwheel.worker").setLevel(logging.ERROR)
                results.put({"index": index, "records": len(msgs), "cpu_s": time.process_time() - cpu0,
                             "write_s": finished - t0, "finished": finished, "written": writer.written,
                             "resent": writer.resent, "route_fetches": writer.route_fetches})
        finally:
            client.close()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        results.put({"index": index, "error": traceback.format_exc()[-3000:]})


# -- the service -----------------------------------------------------------------------
def register(client: ControllerClient, key_ranges: int) -> None:
    """The three-stage pipeline, ``key_ranges`` per computation and for its injector."""
    topo = pipelines.topology("three", productions="strong", key_ranges=key_ranges)
    for inj in topo.injectors:
        client.register_injector(inj.name, inj.stream, key_ranges)
    for spec in topo.computations:
        logged = [s for s in spec.all_outputs() if s in topo.log_streams]
        client.register_computation(spec_to_proto(spec), logged)


@contextlib.contextmanager
def _running(store: str, workers: int) -> Iterator[tuple[Service, dict[str, int]]]:
    """(the service, extra processes to count: the private Redis) on a fresh store, the
    pipeline registered with 2 x ``workers`` ranges everywhere and balanced."""
    with tempfile.TemporaryDirectory(prefix="mw-bench-scale-") as tmpdir:
        tmp = Path(tmpdir)
        url, redis = private_store(store, tmp)
        try:
            svc = Service(url, workers, tmp)
            try:
                register(svc.client, 2 * workers)
                svc.wait_balanced(timeout_s=120)
                extra = {}
                if redis is not None and getattr(redis, "proc", None) is not None:
                    extra["redis"] = redis.proc.pid
                yield svc, extra
            finally:
                svc.stop()
        finally:
            if redis is not None:
                redis.stop()


def scale(n: int, store: str = "sqlite", workers: int = 2, writers: int = 2, batch: int = 2000,
          timeout_s: float = 600) -> dict[str, Any]:
    """One run: ``n`` records by ``writers`` writer processes into ``millwheel up --workers
    workers`` on ``store``; see the module docstring."""
    w = workload.generate(n, late_fraction=0.0)
    expected = workload.expected_counts(w)
    ctx = multiprocessing.get_context("spawn")
    errors: list[str] = []
    done: dict[int, dict[str, Any]] = {}
    result: dict[str, Any] = {"kind": "service", "records": n, "store": store, "workers": workers,
                              "writers": writers, "batch": batch, "key_ranges": 2 * workers}
    with _running(store, workers) as (svc, extra):
        pids = {**svc.pids(), **extra}
        reader = SinkReader(svc.new_client())
        results = ctx.Queue()
        go = ctx.Event()
        procs = [ctx.Process(target=_writer, args=(i, writers, n, svc.address, batch, results, go),
                             name=f"writer{i}", daemon=True) for i in range(writers)]
        complete = False
        elapsed = 0.0
        cpu: dict[str, float] = {}
        reader_cpu = 0.0
        try:
            for p in procs:
                p.start()
            ready: set[int] = set()
            deadline = time.monotonic() + 180
            while len(ready) < writers and not errors:
                try:
                    msg = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    errors.append(f"writers not ready in time ({len(ready)} of {writers})")
                    break
                if "error" in msg:
                    errors.append(f"writer{msg['index']}: {msg['error']}")
                else:
                    ready.add(msg["index"])
            if not errors:
                cpu0 = {role: process_cpu_s(pid) for role, pid in pids.items()}
                self0 = time.process_time()
                started = time.monotonic()
                go.set()
                end = started + timeout_s
                while time.monotonic() < end:
                    if reader.wait_rows(len(expected), 0.25):
                        complete = True
                        break
                    _drain(results, done, errors)
                    if errors:
                        break
                    gone = [p.name for i, p in enumerate(procs) if not p.is_alive() and i not in done]
                    if gone:
                        _drain(results, done, errors)  # its last words may have just arrived
                        gone = [p.name for i, p in enumerate(procs) if not p.is_alive() and i not in done]
                        if gone and not errors:
                            errors.append(f"{', '.join(gone)} ended without a result")
                        if errors:
                            break
                elapsed = time.monotonic() - started
                cpu = {role: round(process_cpu_s(pid) - cpu0[role], 3) for role, pid in pids.items()}
                reader_cpu = time.process_time() - self0
                if complete:
                    wait_end = time.monotonic() + 60
                    while len(done) < writers and not errors and time.monotonic() < wait_end:
                        try:
                            msg = results.get(timeout=0.5)
                        except queue.Empty:
                            continue
                        _note(msg, done, errors)
                    if len(done) < writers and not errors:
                        errors.append(f"only {len(done)} of {writers} writers reported back")
                time.sleep(0.3)  # a duplicate row would arrive after the last expected one
                for i in range(writers):
                    if i in done:
                        cpu[f"writer{i}"] = round(done[i]["cpu_s"], 3)
                if not complete and not errors:
                    errors.append(f"sink incomplete after {timeout_s:.0f} s: {reader.rows} of {len(expected)} rows")
                result.update(
                    elapsed_s=round(elapsed, 3),
                    write_s=round(max((d["finished"] for d in done.values()), default=started) - started, 3),
                )
        finally:
            if not go.is_set():  # never told to go: nothing of theirs to wait for
                for p in procs:
                    if p.is_alive():
                        p.kill()
            for p in procs:
                if p.pid is None:  # never started
                    continue
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()
        verdict = workload.check(w, reader.counts)
        reader.client.close()
    total = sum(cpu.values())
    busiest = max(cpu, key=lambda k: cpu[k]) if cpu else None
    ok = verdict.ok and not errors
    result.update(
        records_per_s=round(n / elapsed) if complete and elapsed > 0 else None,
        complete=complete,
        cpu_s=cpu, cpu_s_total=round(total, 3), reader_cpu_s=round(reader_cpu, 3),
        cpu_us_per_record=round(total / n * 1e6, 1) if complete and cpu else None,
        busiest={"process": busiest, "cpu_s": cpu[busiest], "share": round(cpu[busiest] / total, 3)}
        if complete and busiest is not None and total > 0 else None,
        writer_stats={f"writer{i}": {k: d[k] for k in ("records", "written", "resent", "route_fetches")}
                      | {"write_s": round(d["write_s"], 3)} for i, d in sorted(done.items())},
        errors=errors,
        correct={**verdict.as_dict(), "ok": ok,
                 "detail": verdict.detail if not errors else "; ".join(e.strip().splitlines()[-1] for e in errors)},
    )
    return result


def _note(msg: dict[str, Any], done: dict[int, dict[str, Any]], errors: list[str]) -> None:
    if "error" in msg:
        errors.append(f"writer{msg['index']}: {msg['error']}")
    elif "cpu_s" in msg:
        done[msg["index"]] = msg


def _drain(results: Any, done: dict[int, dict[str, Any]], errors: list[str]) -> None:
    while True:
        try:
            msg = results.get_nowait()
        except queue.Empty:
            return
        _note(msg, done, errors)


# -- the command ------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    return {"cpus": os.cpu_count(), "memory_gib": mem_gib, "python": platform.python_version()}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def table(runs: list[dict[str, Any]], local: list[dict[str, Any]]) -> list[str]:
    local_rates = [r["records_per_s"] for r in local if r.get("records_per_s")]
    local_med = _median(local_rates)
    lines = ["| store | workers | writers | records/s | speed-up over 1 worker | x local | CPU µs/record "
             "| busiest process (share) | exact |", "|---|---|---|---|---|---|---|---|---|"]
    if local:
        ok = all(r.get("correct", {}).get("ok") for r in local)
        lines.append(f"| local (sqlite) | - | - | {_rates(local_rates, len(local))} | - | "
                     f"{'1.00' if local_med else '-'} | - | - | {'exact' if ok else '**NOT EXACT**'} |")
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["store"], r["workers"]), []).append(r)
    base: dict[str, float] = {}
    for (store, workers), rs in groups.items():
        med = _median([r["records_per_s"] for r in rs if r.get("records_per_s")])
        if workers == 1 and med:
            base[store] = med
    for (store, workers), rs in groups.items():
        rates = [r["records_per_s"] for r in rs if r.get("records_per_s")]
        med = _median(rates)
        cpu = _median([r["cpu_us_per_record"] for r in rs if r.get("cpu_us_per_record")])
        # the busiest process of the run nearest the median rate
        mid = min(rs, key=lambda r: abs((r.get("records_per_s") or 0) - (med or 0)))
        busy = mid.get("busiest")
        ok = all(r.get("correct", {}).get("ok") for r in rs)
        detail = "; ".join(r["correct"]["detail"] for r in rs if not r.get("correct", {}).get("ok"))
        lines.append(
            f"| {store} | {workers} | {rs[0]['writers']} | {_rates(rates, len(rs))} | "
            f"{f'{med / base[store]:.2f}' if med and store in base else '-'} | "
            f"{f'{med / local_med:.2f}' if med and local_med else '-'} | "
            f"{f'{cpu:,.0f}' if cpu else '-'} | "
            f"{_busiest(busy)} | "
            f"{'exact' if ok else '**NOT EXACT**: ' + detail[:200]} |")
    return lines


def _busiest(busy: dict[str, Any] | None) -> str:
    return f"{busy['process']} ({busy['share']:.0%})" if busy else "-"


def _rates(rates: list[float], runs: int) -> str:
    if not rates:
        return "-"
    med = f"{statistics.median(rates):,.0f}"
    return med if runs == 1 else f"{med} (median of {', '.join(f'{x:,.0f}' for x in rates)})"


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"need positive numbers: {text!r}")
    return out


def _stores(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in STORES]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"stores are a comma list of {', '.join(STORES)}, not {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.cases.scale", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="Prints one JSON line per run (stdout), progress on stderr, then the machine and a "
               "markdown table. Exits 1 if any output was not exact or a run failed.")
    ap.add_argument("--records", type=int, default=150_000, help="records per run (default 150000)")
    ap.add_argument("--workers", type=_ints, default=[1, 2, 4, 8],
                    help="comma list of worker counts (default 1,2,4,8)")
    ap.add_argument("--stores", type=_stores, default=["sqlite"],
                    help=f"comma list of stores, of {', '.join(STORES)} (default sqlite)")
    ap.add_argument("--writers", type=int, default=0,
                    help="writer processes per run (default 0: as many as workers, at least 2)")
    ap.add_argument("--batch", type=int, default=2000,
                    help="records a writer writes at a time (then advances its watermark) and the "
                         "InjectWriter's largest batch per range (default 2000)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every run (default 1)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    ap.add_argument("--no-local", action="store_true", help="skip local mode's figure (the x local column)")
    ap.add_argument("--json-out", metavar="PATH", help="write every result as JSON to PATH")
    args = ap.parse_args(argv)
    if args.records < 1 or args.batch < 1 or args.writers < 0 or args.repeat < 1:
        ap.error("--records, --batch and --repeat must be at least 1, --writers at least 0")

    mach = machine()
    runs: list[dict[str, Any]] = []
    local: list[dict[str, Any]] = []
    for rnd in range(args.repeat):
        tag = f"[round {rnd + 1}/{args.repeat}]"
        if not args.no_local:
            log(f"{tag} local mode, three stages, {args.records:,} records ...")
            try:
                r = {"kind": "local", "round": rnd, **_local_three(args.records)}
            except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                r = {"kind": "local", "round": rnd, "records_per_s": None,
                     "correct": {"ok": False, "detail": f"FAILED {exc.__class__.__name__}: {exc}"}}
            local.append(r)
            print(json.dumps(r), flush=True)
            log(f"{tag} local mode: {r.get('records_per_s') or 0:,.0f} records/s, {r['correct']['detail']}")
        order = args.workers if rnd % 2 == 0 else list(reversed(args.workers))  # drift shared out
        for store in args.stores:
            for workers in order:
                writers = args.writers or max(2, workers)
                log(f"{tag} {store}, {workers} workers, {writers} writers, {args.records:,} records ...")
                started = time.monotonic()
                try:
                    r = {"round": rnd, **scale(args.records, store, workers, writers, args.batch, args.timeout)}
                except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                    r = {"kind": "service", "round": rnd, "records": args.records, "store": store,
                         "workers": workers, "writers": writers, "records_per_s": None,
                         "error": traceback.format_exc()[-3000:],
                         "correct": {"ok": False, "detail": f"FAILED {exc.__class__.__name__}: {exc}"}}
                runs.append(r)
                print(json.dumps(r), flush=True)
                log(f"{tag} {store}, {workers} workers: {r.get('records_per_s') or 0:,.0f} records/s, "
                    f"{r['correct']['detail'][:300]}  [{time.monotonic() - started:.1f}s]")
    failed = not all(r["correct"]["ok"] for r in runs + local)
    print(f"\nmachine: {mach['cpus']} CPUs, {mach['memory_gib']} GiB memory, Python {mach['python']}; "
          f"{args.records:,} records a run, batch {args.batch}, {args.repeat} round(s)\n")
    for line in table(runs, local):
        print(line)
    sys.stdout.flush()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"machine": mach, "args": vars(args), "local": local,
                                                   "runs": runs}, indent=1) + "\n")
    if failed:
        print("NOT EXACT (or failed): see the table", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
