"""Scale-out figures (issue 13): the service pipeline on a Redis Cluster against one
Redis server, measured in the same run.

**Cluster vs single Redis**: :func:`bench.cases.service.backlog` (the three-stage pipeline
across ``millwheel up --workers 2``; the workload injected through ``Inject`` as fast
as the service takes it; the clock stops when ``Subscribe`` on the sink has every
window row; rows checked exactly) on

- ``redis-always``: one redis-server, AOF ``appendfsync always``;
- ``redis-cluster``: a Redis Cluster of 3 masters + 3 replicas, each node AOF
  ``appendfsync always`` (started as tests/support/redis_cluster.py does), the store
  URL naming one node;
- optionally ``redis-cluster-wait``: the same cluster with ``wait_replicas=1``.

Rounds are interleaved (single, cluster; then cluster, single; ...), each case in a
fresh process on a fresh store, so slow drift of the machine's load hits both alike.
Reported: every round's records/s, the medians, and the ratio cluster / single (of
the medians, and per round). On one machine the cluster's six servers share its
cores: the ratio is the cost of cluster mode here, not what separate machines give.

**Leader failover** (bench/cases/ha_failover.py): two controllers, two workers, records
injected steadily into a windowed count; the leading controller is killed -9 a few
times; per kill, the time until a standby leads and until the first window result
that only a working pipeline could produce after the kill; median and max.

    .venv/bin/python -m bench.cases.ha [--only cluster|failover] [--records 20000] [--rounds 2]
                                       [--wait-replicas] [--kills 3] [--lease-ttl S]
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any, Callable

SINGLE, CLUSTER, CLUSTER_WAIT = "redis-always", "redis-cluster", "redis-cluster-wait"


def _order(kinds: list[str], round_no: int) -> list[str]:
    """Round 0 in the given order, round 1 reversed, and so on."""
    return kinds if round_no % 2 == 0 else kinds[::-1]


def _rate(entry: dict[str, Any]) -> float | None:
    r = entry.get("result")
    if not r or not r["correct"]["ok"]:
        return None
    return float(r["records_per_s"]) if r["records_per_s"] else None


def summary(entries: list[dict[str, Any]], kinds: list[str]) -> dict[str, Any]:
    """Medians per store kind and the ratios to single Redis, from the round entries."""
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    per_round: dict[int, dict[str, float]] = {}
    for e in entries:
        rate = _rate(e)
        if e.get("figure") == "cluster_vs_single" and rate is not None:
            rates[e["store"]].append(rate)
            per_round.setdefault(e["round"], {})[e["store"]] = rate
    medians = {k: statistics.median(v) if v else None for k, v in rates.items()}
    single = medians.get(SINGLE)
    ratios = {k: (m / single if m and single else None) for k, m in medians.items() if k != SINGLE}
    round_ratios = {k: [round(r[k] / r[SINGLE], 3) for _, r in sorted(per_round.items())
                        if k in r and SINGLE in r] for k in kinds if k != SINGLE}
    return {"figure": "cluster_vs_single_summary", "records_per_s": rates, "median_records_per_s": medians,
            "ratio_to_single": ratios, "ratio_per_round": round_ratios}


def cluster_vs_single(n: int, rounds: int, out: list[dict[str, Any]], case: Callable[..., dict[str, Any]],
                      wait_replicas: bool = False, batch: int = 1000) -> dict[str, Any]:
    """Interleaved rounds; ``case(out, label, meta, fn, *args, summary=...)`` runs one
    in a fresh process and appends its entry (the suite's runner, or :func:`_local_case`)."""
    from bench.cases import service

    kinds = [SINGLE, CLUSTER] + ([CLUSTER_WAIT] if wait_replicas else [])
    for i in range(rounds):
        for kind in _order(kinds, i):
            meta = {"figure": "cluster_vs_single", "store": kind, "round": i, "workers": 2, "pipeline": "three"}
            case(out, f"round {i + 1}/{rounds} {kind} {n:,}", meta, service.backlog, n, kind, batch=batch,
                 summary=lambda r: f"{r['records_per_s'] or 0:,.0f} rec/s")
    result = summary(out, kinds)
    out.append(result)
    return result


def failover(kills: int, out: list[dict[str, Any]], case: Callable[..., dict[str, Any]],
             lease_ttl_s: float | None = None) -> dict[str, Any]:
    """Leader kill -9 ``kills`` times in one deployment (bench/cases/ha_failover.py)."""
    from bench.cases.ha_failover import failover as run

    return case(out, f"leader kill -9 x{kills}", {"figure": "failover"}, run, kills, lease_ttl_s=lease_ttl_s,
                summary=lambda r: f"first window result after the kill: median "
                                  f"{r['to_first_result_s']['median'] or 0:.2f} s, max "
                                  f"{r['to_first_result_s']['max'] or 0:.2f} s; a standby leads after median "
                                  f"{r['takeover_s']['median'] or 0:.2f} s")


def section(n: int, full: bool, out: list[dict[str, Any]], case: Callable[..., dict[str, Any]]) -> None:
    """The suite's "ha" section: half-size cases, 2 rounds quick / 3 full; 3 / 5 kills."""
    cluster_vs_single(max(1000, n // 2), 3 if full else 2, out, case, wait_replicas=full)
    failover(5 if full else 3, out, case)


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    return _markdown_cluster(entries) + _markdown_failover(entries)


def _markdown_failover(entries: list[dict[str, Any]]) -> list[str]:
    e = next((e for e in entries if e.get("figure") == "failover"), None)
    if e is None:
        return []
    lines = ["", "## Controller failover: leader kill -9 (2 controllers, 2 workers)", ""]
    r = e.get("result")
    if r is None:
        return lines + [f"failed: {e.get('error', '')}"]
    lines += [f"Single-stage windowed count, {r['rate']:,.0f} records/s injected steadily (event time "
              f"{r['speedup']}x wall clock: a window closes every {10 / r['speedup']:.1f} s), store {r['store']}, "
              f"lease TTL {r['lease_ttl_s'] or 'default (2 s)'}; the leader killed {r['kills']} times "
              f"{r['gap_s']:.0f} s apart. First result: kill -> first row of the first window closed by a "
              f"watermark injected after the kill. Result latency before any kill: p50 "
              f"{r['result_latency_ms_before']['p50'] or 0:.0f} ms. Output: "
              f"{'exact' if r['correct']['ok'] else 'WRONG: ' + r['correct']['detail']}.", "",
              "| kill | a standby leads after s | first window result after s |", "|---|---|---|"]
    for i, k in enumerate(r["per_kill"]):
        lines.append(f"| {i + 1} | {k['takeover_s']:.2f} | {_s(k['to_first_result_s'])} |")
    lines.append(f"| median / max | {_s(r['takeover_s']['median'])} / {_s(r['takeover_s']['max'])} | "
                 f"{_s(r['to_first_result_s']['median'])} / {_s(r['to_first_result_s']['max'])} |")
    return lines


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _markdown_cluster(entries: list[dict[str, Any]]) -> list[str]:
    s = next((e for e in entries if e.get("figure") == "cluster_vs_single_summary"), None)
    if s is None:
        return []
    lines = ["", "## Redis Cluster (3 masters + 3 replicas) vs one Redis, service pipeline, same run", "",
             "Three stages across `millwheel up --workers 2`, backlog through `Inject` to `Subscribe`, rows "
             "checked exactly; every node AOF `appendfsync always`; rounds interleaved, each case a fresh "
             "process and store. All nodes share this machine's cores.", "",
             "| store | records/s per round | median | ratio to one Redis (median; per round) |",
             "|---|---|---|---|"]
    for kind, rates in s["records_per_s"].items():
        med = s["median_records_per_s"][kind]
        ratio = s["ratio_to_single"].get(kind)
        per = s["ratio_per_round"].get(kind, [])
        lines.append(f"| {kind} | {', '.join(f'{x:,.0f}' for x in rates)} | {med or 0:,.0f} | "
                     + ("1" if kind == SINGLE else f"{ratio or 0:.2f}; {', '.join(f'{x:.2f}' for x in per)}")
                     + " |")
    wrong = [e for e in entries if e.get("figure") == "cluster_vs_single" and _rate(e) is None]
    if wrong:
        lines.append(f"\n{len(wrong)} case(s) failed or produced wrong output (see the JSON).")
    return lines


def _local_case(out: list[dict[str, Any]], label: str, meta: dict[str, Any], fn: Callable[..., Any],
                *args: Any, summary: Callable[[dict[str, Any]], str] = lambda r: "", **kwargs: Any
                ) -> dict[str, Any]:
    from bench.harness import run_case

    entry = run_case(out, label, meta, fn, *args, summary=summary, **kwargs)
    print(json.dumps({k: v for k, v in entry.items() if k != "trace"}, default=str), flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.cases.ha", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20_000, help="records per case (default 20000)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--batch", type=int, default=1000, help="records per Inject message (default 1000)")
    ap.add_argument("--wait-replicas", action="store_true",
                    help="also the cluster with wait_replicas=1 (writes wait for their replica)")
    ap.add_argument("--only", choices=("cluster", "failover"), help="one of the two figures")
    ap.add_argument("--kills", type=int, default=3, help="leader kills in the failover figure (default 3)")
    ap.add_argument("--lease-ttl", type=float, default=None, metavar="S",
                    help="the controllers' --lease-ttl (default theirs: 2 s)")
    args = ap.parse_args(argv)
    out: list[dict[str, Any]] = []
    if args.only != "failover":
        result = cluster_vs_single(args.records, args.rounds, out, _local_case, args.wait_replicas, args.batch)
        print(json.dumps(result), flush=True)
    if args.only != "cluster":
        failover(args.kills, out, _local_case, args.lease_ttl)
    print("\n".join(markdown(out)), file=sys.stderr)
    bad = [e for e in out if e.get("figure") in ("cluster_vs_single", "failover")
           and not (e.get("result") or {}).get("correct", {}).get("ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
