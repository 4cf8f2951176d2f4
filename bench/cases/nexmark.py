"""Nexmark per core (issue 32): millwheel's local mode and service beside PyFlink SQL, on
the same generated events, interleaved rounds, every run's output checked.

::

    python -m bench.cases.nexmark --events 1000000 --rate 10000 --rounds 2 \\
        --json-out nexmark.json --chart nexmark.png

**Same events.** One data set is written by the generator (``millwheel.nexmark.generate``,
seed fixed, ``--rate`` events/s of event time, in order unless ``--disorder``) with every
query's spec rendered beside it; a tiny one (the first ``--empty-events`` events of the
same configuration) serves the *empty runs* below.

**Per query, per round, each a fresh process** (the order reversed every other round):

* **local mode**: ``millwheel run qN.yaml --store sqlite:///FRESH.db --print qN --quiet``:
  exactly-once as always (SQLite store, the default), the printed rows its output;
* **PyFlink SQL**: bench/peers/nexmark_flink_job.py for that one query in its own JVM
  (published SQL, exactly-once checkpoints every 1 s, mini-batches, parallelism 2:
  the job's settings);
* **the service** (q5 and q8 only, ``--service-queries``): ``millwheel up --workers 2``
  on a fresh SQLite file, ``millwheel register qN.yaml`` and a wait until every key
  range has an owner (untimed), then ``millwheel inject FILE --injector T --done`` for
  each table the query reads (concurrently, one process each) and ``millwheel subscribe
  qN --json --follow`` until the rows local mode printed have all come (timed).

**CPU-seconds of every process**, the way Flink's Nexmark table counts cores x time:
local mode and Flink are the children of this process and everything under them. The
JVM that PyFlink starts outlives (or is orphaned by) its Python parent, so it would
escape ``RUSAGE_CHILDREN``: this process makes itself a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``, Linux), so orphaned descendants are re-parented to
it, and it reaps them before reading its children's rusage; every JVM thread's CPU
is then counted. The service's processes are read from /proc before and after (as
bench/cases/cli_vs_local.py does): ``millwheel up``, the controller, each worker and
its watchdog, plus the ``inject`` and ``subscribe`` processes (rusage once reaped).

**Events per second per core = events / CPU-seconds**, where events are *all* the
events generated (persons, auctions and bids), as Flink's table counts them, although
each system here reads only the tables a query names. Two figures per run:

* ``raw``: events / the run's whole CPU (process start, JVM start, SQL planning, spec
  loading included);
* ``steady`` (the headline): (events - empty events) / (CPU - the empty run's CPU), the
  *empty run* being the same query by the same system on the tiny data set, once per
  query and system before the rounds: what the events cost beyond the fixed start-up
  (Flink's published figures are from 100M-event runs, where start-up vanishes). JIT
  warm-up stays in the figure (the empty run hardly warms up). The service's empty run
  is its timed part on the tiny data: the ``inject`` and ``subscribe`` processes'
  start and the service's idle CPU meanwhile (its start and registration are never
  timed).

**Output checked.** Every local run's rows are compared with the Flink run's of the same
round (bench/peers/nexmark_compare.py: rows as multisets, with the exact differences by
definition of q4, q7 and q11 that docs/nexmark.md states); every service run's with
Flink's too (or with local mode's, with ``--no-flink``). A query whose runs differ is
marked wrong in the table and its figures are not reported.

**Published, not measured here**: Flink 1.13's per-core figures from nexmark/nexmark's
README (8 cores per TaskManager, RocksDB incremental checkpoints, 100M events), shown
beside ours for reference only.

**Latency** at 50% of each query's capacity is the other mode, ``--latency``
(bench/cases/nexmark_latency.py: the service fed at a fixed rate, event time = wall time);
this one does not pace its input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any, Callable

from bench.cases.nexmark_runs import (
    FLINK_PARALLELISM,
    SERVICE_SPEC_CHANGE,
    SERVICE_WORKERS,
    become_subreaper,
    commit,
    flink_run,
    local_run,
    machine,
    service_run,
    write_data,
)
from bench.harness import ROOT, log
from bench.peers import nexmark_compare as nc
from millwheel.nexmark.meta import read_meta
from millwheel.nexmark.queries import QUERIES

#: Flink 1.13's published throughput per core (events/s), nexmark/nexmark README:
#: exactly-once checkpoints, RocksDB incremental. Published, not measured here.
PUBLISHED_PER_CORE = {"q0": 155_000, "q1": 157_900, "q2": 175_200, "q3": 152_100, "q4": 34_300,
                      "q5": 22_100, "q7": 12_300, "q8": 146_100, "q11": 39_700}
#: Issue 32's targets: local mode >= the published figure on these (2), >= 1.0x PyFlink
#: on every query (2), the service's CPU per event <= 1.5x local mode's on these (3).
PUBLISHED_TARGET_QUERIES = ("q5", "q7", "q8")
SERVICE_QUERIES = ("q5", "q8")
TARGET_PYFLINK_RATIO = 1.0
TARGET_SERVICE_CPU_RATIO = 1.5
RESULTS = ROOT / "bench" / "results"


# -- the case ----------------------------------------------------------------------------------

def _per_core(events: int, cpu_s: float | None) -> float | None:
    return events / cpu_s if cpu_s and cpu_s > 0 else None


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the JSON keeps it: without its rows."""
    return {k: v for k, v in run.items() if k not in ("values", "rows")}


