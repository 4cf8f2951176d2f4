"""The markdown table of a bench run's results (``bench/results/<date>-<commit>.md``)."""

from __future__ import annotations

from typing import Any

from bench.cases import long_runs


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
        "| target | measured | bound | met | note |",
        "|---|---|---|---|---|",
    ]
    for t in doc["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        note = str(t.get("note") or "").replace("|", "/")
        lines.append(f"| {t['target']} | {_f(t['value'], 2)} {t['unit']} | {_f(t['bound'], 2)} | {met} | {note} |")
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
        from bench.cases import service

        lines += service.markdown(res["service"])
    if res.get("ha"):
        from bench.cases import ha

        lines += ha.markdown(res["ha"])
    if res.get("long"):
        lines += long_runs.markdown(res["long"])
    if res.get("soak"):
        from bench.cases import soak

        lines += soak.markdown(res["soak"])
    if res.get("cli"):
        from bench.cases import cli_vs_local

        lines += cli_vs_local.markdown(res["cli"])
    if res.get("scale"):
        lines += _scale(res["scale"])
    if res.get("subscribe"):
        lines += _subscribe(res["subscribe"])
    if res.get("nexmark"):
        from bench.cases import nexmark

        lines += nexmark.markdown(res["nexmark"])
    if res.get("nexmark_latency"):
        from bench.cases import nexmark_latency

        lines += nexmark_latency.markdown(res["nexmark_latency"])
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


def _scale(entries: list[dict[str, Any]]) -> list[str]:
    """The scale section: bench/cases/scale.py's table of its runs and local mode's."""
    from bench.cases import scale

    runs = [e["result"] for e in entries if e.get("figure") == "service" and "result" in e]
    local = [e["result"] for e in entries if e.get("figure") == "local" and "result" in e]
    cpus = next((e.get("cpus") for e in entries if e.get("cpus")), None)
    lines = ["", f"## Scale-out: three stages across `millwheel up --workers W`, parallel writers "
             f"(bench/cases/scale.py; {cpus} cores)", ""] + scale.table(runs, local)
    lines += [f"- {e.get('figure')} {e.get('workers', '')}: FAILED {e['error']}" for e in entries if "error" in e]
    return lines


def _subscribe(entries: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## `millwheel subscribe --json` of a log (bench/cases/subscribe.py)", ""]
    for e in entries:
        r = e.get("result")
        if r is None:
            lines.append(f"Failed: {e.get('error', '')}")
            continue
        each = ", ".join(f"{x['cli_rows_s']:,}" for x in r["rounds"] if x.get("label") == "after")
        lines.append(f"{r['rows']:,}-row log (SQLite): median {_f(r.get('after_cli_rows_s'))} rows/s "
                     f"(rounds: {each}); {'exact' if r.get('after_exact') else '**NOT EXACT**'}.")
    return lines
