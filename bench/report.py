"""Ratios, targets and the markdown table of a bench run's results."""

from __future__ import annotations

from typing import Any

from bench import long_runs


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
    return ratios, targets


def _service_best(res: dict[str, Any]) -> float | None:
    from bench import service

    return service.best_backlog(res.get("service", []))


def _target(name: str, value: float | None, bound: float, unit: str, lower: bool = False) -> dict[str, Any]:
    met = None if value is None else (value <= bound if lower else value >= bound)
    return {"target": name, "value": value, "bound": bound, "unit": unit, "met": met}


def _f(x: Any, digits: int = 0) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def markdown(doc: dict[str, Any]) -> str:
    meta, res = doc["meta"], doc["results"]
    lines = [
        f"# millwheel bench — {meta['date']} — commit {meta['commit']} — {meta['mode']}",
        "",
        f"Machine: {meta['machine']['cpu']}, {meta['machine']['nproc']} cores, {meta['machine']['memory']} RAM; "
        f"Python {meta['python']}; load average before/after {meta['loadavg_before']} / {meta['loadavg_after']}; "
        f"run took {meta['duration_s']:.0f} s.",
        "",
        "## Targets",
        "",
        "| target | measured | bound | met |",
        "|---|---|---|---|",
    ]
    for t in doc["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {_f(t['value'], 2)} {t['unit']} | {_f(t['bound'], 2)} | {met} |")
    lines += ["", "## Backlog throughput (records/s draining a fixed backlog; output checked exactly)", "",
              "| pipeline | workload | records | store | config | records/s | checkpoints | peak RSS MB | output |",
              "|---|---|---|---|---|---|---|---|---|"]
    for e in res["throughput"]:
        r = e.get("result")
        if r is None:
            lines.append(f"| {e['pipeline']} | {e['workload']} | {_f(e['records'])} | {e['store']} | {e['config']} "
                         f"| {e.get('error', '')} | | | |")
            continue
        lines.append(f"| {e['pipeline']} | {e['workload']} | {_f(e['records'])} | {e['store']} | {e['config']} | "
                     f"{_f(r['records_per_s'])} | {_f(r.get('checkpoints'))} | {_f(r['peak_rss_mb'], 0)} | "
                     f"{'exact' if r['correct']['ok'] else 'WRONG: ' + r['correct']['detail']} |")
    lines += ["", "## Latency (ms) and watermark lag added per node (ms, p50/p95), EO + strong productions", "",
              "Record latency: release by the paced source -> the count stage's checkpoint holding the record "
              "committed. Result latency: the source watermark made the window computable -> its row in the sink "
              "log.", "",
              "| pipeline | store | load | rate | record p50 | p95 | p99 | result p50 | p95 | p99 | "
              "watermark lag added | output |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in res["latency"]:
        r = e.get("result")
        if r is None:
            lines.append(f"| {e['pipeline']} | {e['store']} | {e.get('load_pct', '')}% | | {e.get('error', '')} "
                         "| | | | | | | |")
            continue
        rl, xl = r["record_latency_ms"], r["result_latency_ms"]
        wm = ", ".join(f"{n.replace('injector:', 'inj:')} {_f(v['p50'], 0)}/{_f(v['p95'], 0)}"
                       for n, v in r["watermark_lag_added_ms"].items())
        lines.append(f"| {e['pipeline']} | {e['store']} | {e['load_pct']}% | {_f(e['rate'])} | {_f(rl['p50'], 1)} | "
                     f"{_f(rl['p95'], 1)} | {_f(rl['p99'], 1)} | {_f(xl['p50'], 1)} | {_f(xl['p95'], 1)} | "
                     f"{_f(xl['p99'], 1)} | {wm} | {'exact' if r['correct']['ok'] else 'WRONG'} |")
    lines += ["", "## Recovery after kill -9 (single stage, 50% load)", "",
              "| store | to first record s | to steady lag s | lag before kill p50/p95 ms | max lag after ms | "
              "peak RSS MB (killed/restarted) | output |", "|---|---|---|---|---|---|---|"]
    for e in res["recovery"]:
        r = e.get("result")
        if r is None:
            lines.append(f"| {e['store']} | {e.get('error', '')} | | | | | |")
            continue
        lines.append(f"| {e['store']} | {_f(r['to_first_record_s'], 2)} | {_f(r['to_steady_lag_s'], 2)} | "
                     f"{_f(r['lag_before_kill_p50_ms'], 0)}/{_f(r['lag_before_kill_p95_ms'], 0)} | "
                     f"{_f(r['max_lag_after_restart_ms'], 0)} | {_f(r['peak_rss_mb']['killed'], 0)}/"
                     f"{_f(r['peak_rss_mb']['restarted'], 0)} | {'exact' if r['correct']['ok'] else 'WRONG'} |")
    if res.get("service"):
        from bench import service

        lines += service.markdown(res["service"])
    if res.get("ha"):
        from bench import ha

        lines += ha.markdown(res["ha"])
    if res.get("long"):
        lines += long_runs.markdown(res["long"])
    lines += ["", "## Physical limits (same machine, same run, same record sizes)", "",
              "| limit | setting | records/s (or ops/s) |", "|---|---|---|"]
    for e in res["limits"]:
        r = e.get("result")
        if r is None:
            lines.append(f"| {e['limit']} | {e.get('store', '')} | {e.get('error', '')} |")
        elif e["limit"] == "redis_lua_checkpoint":
            lines.append(f"| Redis Lua checkpoint | {e['store']}, batch {r['batch']}, {r['depth']} per round trip "
                         f"| {_f(r['records_per_s'])} |")
        elif e["limit"] == "grpc_stream":
            lines.append(f"| grpcio bidi stream | batch {r['batch']} ({_f(r['batch_bytes'])} B) | "
                         f"{_f(r['records_per_s'])} |")
        else:
            lines.append(f"| pybloom-live | {_f(r['ids'])} IDs, fp {r['false_positive_rate']:.4f} | "
                         f"adds {_f(r['adds_per_s'])}, lookups {_f(r['lookups_per_s'])} |")
            lines.append(f"| rbloom, scalable (millwheel.dedup) | {_f(r['ids'])} IDs, fp "
                         f"{r['rbloom_false_positive_rate']:.4f} | adds {_f(r['rbloom_adds_per_s'])}, "
                         f"lookups {_f(r['rbloom_lookups_per_s'])} |")
    lines += ["", "## Peers: Bytewax, Flink SQL, Pathway (same workload, same check)", "",
              "| peer | workload | records | recovery | records/s | peak RSS MB | output |",
              "|---|---|---|---|---|---|---|"]
    for e in res["peer"]:
        r = e.get("result")
        if r is None:
            lines.append(f"| {e.get('peer', '')} | {e.get('workload', '')} | | | {e.get('error', '')} | | |")
            continue
        c = r["correct"]
        if c["ok"]:
            verdict = "exact"
        elif c.get("on_time_exact"):
            verdict = f"on-time records exact; {_f(c['late_counted'])} of {_f(c['late_expected'])} late records counted"
        else:
            verdict = "WRONG: " + c["detail"]
        lines.append(f"| {e.get('peer', '')} | {e['workload']} | {_f(e['records'])} | "
                     f"{'on' if e['recovery'] else 'off'} | {_f(r['records_per_s'])} | "
                     f"{_f(r.get('peak_rss_mb'), 0)} | {verdict} |")
    lines += ["", "## Ratios", "", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {_f(v, 3)} |" for k, v in doc["ratios"].items()]
    mem = _redis_memory(res)
    if mem:
        lines += ["", "## Redis bytes per entry (MEMORY USAGE, half-way through single stage, EO strong)", "",
                  "| role | entries | bytes/entry |", "|---|---|---|"]
        for role, g in sorted(mem.items()):
            lines.append(f"| {role} | {_f(int(g['entries']))} | {_f(g['bytes_per_entry'], 0)} |")
    if res["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def _redis_memory(res: dict[str, Any]) -> dict[str, Any] | None:
    for e in res["throughput"]:
        r = e.get("result") or {}
        if e.get("pipeline") == "single" and e.get("config") == "eo-strong" and r.get("redis_memory_midway"):
            return r["redis_memory_midway"]["groups"]  # type: ignore[no-any-return]
    return None
