"""The plan of a bench run (quick or full) and its execution, section by section.

Every millwheel or Bytewax case runs in a fresh spawned process (clean peak RSS, no
warm caches or leftover threads from the previous case); Redis cases get a flushed,
private ``redis-server`` (AOF off, or AOF ``everysec``) started by the suite on a free
port. Progress goes to stderr, one line per case.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench.cases import limits
from bench.cases.recovery import recovery_case
from bench.harness import Stores, log, run_case
from bench.peers import peer_bytewax, peer_flink, peer_pathway
from bench.run_local import WorkloadArgs, backlog_case, paced_case
from bench.workload import generate
from millwheel.nexmark.queries import QUERIES


@dataclass(frozen=True)
class Mode:
    name: str
    n: int  # records per backlog case
    paced_s: float  # seconds per paced (latency) case
    limit_s: float  # seconds per physical-limit measurement
    recovery_s: tuple[float, float]  # run before the kill, and after the restart
    full_matrix: bool


SOAK_MINUTES_FULL = 30.0
SOAK_MINUTES_QUICK = 6.0
SOAK_LOAD_PCT = 50.0  # the soak's share of the measured capacity (issue 31's soak: 70, for 60 minutes)
# issue 31's sections: (records, rounds) of the CLI-only comparison, records of the
# scale-out runs, (rows, rounds) of the subscribe read, per mode
CLI_PLAN = {"quick": (20_000, 1), "full": (200_000, 3)}
SCALE_RECORDS = {"quick": 20_000, "full": 200_000}
SUBSCRIBE_PLAN = {"quick": (100_000, 1), "full": (1_000_000, 3)}
# issue 32's opt-in section: (events, rounds) of the Nexmark case (bench/cases/nexmark.py)
NEXMARK_PLAN = {"quick": (20_000, 1), "full": (200_000, 2)}
# and its latency section: (queries, seconds of feed per query) (bench/cases/nexmark_latency.py)
NEXMARK_LATENCY_PLAN = {"quick": (("q0", "q5"), 15.0), "full": (QUERIES, 30.0)}
QUICK = Mode("quick", 20_000, 3.0, 1.0, (3.0, 3.0), False)
FULL = Mode("full", 100_000, 8.0, 3.0, (6.0, 6.0), True)

# config name -> (store kind, exactly_once, productions)
CONFIGS = {
    "eo-strong": (True, "strong"),
    "eo-weak": (True, "weak"),
    "at-least-once": (False, "strong"),
}
STORES = ("sqlite", "redis", "redis-aof")


def _tp(r: dict[str, Any]) -> str:
    rate = r["records_per_s"]
    return "rate n/a (run too short)" if rate is None else f"{rate:,.0f} rec/s"


def _lat(r: dict[str, Any]) -> str:
    lat = r["record_latency_ms"]
    return f"p50 {lat['p50']:.1f} ms p95 {lat['p95']:.1f} ms p99 {lat['p99']:.1f} ms"


def run(mode: Mode, sections: set[str], soak_minutes: float | None = None,
        out_dir: Path | None = None, soak_load_pct: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"throughput": [], "latency": [], "recovery": [], "limits": [], "peer": [],
                           "service": [], "ha": [], "long": [], "soak": [], "registry": [], "cli": [],
                           "scale": [], "subscribe": [], "nexmark": [], "nexmark_latency": [], "notes": []}
    stores = Stores()
    uniform1k = WorkloadArgs(mode.n, 1_000, "uniform")
    try:
        if "limits" in sections:
            log("== physical limits")
            _limits(mode, stores, out)
        if "throughput" in sections:
            log(f"== backlog throughput ({mode.n:,} records per case)")
            _throughput(mode, stores, out, uniform1k)
        if "latency" in sections:
            log("== latency and watermark lag at 25/50/75% of backlog throughput")
            _latency(mode, stores, out)
        if "recovery" in sections:
            log("== recovery after kill -9")
            _recovery(mode, stores, out)
        if "service" in sections:
            log("== service: three stages across millwheel up --workers 2")
            from bench.cases import service

            service.section(mode.n, mode.full_matrix, out["service"], run_case)
        if "ha" in sections:
            log("== ha: Redis Cluster (3 masters + 3 replicas) vs one Redis, service pipeline")
            from bench.cases import ha

            ha.section(mode.n, mode.full_matrix, out["ha"], run_case)
        if "growth" in sections:
            log("== growth: one long run at growing sizes (streamed workload)")
            from bench.cases import long_runs

            long_runs.growth_section(mode.full_matrix, out["long"], run_case)
        if "ttl" in sections:
            log("== ttl: per-key state TTL on vs off, interleaved")
            from bench.cases import long_runs

            long_runs.ttl_section(mode.full_matrix, out["long"], run_case)
        if "peer" in sections:
            log("== peer: Bytewax")
            _peer(mode, out, uniform1k)
            log("== peer: Flink SQL (its own virtualenv bench/.peers/flink, made on first use)")
            _peer_flink(mode, out, uniform1k)
            log("== peer: Pathway with persistence (its own virtualenv bench/.peers/pathway)")
            _peer_pathway(mode, out, uniform1k)
        if "cli" in sections:
            records, rounds = CLI_PLAN[mode.name]
            log(f"== cli: millwheel up --workers 2 + register + inject --done + subscribe vs millwheel run, "
                f"CLI only, {records:,} records, {rounds} interleaved round(s)")
            from bench.cases import cli_vs_local

            cli_vs_local.section(records, rounds, out["cli"], run_case)
        if "scale" in sections:
            log(f"== scale: the three stages across millwheel up --workers {scale_workers(mode)}, "
                f"parallel writers, SQLite, {SCALE_RECORDS[mode.name]:,} records")
            _scale(mode, stores, out)
        if "subscribe" in sections:
            rows, rounds = SUBSCRIBE_PLAN[mode.name]
            log(f"== subscribe: millwheel subscribe --json of a {rows:,}-row log, {rounds} round(s)")
            run_case(out["subscribe"], f"subscribe {rows:,} rows", {"figure": "subscribe", "rows": rows},
                     subscribe_case, rows, rounds,
                     summary=lambda r: f"{r['after_cli_rows_s'] or 0:,.0f} rows/s")
        if "registry" in sections:
            log("== registry: registry size vs heartbeat latency, worker RSS, ClusterStatus, flaps")
            from bench.cases import registry_scale

            registry_scale.section(out["registry"], run_case)
        if "soak" in sections:
            minutes = soak_minutes or (SOAK_MINUTES_FULL if mode.full_matrix else SOAK_MINUTES_QUICK)
            load_pct = soak_load_pct or SOAK_LOAD_PCT
            log(f"== soak: millwheel up --workers 2, three stages, {load_pct:g}% of capacity, {minutes:g} minutes")
            from bench.cases import soak

            soak.section(minutes, out_dir or soak.RESULTS, out["soak"], run_case, load_pct=load_pct)
        if "nexmark" in sections:
            events, rounds = NEXMARK_PLAN[mode.name]
            log(f"== nexmark: q0-q5, q7, q8, q11, local mode and PyFlink SQL (q5, q8 also the service), "
                f"{events:,} events, {rounds} interleaved round(s)")
            from bench.cases import nexmark

            nexmark.section(events, rounds, out["nexmark"], run_case)
        if "nexmark-latency" in sections:
            queries, feed_s = NEXMARK_LATENCY_PLAN[mode.name]
            log(f"== nexmark latency: {', '.join(queries)} in the service at 50% of each one's capacity, "
                f"{feed_s:g} s of feed each")
            from bench.cases import nexmark_latency

            nexmark_latency.section(queries, feed_s, out["nexmark_latency"], run_case)
        if stores.redis_error:
            out["notes"].append(f"Redis not available: {stores.redis_error}")
    finally:
        stores.close()
    return out


def _limits(mode: Mode, stores: Stores, out: dict[str, Any]) -> None:
    w = generate(20_000)
    res = out["limits"]
    for kind in ("redis", "redis-aof"):
        for batch in (100, 1000):
            url = stores.url(kind)
            if url is None:
                res.append({"limit": "redis_lua_checkpoint", "store": kind, "batch": batch,
                            "error": "not available: " + str(stores.redis_error)})
                continue
            for depth in (1, 10):
                run_case(res, f"redis Lua checkpoint {kind} batch {batch} depth {depth}",
                      {"limit": "redis_lua_checkpoint", "store": kind}, limits.redis_lua_checkpoint,
                      url, w, batch, depth, mode.limit_s, summary=_tp)
    run_case(res, "grpc bidi stream, 100-record batches", {"limit": "grpc_stream"}, limits.grpc_stream,
          w, 100, mode.limit_s, summary=_tp)
    run_case(res, "pybloom-live", {"limit": "bloom"}, limits.bloom, w, 200_000,
          summary=lambda r: f"adds {r['adds_per_s']:,.0f}/s lookups {r['lookups_per_s']:,.0f}/s")


def _throughput(mode: Mode, stores: Stores, out: dict[str, Any], uniform1k: WorkloadArgs) -> None:
    res = out["throughput"]
    plan: list[tuple[str, WorkloadArgs, str, str]] = []
    if mode.full_matrix:
        plan += [("single", uniform1k, store, cfg) for store in STORES for cfg in CONFIGS
                 if store == "sqlite" or cfg != "eo-weak"]
        plan += [("single", WorkloadArgs(mode.n, k, d), "sqlite", "eo-strong")
                 for k, d in ((1_000, "zipf"), (100_000, "uniform"), (100_000, "zipf"))]
        plan += [("three", uniform1k, store, cfg) for store in STORES for cfg in ("eo-strong", "at-least-once")]
    else:
        plan += [("single", uniform1k, "sqlite", "eo-strong"), ("single", uniform1k, "sqlite", "at-least-once"),
                 ("single", uniform1k, "redis-aof", "eo-strong"),
                 ("single", WorkloadArgs(mode.n, 100_000, "zipf"), "sqlite", "eo-strong"),
                 ("three", uniform1k, "sqlite", "eo-strong"), ("three", uniform1k, "redis-aof", "eo-strong")]
    for pipeline, wa, store, cfg in plan:
        eo, prod = CONFIGS[cfg]
        meta = {"pipeline": pipeline, "workload": f"{wa.distribution}-{wa.keys // 1000}k", "records": wa.n,
                "store": store, "config": cfg}
        url = stores.url(store)
        label = f"{pipeline:6} {meta['workload']:12} {store:9} {cfg}"
        if url is None:
            res.append({**meta, "error": "not available: " + str(stores.redis_error)})
            log(f"  {label}: skipped, Redis not available")
            continue
        run_case(res, label, meta, backlog_case, wa, pipeline, url, eo, prod, summary=_tp)


def sustainable(out: dict[str, Any], pipeline: str, store: str, cfg: str = "eo-strong") -> float | None:
    for e in out["throughput"]:
        if (e.get("pipeline"), e.get("store"), e.get("config"), e.get("workload")) == (
            pipeline, store, cfg, "uniform-1k") and "result" in e:
            return float(e["result"]["records_per_s"])
    return None


def _latency(mode: Mode, stores: Stores, out: dict[str, Any]) -> None:
    plan = [("single", "sqlite"), ("three", "sqlite"), ("single", "redis-aof")]
    if mode.full_matrix:
        plan.append(("three", "redis-aof"))
    for pipeline, store in plan:
        top = sustainable(out, pipeline, store)
        if top is None:
            out["latency"].append({"pipeline": pipeline, "store": store, "error": "no throughput figure"})
            continue
        for pct in (25, 50, 75):
            rate = top * pct / 100
            n = int(rate * mode.paced_s)
            # event time runs 5x wall clock: a 10 s window closes every 2 s of the run
            wa = WorkloadArgs(n, 1_000, "uniform", density=max(1, int(rate / 5)))
            meta = {"pipeline": pipeline, "store": store, "config": "eo-strong", "load_pct": pct,
                    "rate": rate, "sustainable": top}
            url = stores.url(store)
            if url is None:
                out["latency"].append({**meta, "error": "not available: " + str(stores.redis_error)})
                continue
            run_case(out["latency"], f"{pipeline:6} {store:9} {pct}% = {rate:,.0f} rec/s", meta, paced_case,
                  wa, pipeline, url, rate, summary=_lat)


def _recovery(mode: Mode, stores: Stores, out: dict[str, Any]) -> None:
    stores_to_try = ["sqlite", "redis-aof"] if mode.full_matrix else ["sqlite"]
    for store in stores_to_try:
        top = sustainable(out, "single", store) or 5000.0
        rate = top / 2
        url = stores.url(store)
        meta = {"pipeline": "single", "store": store, "load_pct": 50, "rate": rate}
        if url is None:
            out["recovery"].append({**meta, "error": "not available: " + str(stores.redis_error)})
            continue
        wa = WorkloadArgs(0, 1_000, "uniform", density=max(1, int(rate / 5)))
        run_case(out["recovery"], f"single {store} kill -9 at 50% load", meta, recovery_case, wa, "single", url,
              rate, *mode.recovery_s,
              summary=lambda r: f"first record {r['to_first_record_s']:.2f}s, steady lag {r['to_steady_lag_s']:.2f}s")


def _peer(mode: Mode, out: dict[str, Any], uniform1k: WorkloadArgs) -> None:
    why = peer_bytewax.available()
    if why is not None:
        out["peer"].append({"peer": "bytewax", "error": f"not available: {why}"})
        log(f"  Bytewax not available: {why}")
        return
    workloads = [uniform1k] + ([WorkloadArgs(mode.n, 1_000, "zipf")] if mode.full_matrix else [])
    for wa in workloads:
        for recovery in (False, True):
            meta = {"peer": "bytewax", "workload": f"{wa.distribution}-{wa.keys // 1000}k", "records": wa.n,
                    "recovery": recovery}
            run_case(out["peer"], f"bytewax {meta['workload']} recovery {'on' if recovery else 'off'}", meta,
                  peer_bytewax.bytewax_case, wa, recovery, summary=_tp)
    # Bytewax's per-key event clocks scale with the number of keys: a small measured sample.
    small = WorkloadArgs(min(mode.n, 10_000), 100_000, "uniform")
    run_case(out["peer"], "bytewax uniform-100k (10k records) recovery off",
          {"peer": "bytewax", "workload": "uniform-100k", "records": small.n, "recovery": False},
          peer_bytewax.bytewax_case, small, False, summary=_tp)


PEER_RECORDS = 1_000_000  # Flink's fixed cost per job is ~0.2-1.5 s: too noisy under ~300k records


def _peer_ready(mode: Mode, out: dict[str, Any], meta: dict[str, Any], label: str,
                available: Callable[[], str | None], why_full: str = "") -> bool:
    """Whether a peer in a virtualenv of its own runs now: full runs only (its first use
    installs it), and only where it is available; else its row records why not."""
    if not mode.full_matrix:
        out["peer"].append({**meta, "error": f"not run: full runs only{why_full}"})
        log(f"  {label}: full runs only")
        return False
    why = available()
    if why is not None:
        out["peer"].append({**meta, "error": f"not available: {why}"})
        log(f"  {label} not available: {why}")
        return False
    return True


def _peer_flink(mode: Mode, out: dict[str, Any], uniform1k: WorkloadArgs) -> None:
    """Flink SQL at 1M records, beside millwheel's single stage (SQLite, EO strong) at the
    same size run just before it (the ratio is between these two). Full runs only: the
    JVM start and warm-up jobs take ~30-40 s, and its first use installs apache-flink
    (~1 min, ~850 MB), which --quick cannot afford."""
    wa = WorkloadArgs(PEER_RECORDS, 1_000, "uniform")
    meta = {"peer": "flink", "workload": "uniform-1k", "records": wa.n, "recovery": True}
    if not _peer_ready(mode, out, meta, "Flink SQL", peer_flink.available,
                       " (JVM start and warm-ups ~40 s)"):
        return
    with tempfile.TemporaryDirectory(prefix="millwheel-bench-peer-") as tmp:
        run_case(out["peer"], f"millwheel single uniform-1k sqlite eo-strong ({wa.n:,} records, beside Flink)",
              {**meta, "peer": "millwheel-single-sqlite-eo-strong"}, backlog_case, wa, "single",
              f"sqlite:///{tmp}/peer.db", True, "strong", summary=_tp)
    run_case(out["peer"], "flink sql uniform-1k EO checkpoints 1 s, hashmap, parallelism 2", meta,
          peer_flink.flink_case, wa, summary=_tp)


def _peer_pathway(mode: Mode, out: dict[str, Any], uniform1k: WorkloadArgs) -> None:
    """Pathway with persistence, full runs only (its first use installs pathway, ~2 min)."""
    wa = WorkloadArgs(PEER_RECORDS, 1_000, "uniform")
    meta = {"peer": "pathway", "workload": "uniform-1k", "records": wa.n, "recovery": True}
    if not _peer_ready(mode, out, meta, "Pathway", peer_pathway.available):
        return
    run_case(out["peer"], "pathway uniform-1k persistence on (snapshots every 1 s)", meta,
          peer_pathway.pathway_case, wa, summary=_tp)


def scale_workers(mode: Mode) -> list[int]:
    """Worker counts of the scale section: 1 and 2 (quick); 1, 2, 4, 8 up to half the
    machine's cores (full: each worker, its writer and the controller need a core)."""
    if not mode.full_matrix:
        return [1, 2]
    cap = max(1, (os.cpu_count() or 1) // 2)
    return [w for w in (1, 2, 4, 8) if w <= cap]


def _scale(mode: Mode, stores: Stores, out: dict[str, Any]) -> None:
    """bench/cases/scale.py's runs (SQLite; writers = max(2, workers)), after local mode's
    three-stage backlog of the same size (its "x local" yardstick), each in a fresh process."""
    from bench.cases import scale

    n = SCALE_RECORDS[mode.name]
    cpus = os.cpu_count()
    res = out["scale"]
    url = stores.url("sqlite")
    assert url is not None
    run_case(res, f"scale: local mode, three stages, sqlite, {n:,} records",
             {"figure": "local", "records": n, "store": "sqlite", "cpus": cpus},
             backlog_case, WorkloadArgs(n, 1_000, "uniform"), "three", url, True, "strong", summary=_tp)
    for workers in scale_workers(mode):
        writers = max(2, workers)
        run_case(res, f"scale: {workers} worker(s), {writers} writers, sqlite, {n:,} records",
                 {"figure": "service", "workers": workers, "writers": writers, "records": n, "store": "sqlite",
                  "cpus": cpus},
                 scale.scale, n, "sqlite", workers, writers,
                 summary=lambda r: f"{r['records_per_s'] or 0:,.0f} rec/s, "
                                   f"{r['cpu_us_per_record'] or 0:,.0f} CPU µs/record")


def subscribe_case(rows: int, rounds: int) -> dict[str, Any]:
    """bench/cases/subscribe.py's case with the suite's verdict (``correct``): every round's
    read complete and in order."""
    from bench.cases import subscribe

    r: dict[str, Any] = subscribe.case(rows, rounds)
    ok = bool(r.get("after_exact"))
    r["correct"] = {"ok": ok, "detail": "exact" if ok else "a read was incomplete or out of order"}
    return r
