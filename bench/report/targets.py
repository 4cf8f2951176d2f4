"""The ratios and the targets (issue 14) of a bench run's results."""

from __future__ import annotations

from typing import Any

from bench.cases import long_runs


def _find(entries: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for e in entries:
        if "result" in e and all(e.get(k) == v for k, v in match.items()):
            return e["result"]  # type: ignore[no-any-return]
    return None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios_and_targets(res: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    tp, lim, peer = res["throughput"], res["limits"], res["peer"]

    def rps(**m: Any) -> float | None:
        r = _find(tp, workload="uniform-1k", **m)
        return r["records_per_s"] if r else None

    lua = {(e.get("store"), e["result"]["batch"], e["result"]["depth"]): e["result"]["records_per_s"]
           for e in lim if e.get("limit") == "redis_lua_checkpoint" and "result" in e}
    grpc = next((e["result"]["records_per_s"] for e in lim if e.get("limit") == "grpc_stream" and "result" in e), None)
    bloom = next((e["result"] for e in lim if e.get("limit") == "bloom" and "result" in e), None)
    bw_on = _find(peer, peer="bytewax", workload="uniform-1k", recovery=True)
    bw_off = _find(peer, peer="bytewax", workload="uniform-1k", recovery=False)
    flink = _find(peer, peer="flink", workload="uniform-1k")
    pathway = _find(peer, peer="pathway", workload="uniform-1k")
    beside = _find(peer, peer="millwheel-single-sqlite-eo-strong", workload="uniform-1k")
    beside_rps = beside["records_per_s"] if beside else None
    single_sqlite = rps(pipeline="single", store="sqlite", config="eo-strong")
    single_redis_aof = rps(pipeline="single", store="redis-aof", config="eo-strong")
    single_redis = rps(pipeline="single", store="redis", config="eo-strong")
    three = {s: rps(pipeline="three", store=s, config="eo-strong") for s in ("sqlite", "redis", "redis-aof")}
    ratios: dict[str, Any] = {
        "single_redis_aof_eo_strong / lua_limit(aof, batch 1000, depth 1)":
            _div(single_redis_aof, lua.get(("redis-aof", 1000, 1))),
        "single_redis_eo_strong / lua_limit(no aof, batch 1000, depth 1)":
            _div(single_redis, lua.get(("redis", 1000, 1))),
        "single_redis_aof_eo_strong / lua_limit(aof, batch 100, depth 1)":
            _div(single_redis_aof, lua.get(("redis-aof", 100, 1))),
        "single_sqlite_eo_strong / pybloom_live_adds_per_s":
            _div(single_sqlite, bloom["adds_per_s"] if bloom else None),
        "single_sqlite_eo_strong / rbloom_adds_per_s":
            _div(single_sqlite, bloom["rbloom_adds_per_s"] if bloom else None),
        "three_sqlite_eo_strong / grpc_stream_limit": _div(three["sqlite"], grpc),
        "single_sqlite_eo_strong / bytewax_recovery_on": _div(single_sqlite, bw_on["records_per_s"] if bw_on else None),
        "single_sqlite_eo_strong / bytewax_recovery_off":
            _div(single_sqlite, bw_off["records_per_s"] if bw_off else None),
        "single_sqlite_eo_strong (1M) / flink_sql_eo_checkpoints_1s (1M)":
            _div(beside_rps, flink["records_per_s"] if flink else None),
        "single_sqlite_eo_strong (1M) / pathway_persistence_on (1M)":
            _div(beside_rps, pathway["records_per_s"] if pathway else None),
        "single_sqlite_eo_strong / single_sqlite_at_least_once":
            _div(single_sqlite, rps(pipeline="single", store="sqlite", config="at-least-once")),
        "three_sqlite_eo_strong / three_sqlite_at_least_once":
            _div(three["sqlite"], rps(pipeline="three", store="sqlite", config="at-least-once")),
    }
    ratios["single_redis_aof_eo_strong / single_sqlite_eo_strong"] = _div(single_redis_aof, single_sqlite)
    service_sqlite = next((e["result"]["records_per_s"] for e in res.get("service", [])
                           if e.get("figure") == "backlog" and e.get("store") == "sqlite" and "result" in e
                           and e["result"]["correct"]["ok"]), None)
    ratios["service_three_sqlite (up --workers 2) / local_three_sqlite_eo_strong"] = \
        _div(service_sqlite, three["sqlite"])
    long = res.get("long", [])
    ratios["growth: largest run's records/s / smallest's (single sqlite eo-strong, streamed)"] = \
        long_runs.growth_ratio(long)
    ratios["state TTL 1 h / none (single sqlite eo-strong, wall)"] = long_runs.ttl_ratio(long)
    ha = next((e for e in res.get("ha", []) if e.get("figure") == "cluster_vs_single_summary"), None)
    ratios["service_redis_cluster / service_redis_always (interleaved rounds, medians)"] = \
        ha["ratio_to_single"].get("redis-cluster") if ha else None
    lat = _find(res["latency"], pipeline="single", store="redis-aof", load_pct=50)
    lat_sqlite = _find(res["latency"], pipeline="single", store="sqlite", load_pct=50)
    lags = [e["result"]["watermark_lag_added_ms"] for e in res["latency"]
            if "result" in e and e.get("load_pct") == 50]
    worst_lag = max((v["p50"] for lag in lags for v in lag.values() if v["p50"] is not None), default=None)
    rec = [e["result"]["to_first_record_s"] for e in res["recovery"] if "result" in e]
    best_three = max((v for v in three.values() if v is not None), default=None)
    targets = [
        _target("single stage, EO+strong, Redis AOF: throughput >= 50% of the raw Lua checkpoint (batch 1000)",
                ratios["single_redis_aof_eo_strong / lua_limit(aof, batch 1000, depth 1)"], 0.5, "ratio"),
        _target("single stage, EO+strong, Redis AOF, 50% load: record latency p50 <= 5 ms",
                lat["record_latency_ms"]["p50"] if lat else None, 5.0, "ms", lower=True),
        _target("single stage, EO+strong, Redis AOF, 50% load: record latency p95 <= 20 ms",
                lat["record_latency_ms"]["p95"] if lat else None, 20.0, "ms", lower=True),
        _target("single stage, EO+strong, SQLite, 50% load: record latency p50 <= 5 ms",
                lat_sqlite["record_latency_ms"]["p50"] if lat_sqlite else None, 5.0, "ms", lower=True),
        _target("single stage, EO+strong, SQLite, 50% load: record latency p95 <= 20 ms",
                lat_sqlite["record_latency_ms"]["p95"] if lat_sqlite else None, 20.0, "ms", lower=True),
        _target("single stage, EO+strong: Redis AOF >= 0.5x SQLite (same run)",
                ratios["single_redis_aof_eo_strong / single_sqlite_eo_strong"], 0.5, "ratio"),
        _target("three stages, EO on: >= 15,000 records/s (best store)", best_three, 15_000, "rec/s"),
        _target("three stages, SQLite, EO on: service (up --workers 2) >= 0.5x local mode (same run)",
                ratios["service_three_sqlite (up --workers 2) / local_three_sqlite_eo_strong"], 0.5, "ratio"),
        _target("long run, SQLite, EO on: the largest run's rate >= 0.9x the smallest's (full: 10M vs 100k)",
                ratios["growth: largest run's records/s / smallest's (single sqlite eo-strong, streamed)"],
                0.9, "ratio"),
        _target("three stages, EO on, service (millwheel up --workers 2): >= 15,000 records/s (best store)",
                _service_best(res), 15_000, "rec/s"),
        _target("local mode, SQLite, EO on: throughput >= Bytewax with recovery on",
                ratios["single_sqlite_eo_strong / bytewax_recovery_on"], 1.0, "ratio"),
        _target("local mode, SQLite, EO on: throughput >= Flink SQL (hashmap, EO checkpoints every 1 s)",
                ratios["single_sqlite_eo_strong (1M) / flink_sql_eo_checkpoints_1s (1M)"], 1.0, "ratio"),
        _target("watermark lag added per stage at 50% load <= 100 ms (worst stage, p50)", worst_lag, 100.0, "ms",
                lower=True),
        _target("recovery to first record after kill -9 <= 5 s (worst store)", max(rec) if rec else None, 5.0, "s",
                lower=True),
    ]
    fo = next((e["result"] for e in res.get("ha", []) if e.get("figure") == "failover" and "result" in e), None)
    if fo is not None:
        targets.append(_target("controller failover: leader kill -9 -> a standby leads <= 5 s (max over kills)",
                               fo["takeover_s"]["max"], 5.0, "s", lower=True))
    for e in res.get("soak", []):  # opt-in (python -m bench --only soak): its rows as it computed them
        if "result" in e:
            targets += [{k: t[k] for k in ("target", "value", "bound", "unit", "met")} for t in e["result"]["targets"]]
        else:
            targets.append(_target(f"soak: {e.get('error', 'failed')}", None, 0.0, ""))
    soak_rows = [t for t in targets if t["target"].startswith("soak")]
    targets += issue_24_targets(ratios, lat_sqlite, lat, soak_rows)
    return ratios, targets


def issue_24_targets(ratios: dict[str, Any], lat_sqlite: dict[str, Any] | None, lat_redis: dict[str, Any] | None,
                     soak_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 24's five rows, under the names the issue gives them: the service against
    local mode (same run); local mode (SQLite, EO on, its default settings) against
    Flink SQL as the suite runs it (hashmap, EO checkpoints every 1 s, parallelism 2);
    record latency p95 at 50% load of the single stage on SQLite and on Redis (AOF);
    and the soak, met when every one of its own rows is (value: how many are not;
    no value when it was not run: ``python -m bench --only soak``)."""
    unmet = sum(1 for t in soak_rows if t["met"] is not True)
    soak = _target("soak", unmet if soak_rows else None, 0, "rows unmet", lower=True)
    return [
        _target("service >= 0.8x local",
                ratios["service_three_sqlite (up --workers 2) / local_three_sqlite_eo_strong"], 0.8, "ratio"),
        _target("Flink SQL >= 1.3x (default settings)",
                ratios["single_sqlite_eo_strong (1M) / flink_sql_eo_checkpoints_1s (1M)"], 1.3, "ratio"),
        _target("SQLite p95 <= 20 ms", lat_sqlite["record_latency_ms"]["p95"] if lat_sqlite else None, 20.0, "ms",
                lower=True),
        _target("Redis p95 <= 20 ms", lat_redis["record_latency_ms"]["p95"] if lat_redis else None, 20.0, "ms",
                lower=True),
        soak,
    ]


def _service_best(res: dict[str, Any]) -> float | None:
    from bench.cases import service

    return service.best_backlog(res.get("service", []))


def _target(name: str, value: float | None, bound: float, unit: str, lower: bool = False) -> dict[str, Any]:
    met = None if value is None else (value <= bound if lower else value >= bound)
    return {"target": name, "value": value, "bound": bound, "unit": unit, "met": met}