def _check(query: str, run: dict[str, Any], flink: dict[str, Any] | None, local: dict[str, Any] | None,
           data: Path) -> nc.Verdict:
    """A millwheel run's rows against Flink's of the same round, else against local mode's."""
    if run.get("error"):
        return nc.Verdict(False, f"failed: {run['error'][:300]}", 0)
    if flink is not None:
        if flink.get("error"):
            return nc.Verdict(False, f"the Flink run failed: {flink['error'][:300]}", 0)
        return nc.compare(query, run["values"], flink["rows"], data)
    if local is not None and local is not run:
        v = nc.same_output(query, run["values"], local["values"])
        return nc.Verdict(v.ok, f"{v.detail} vs local mode (no Flink run)", v.rows)
    return nc.Verdict(True, f"not checked ({len(run['values']):,} rows; no Flink run)", len(run["values"]))


def case(events: int = 1_000_000, rate: int = 10_000, seed: int = 32, queries: tuple[str, ...] = QUERIES,
         rounds: int = 2, flink: bool = True, service_queries: tuple[str, ...] = SERVICE_QUERIES,
         disorder: int = 1, empty_events: int = 1000, timeout_s: float = 900,
         emit: Callable[[dict[str, Any]], None] | None = None, workdir: Path | None = None) -> dict[str, Any]:
    """Generate, run the empty runs, then the interleaved rounds; the summary per query
    (every run under ``runs``, without its rows). ``emit(run)`` is called as each run ends."""
    subreaper = become_subreaper() if flink else False
    if flink:
        from bench.peers.peer_flink import available

        why = available()
        if why is not None:
            raise RuntimeError(f"Flink SQL cannot run here: {why} (--no-flink to run millwheel alone)")
    service_queries = tuple(q for q in service_queries if q in queries)
    runs: list[dict[str, Any]] = []
    load_before = os.getloadavg()

    def done(run: dict[str, Any], verdict: nc.Verdict | None, round_no: int) -> None:
        run["round"] = round_no
        if verdict is not None:
            run["check"] = {"ok": verdict.ok, "detail": verdict.detail}
        run["events"] = run_events = (empty_events if round_no == 0 else events)
        run["per_core_raw"] = _per_core(run_events, run.get("cpu_s")) if not run.get("error") else None
        runs.append(_strip(run))
        ok = "" if verdict is None else (" output " + ("ok: " if verdict.ok else "WRONG: ") + verdict.detail[:200])
        log(f"  {'empty' if round_no == 0 else f'round {round_no}'} {run['query']} {run['system']}: "
            f"wall {run.get('wall_s') or 0:.1f} s, CPU {run.get('cpu_s') or 0:.1f} s"
            f"{' ERROR ' + run['error'][:300] if run.get('error') else ''}{ok}")
        if emit is not None:
            emit(_strip(run))

    with tempfile.TemporaryDirectory(prefix="mw-bench-nexmark-", dir=workdir) as tmpdir:
        tmp = Path(tmpdir)
        log(f"nexmark: writing {events:,} events at {rate:,} events/s (seed {seed}) and {empty_events:,} for the "
            f"empty runs ...")
        data = write_data(tmp / "data", events, rate, seed, disorder)
        tiny = write_data(tmp / "tiny", empty_events, rate, seed, disorder)
        meta = read_meta(data)
        work = tmp / "work"
        work.mkdir()
        systems = ("local", "flink") if flink else ("local",)
        empty: dict[tuple[str, str], float] = {}
        for q in queries:  # the fixed cost of each system and query: the same query on the tiny data
            tiny_rows = 0
            for system in (*systems, *(["service"] if q in service_queries else [])):
                if system == "local":
                    r = local_run(tiny, q, work, "empty", timeout_s)
                    tiny_rows = len(r["values"])
                elif system == "flink":
                    r = flink_run(tiny, q, work, "empty", timeout_s)
                else:  # the service's: inject and subscribe processes, idle service CPU meanwhile
                    r = service_run(tiny, q, work, "empty", tiny_rows, timeout_s)
                if not r.get("error"):
                    empty[(system, q)] = r["cpu_s"]
                done(r, None, 0)
        for i in range(1, rounds + 1):
            for q in queries:
                order = [*systems, *(["service"] if q in service_queries else [])]
                if i % 2 == 0:
                    order.reverse()
                this: dict[str, dict[str, Any]] = {}
                for system in order:
                    if system == "local":
                        this["local"] = local_run(data, q, work, str(i), timeout_s)
                    elif system == "flink":
                        this["flink"] = flink_run(data, q, work, str(i), timeout_s)
                    else:
                        # rows expected: local mode's of this round if it ran, else of the last round
                        ref = this.get("local") or next(r for r in reversed(runs) if r["system"] == "local"
                                                        and r["query"] == q and r["round"] > 0)
                        expected = len(ref["values"]) if "values" in ref else ref["output_rows"]
                        this["service"] = service_run(data, q, work, str(i), expected, timeout_s)
                # checked once all of this round's runs of q are in
                for system in order:
                    r = this[system]
                    if system == "flink":
                        v = (nc.Verdict(False, f"failed: {r['error'][:300]}", 0) if r.get("error") else
                             _check(q, this["local"], r, None, data) if not this["local"].get("error") else
                             nc.Verdict(True, "not checked (local mode failed)", 0))
                    else:
                        v = _check(q, r, this.get("flink"), this.get("local"), data)
                    r["output_rows"] = len(r.get("values", r.get("rows", [])))
                    done(r, v, i)
    out: dict[str, Any] = {
        "events": events, "rate": rate, "seed": seed, "disorder_group": disorder, "rounds": rounds,
        "empty_events": empty_events, "counts": meta["counts"], "event_time_s": meta["duration_us"] / 1e6,
        "flink": flink, "flink_parallelism": FLINK_PARALLELISM, "service_workers": SERVICE_WORKERS,
        "subreaper": subreaper, "cpus": os.cpu_count(), "machine": machine(),
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        "service_spec": SERVICE_SPEC_CHANGE if service_queries else None,
        "latency": "not measured by this mode (it does not pace its input): python -m bench.cases.nexmark --latency",
        "runs": runs, "queries": {},
    }
    for q in queries:
        out["queries"][q] = summarize(q, [r for r in runs if r["query"] == q], empty, events, empty_events)
    return out


