"""The plan of a bench run (quick or full) and its execution, section by section.

Every millwheel or Bytewax case runs in a fresh spawned process (clean peak RSS, no
warm caches or leftover threads from the previous case); Redis cases get a flushed,
private ``redis-server`` (AOF off, or AOF ``everysec``) started by the suite on a free
port. Progress goes to stderr, one line per case.
"""

from __future__ import annotations

import multiprocessing
import shutil
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench import limits, peer_bytewax, peer_flink, peer_pathway
from bench.recovery import recovery_case
from bench.run_local import WorkloadArgs, backlog_case, paced_case
from bench.workload import generate


@dataclass(frozen=True)
class Mode:
    name: str
    n: int  # records per backlog case
    paced_s: float  # seconds per paced (latency) case
    limit_s: float  # seconds per physical-limit measurement
    recovery_s: tuple[float, float]  # run before the kill, and after the restart
    full_matrix: bool


QUICK = Mode("quick", 20_000, 3.0, 1.0, (3.0, 3.0), False)
FULL = Mode("full", 100_000, 8.0, 3.0, (6.0, 6.0), True)

# config name -> (store kind, exactly_once, productions)
CONFIGS = {
    "eo-strong": (True, "strong"),
    "eo-weak": (True, "weak"),
    "at-least-once": (False, "strong"),
}
STORES = ("sqlite", "redis", "redis-aof")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def in_fresh_process(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        return ex.submit(fn, *args, **kwargs).result()


class Stores:
    """Fresh store URLs: a new SQLite file per case, flushed private Redis servers."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="millwheel-bench-"))
        self._redis: dict[str, Any] = {}
        self._n = 0
        self.redis_error: str | None = None

    def url(self, kind: str) -> str | None:
        self._n += 1
        if kind == "sqlite":
            return f"sqlite:///{self.tmp}/case{self._n}.db"
        server = self._server(kind)
        if server is None:
            return None
        import redis

        client = redis.Redis.from_url(server.url)
        client.flushall()
        client.close()
        return str(server.url)

    def _server(self, kind: str) -> Any:
        if kind in self._redis:
            return self._redis[kind]
        try:
            from tests.support.redis_server import RedisServer

            (self.tmp / kind).mkdir(parents=True, exist_ok=True)
            server = RedisServer(appendonly=kind == "redis-aof", appendfsync="everysec",
                                 data_dir=self.tmp / kind)
        except Exception as exc:  # noqa: BLE001 - recorded as "not available"
            self.redis_error = f"{exc.__class__.__name__}: {exc}"
            server = None
        self._redis[kind] = server
        return server

    def close(self) -> None:
        for server in self._redis.values():
            if server is not None:
                server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _case(results: list[dict[str, Any]], label: str, meta: dict[str, Any], fn: Callable[..., Any],
          *args: Any, summary: Callable[[dict[str, Any]], str] = lambda r: "", **kwargs: Any) -> dict[str, Any]:
    started = time.monotonic()
    log(f"  {label} ...")
    try:
        result = in_fresh_process(fn, *args, **kwargs)
        entry = {**meta, "result": result}
        ok = result.get("correct", {}).get("ok", True) if isinstance(result, dict) else True
        log(f"  {label}: {summary(result)}{'' if ok else '  OUTPUT WRONG: ' + result['correct']['detail']}"
            f"  [{time.monotonic() - started:.1f}s]")
    except Exception as exc:  # noqa: BLE001 - one failed case must not lose the run
        entry = {**meta, "error": f"{exc.__class__.__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        log(f"  {label}: FAILED {exc.__class__.__name__}: {exc}")
    results.append(entry)
    return entry


def _tp(r: dict[str, Any]) -> str:
    rate = r["records_per_s"]
    return "rate n/a (run too short)" if rate is None else f"{rate:,.0f} rec/s"


def _lat(r: dict[str, Any]) -> str:
    lat = r["record_latency_ms"]
    return f"p50 {lat['p50']:.1f} ms p95 {lat['p95']:.1f} ms p99 {lat['p99']:.1f} ms"


def run(mode: Mode, sections: set[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"throughput": [], "latency": [], "recovery": [], "limits": [], "peer": [],
                           "service": [], "ha": [], "long": [], "notes": []}
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
            from bench import service

            service.section(mode.n, mode.full_matrix, out["service"], _case)
        if "ha" in sections:
            log("== ha: Redis Cluster (3 masters + 3 replicas) vs one Redis, service pipeline")
            from bench import ha

            ha.section(mode.n, mode.full_matrix, out["ha"], _case)
        if "growth" in sections:
            log("== growth: one long run at growing sizes (streamed workload)")
            from bench import long_runs

            long_runs.growth_section(mode.full_matrix, out["long"], _case)
        if "ttl" in sections:
            log("== ttl: per-key state TTL on vs off, interleaved")
            from bench import long_runs

            long_runs.ttl_section(mode.full_matrix, out["long"], _case)
        if "peer" in sections:
            log("== peer: Bytewax")
            _peer(mode, out, uniform1k)
            log("== peer: Flink SQL (its own virtualenv bench/.peers/flink, made on first use)")
            _peer_flink(mode, out, uniform1k)
            log("== peer: Pathway with persistence (its own virtualenv bench/.peers/pathway)")
            _peer_pathway(mode, out, uniform1k)
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
                _case(res, f"redis Lua checkpoint {kind} batch {batch} depth {depth}",
                      {"limit": "redis_lua_checkpoint", "store": kind}, limits.redis_lua_checkpoint,
                      url, w, batch, depth, mode.limit_s, summary=_tp)
    _case(res, "grpc bidi stream, 100-record batches", {"limit": "grpc_stream"}, limits.grpc_stream,
          w, 100, mode.limit_s, summary=_tp)
    _case(res, "pybloom-live", {"limit": "bloom"}, limits.bloom, w, 200_000,
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
        _case(res, label, meta, backlog_case, wa, pipeline, url, eo, prod, summary=_tp)


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
            _case(out["latency"], f"{pipeline:6} {store:9} {pct}% = {rate:,.0f} rec/s", meta, paced_case,
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
        _case(out["recovery"], f"single {store} kill -9 at 50% load", meta, recovery_case, wa, "single", url,
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
            _case(out["peer"], f"bytewax {meta['workload']} recovery {'on' if recovery else 'off'}", meta,
                  peer_bytewax.bytewax_case, wa, recovery, summary=_tp)
    # Bytewax's per-key event clocks scale with the number of keys: a small measured sample.
    small = WorkloadArgs(min(mode.n, 10_000), 100_000, "uniform")
    _case(out["peer"], "bytewax uniform-100k (10k records) recovery off",
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
        _case(out["peer"], f"millwheel single uniform-1k sqlite eo-strong ({wa.n:,} records, beside Flink)",
              {**meta, "peer": "millwheel-single-sqlite-eo-strong"}, backlog_case, wa, "single",
              f"sqlite:///{tmp}/peer.db", True, "strong", summary=_tp)
    _case(out["peer"], "flink sql uniform-1k EO checkpoints 1 s, hashmap, parallelism 2", meta,
          peer_flink.flink_case, wa, summary=_tp)


def _peer_pathway(mode: Mode, out: dict[str, Any], uniform1k: WorkloadArgs) -> None:
    """Pathway with persistence, full runs only (its first use installs pathway, ~2 min)."""
    wa = WorkloadArgs(PEER_RECORDS, 1_000, "uniform")
    meta = {"peer": "pathway", "workload": "uniform-1k", "records": wa.n, "recovery": True}
    if not _peer_ready(mode, out, meta, "Pathway", peer_pathway.available):
        return
    _case(out["peer"], "pathway uniform-1k persistence on (snapshots every 1 s)", meta,
          peer_pathway.pathway_case, wa, summary=_tp)