def summarize(query: str, runs: list[dict[str, Any]], empty: dict[tuple[str, str], float], events: int,
              empty_events: int) -> dict[str, Any]:
    """A query's medians per system (raw and steady per-core figures), the ratios, and
    whether every round's output agreed; figures of a wrong query are withheld (None)."""
    measured = [r for r in runs if r["round"] > 0]
    ok = all(r.get("check", {}).get("ok") for r in measured)
    s: dict[str, Any] = {"ok": ok, "published_per_core": PUBLISHED_PER_CORE.get(query),
                         "check": "; ".join(sorted({f"{r['system']}: {r['check']['detail']}" for r in measured
                                                    if r.get("check") and (not ok or r["system"] == "local")}))}
    for system in ("local", "flink", "service"):
        mine = [r for r in measured if r["system"] == system and not r.get("error")]
        if not mine:
            continue
        cpu = _median([r["cpu_s"] for r in mine])
        base = empty.get((system, query))
        steady_cpu = [r["cpu_s"] - base for r in mine] if base is not None else [r["cpu_s"] for r in mine]
        steady_events = events - empty_events if base is not None else events
        s[system] = {
            "runs": len(mine), "wall_s": _median([r["wall_s"] for r in mine]), "cpu_s": cpu, "empty_cpu_s": base,
            "per_core_raw": _median([_per_core(events, r["cpu_s"]) for r in mine]) if ok else None,
            "per_core": _median([_per_core(steady_events, c) for c in steady_cpu]) if ok else None,
            "events_per_s": _median([events / r["wall_s"] for r in mine if r.get("wall_s")]) if ok else None,
        }
    local = s.get("local", {}).get("per_core")
    fl = s.get("flink", {}).get("per_core")
    svc = s.get("service", {}).get("per_core")
    s["local_over_flink"] = round(local / fl, 3) if local and fl else None
    s["local_over_published"] = round(local / s["published_per_core"], 3) if local and s["published_per_core"] \
        else None
    # CPU per event of the service over local mode's (steady: neither one's fixed cost counted)
    s["service_cpu_ratio"] = round(local / svc, 3) if local and svc else None
    return s


# -- the report --------------------------------------------------------------------------------

def _k(x: float | None) -> str:
    return "-" if x is None else f"{x / 1000:,.1f}k"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table_lines(res: dict[str, Any]) -> list[str]:
    """The markdown table: per query, events/s per core of each system, the ratios, the check."""
    lines = [
        f"Nexmark, {res['events']:,} events ({res['counts']['person']:,} persons, {res['counts']['auction']:,} "
        f"auctions, {res['counts']['bid']:,} bids) at {res['rate']:,} events/s of event time "
        f"({res['event_time_s']:,.0f} s), seed {res['seed']}, {res['rounds']} interleaved round(s), "
        f"{res['cpus']} CPUs here; events/s per core = all events / CPU-seconds of every process, start-up "
        f"removed (the empty run's CPU subtracted), medians:", "",
        "| query | millwheel local | PyFlink SQL (here) | local / PyFlink | service (up --workers 2) | "
        "service / local CPU per event | Flink 1.13 published* | local / published | output |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for q, s in res["queries"].items():
        local, fl, svc = (s.get(k, {}) for k in ("local", "flink", "service"))
        svc_cell = _k(svc.get("per_core")) if q in SERVICE_QUERIES and svc else "-"
        check = "equal" if s["ok"] and res["flink"] else ("consistent (no Flink run)" if s["ok"] else
                                                           "**WRONG**: " + s["check"][:160])
        lines.append(f"| {q} | {_k(local.get('per_core'))} | {_k(fl.get('per_core'))} | "
                     f"{_x(s['local_over_flink'])} | {svc_cell} | {_x(s['service_cpu_ratio'])} | "
                     f"{_k(s['published_per_core'])} | {_x(s['local_over_published'])} | {check} |")
    lines += ["", "\\* published by nexmark/nexmark (Flink 1.13, 8-core TaskManagers, RocksDB incremental "
              "checkpoints, 100M events), **not measured here**. Latency (p50/p95 at 50% of capacity): "
              "`python -m bench.cases.nexmark --latency`.", "",
              "Raw (start-up included) events/s per core and wall time, medians:", "",
              "| query | local raw | local wall s | PyFlink raw | PyFlink wall s | local empty-run CPU s | "
              "PyFlink empty-run CPU s |", "|---|---|---|---|---|---|---|"]
    for q, s in res["queries"].items():
        local, fl = s.get("local", {}), s.get("flink", {})

        def w(x: float | None) -> str:
            return "-" if x is None else f"{x:,.1f}"

        lines.append(f"| {q} | {_k(local.get('per_core_raw'))} | {w(local.get('wall_s'))} | "
                     f"{_k(fl.get('per_core_raw'))} | {w(fl.get('wall_s'))} | {w(local.get('empty_cpu_s'))} | "
                     f"{w(fl.get('empty_cpu_s'))} |")
    return lines


def chart(res: dict[str, Any], path: Path) -> None:
    """Events/s per core per query: millwheel local, the service, PyFlink here, Flink 1.13 published."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qs = list(res["queries"])
    series = [("millwheel local", [res["queries"][q].get("local", {}).get("per_core") for q in qs], "tab:blue"),
              ("millwheel service", [res["queries"][q].get("service", {}).get("per_core") for q in qs], "tab:cyan"),
              ("PyFlink SQL (measured here)", [res["queries"][q].get("flink", {}).get("per_core") for q in qs],
               "tab:orange"),
              ("Flink 1.13 published (not measured here)", [PUBLISHED_PER_CORE.get(q) for q in qs], "tab:gray")]
    series = [s for s in series if any(v is not None for v in s[1])]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(series)
    for i, (label, vals, color) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(qs))]
        ax.bar(xs, [v or 0 for v in vals], width, label=label, color=color,
               hatch="//" if "published" in label else None, edgecolor="white" if "published" in label else None)
    ax.set_xticks(range(len(qs)), qs)
    ax.set_yscale("log")
    ax.set_ylabel("events/s per core (log)")
    ax.set_title(f"Nexmark, {res['events']:,} events, exactly-once, {res['cpus']} CPUs "
                 f"({res.get('commit', '')}; start-up removed)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    """The ``nexmark`` section of a bench run's markdown."""
    lines = ["", "## Nexmark per core: local mode, the service, PyFlink SQL (bench/cases/nexmark.py)", ""]
    for e in entries:
        r = e.get("result")
        lines += table_lines(r) if r is not None else [f"Failed: {e.get('error', '')}"]
    return lines


def section(events: int, rounds: int, out: list[dict[str, Any]], run_case: Any) -> None:
    """The ``nexmark`` section of ``python -m bench`` (opt-in): the case in a fresh process."""
    run_case(out, f"nexmark {events:,} events, {rounds} round(s)",
             {"figure": "nexmark", "events": events, "rounds": rounds}, case_checked, events, rounds,
             summary=lambda r: ", ".join(f"{q} {_k(s.get('local', {}).get('per_core'))}/core"
                                         for q, s in r["queries"].items()))


def case_checked(events: int, rounds: int) -> dict[str, Any]:
    """:func:`case` with the suite's verdict (``correct``): every query's output agreed."""
    from bench.peers.peer_flink import available

    r = case(events=events, rounds=rounds, flink=available() is None)
    bad = [q for q, s in r["queries"].items() if not s["ok"]]
    r["correct"] = {"ok": not bad, "detail": "every query's output agreed" if not bad else
                    "; ".join(f"{q}: {r['queries'][q]['check'][:200]}" for q in bad)}
    return r


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if "--latency" in args_in:  # issue 32's latency at 50% of capacity: bench/cases/nexmark_latency.py
        from bench.cases import nexmark_latency

        return nexmark_latency.main([a for a in args_in if a != "--latency"])
    ap = argparse.ArgumentParser(prog="python -m bench.cases.nexmark",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__,
                                 epilog="Prints one JSON line per run (stdout), progress on stderr, then the "
                                        "markdown tables. Exits 1 if any query's output disagreed or a run failed.")
    ap.add_argument("--events", type=int, default=1_000_000, help="events generated (default 1000000)")
    ap.add_argument("--rate", type=int, default=10_000, help="events/s of event time (default 10000)")
    ap.add_argument("--seed", type=int, default=32)
    ap.add_argument("--disorder", type=int, default=1, metavar="N",
                    help="shuffle events in groups of N (default 1: in order)")
    ap.add_argument("--queries", default=",".join(QUERIES), help=f"comma-separated (default {','.join(QUERIES)})")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--no-flink", action="store_true", help="millwheel alone (outputs checked against each other)")
    ap.add_argument("--service-queries", default=",".join(SERVICE_QUERIES),
                    help="queries also run in the service (default q5,q8; '' for none)")
    ap.add_argument("--empty-events", type=int, default=1000, help="events of the empty runs (default 1000)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a run may take (default 900)")
    ap.add_argument("--json-out", metavar="PATH", help="write the whole result as JSON to PATH")
    ap.add_argument("--md-out", metavar="PATH", help="write the markdown tables to PATH")
    ap.add_argument("--chart", metavar="PATH", help="write a PNG chart of events/s per core to PATH")
    ap.add_argument("--save", action="store_true",
                    help="write JSON, markdown and chart as bench/results/DATE-COMMIT-nexmark.*")
    ap.add_argument("--latency", action="store_true",
                    help="p50/p95/max latency at 50%% of each query's capacity in the service instead "
                         "(its options: python -m bench.cases.nexmark --latency --help)")
    args = ap.parse_args(argv)
    queries = tuple(q.strip() for q in args.queries.split(",") if q.strip())
    service_queries = tuple(q.strip() for q in args.service_queries.split(",") if q.strip())
    unknown = [q for q in (*queries, *service_queries) if q not in QUERIES]
    if unknown:
        ap.error(f"no Nexmark query {', '.join(unknown)}; there are {', '.join(QUERIES)}")
    if args.events < 1 or args.rounds < 1 or args.rate < 1 or not 0 < args.empty_events < args.events:
        ap.error("--events, --rounds and --rate must be at least 1, --empty-events between 1 and --events")
    rev = commit()
    res = case(args.events, args.rate, args.seed, queries, args.rounds, not args.no_flink, service_queries,
               args.disorder, args.empty_events, args.timeout, emit=lambda r: print(json.dumps(r), flush=True))
    res["commit"] = rev
    res["command"] = "python -m bench.cases.nexmark " + " ".join(argv if argv is not None else sys.argv[1:])
    from bench.report.targets import nexmark_target_rows

    res["targets"] = nexmark_target_rows(res)
    lines = [*table_lines(res), "", "Issue 32's targets:", "", "| target | value | bound | met | note |",
             "|---|---|---|---|---|"]
    for t in res["targets"]:
        v = "-" if t["value"] is None else f"{t['value']:,.2f}"
        lines.append(f"| {t['target']} | {v} | {t['bound']:g} {t['unit']} | "
                     f"{ {True: 'met', False: 'unmet', None: '-'}[t['met']] } | {t['note']} |")
    lines += ["", f"Machine: {res['machine']['cpu_model']}, {res['cpus']} CPUs, {res['machine']['platform']}; "
              f"commit {rev}; load average before {res['load_before']}, after {res['load_after']}; "
              f"command `{res['command']}`."]
    text = "\n".join(lines)
    print()
    print(text)
    paths = {"json": args.json_out, "md": args.md_out, "png": args.chart}
    if args.save:
        stem = RESULTS / f"{date.today().isoformat()}-{rev}-nexmark"
        paths = {k: v or f"{stem}.{k}" for k, v in paths.items()}
    if paths["json"]:
        Path(paths["json"]).write_text(json.dumps(res, indent=1) + "\n")
    if paths["md"]:
        Path(paths["md"]).write_text(text + "\n")
    if paths["png"]:
        chart(res, Path(paths["png"]))
    bad = [q for q, s in res["queries"].items() if not s["ok"]]
    if bad:
        print(f"OUTPUT DISAGREED or a run failed: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
