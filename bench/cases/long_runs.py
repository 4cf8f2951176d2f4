"""The suite's ``growth`` and ``ttl`` sections (issue 14): does a long run stay flat,
and what does a per-key state TTL cost.

* ``growth``: :func:`bench.cases.growth.case` (single stage, SQLite, exactly-once strong, a
  *streamed* workload so the runner's peak RSS is its own) at growing sizes, each in a
  fresh process, output checked exactly: records/s (whole run and its last 30%), peak
  RSS, store bytes per record. The target is the largest size's rate over the
  smallest's (>= 0.9).
* ``ttl``: the single stage with ``state_ttl_us`` unset and set to an hour, alternated in
  fresh processes (:func:`bench.cases.ttl.compare`); the median ratio, wall and per CPU-second.

Both sections live here, not in :mod:`bench.suite`: the suite imports this module only
when the section runs.
"""

from __future__ import annotations

from typing import Any, Callable

GROWTH_FULL = (100_000, 1_000_000, 10_000_000)
GROWTH_QUICK = (20_000, 200_000)
TTL_FULL = (200_000, 3)  # records, interleaved rounds
TTL_QUICK = (20_000, 1)


def growth_section(full: bool, out: list[dict[str, Any]], case: Callable[..., dict[str, Any]]) -> None:
    """One :func:`bench.cases.growth.case` per size; ``case`` is the suite's runner of a case."""
    from bench.cases import growth

    for n in GROWTH_FULL if full else GROWTH_QUICK:
        case(out, f"growth single sqlite eo-strong {n:,} records (streamed)", {"figure": "growth", "records": n},
             growth.case, n, summary=lambda r: (f"{r['records_per_s']:,.0f} rec/s, last 30% "
                                                f"{r['tail_records_per_s']:,.0f}/s, peak RSS "
                                                f"{r['peak_rss_mb']:.0f} MB, {r['store_bytes_per_record']:.1f} "
                                                "B/record"))


def ttl_section(full: bool, out: list[dict[str, Any]], case: Callable[..., dict[str, Any]]) -> None:
    from bench.cases import ttl

    n, rounds = TTL_FULL if full else TTL_QUICK
    case(out, f"state TTL 1 h vs none, single sqlite eo-strong, {n:,} records x {rounds} rounds",
         {"figure": "ttl", "records": n, "rounds": rounds}, ttl.compare, n, rounds,
         summary=lambda r: f"TTL/none {r['ttl_over_none']:.3f} (per CPU-s {r['ttl_over_none_per_cpu_s']:.3f})")


def growth_ratio(entries: list[dict[str, Any]]) -> float | None:
    """The largest size's records/s over the smallest's (both exact), else None."""
    rows = sorted((e["records"], e["result"]) for e in entries
                  if e.get("figure") == "growth" and "result" in e and e["result"]["correct"]["ok"])
    if len(rows) < 2:
        return None
    return float(rows[-1][1]["records_per_s"] / rows[0][1]["records_per_s"])


def ttl_ratio(entries: list[dict[str, Any]]) -> float | None:
    r = next((e["result"] for e in entries if e.get("figure") == "ttl" and "result" in e), None)
    return None if r is None else float(r["ttl_over_none"])


def markdown(entries: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## Long runs: single stage, SQLite, EO + strong, streamed workload (output checked exactly)", "",
             "| records | records/s | last 30% records/s | per CPU-s | peak RSS MB | store B/record | output |",
             "|---|---|---|---|---|---|---|"]
    for e in entries:
        if e.get("figure") != "growth":
            continue
        r = e.get("result")
        if r is None:
            lines.append(f"| {e['records']:,} | {e.get('error', '')} | | | | | |")
            continue
        lines.append(f"| {e['records']:,} | {r['records_per_s']:,.0f} | {r['tail_records_per_s']:,.0f} | "
                     f"{r['records_per_cpu_s']:,.0f} | {r['peak_rss_mb']:.0f} | {r['store_bytes_per_record']:.1f} | "
                     f"{'exact' if r['correct']['ok'] else 'WRONG: ' + r['correct']['detail']} |")
    for e in entries:
        if e.get("figure") == "ttl":
            r = e.get("result")
            if r is None:
                lines += ["", f"State TTL: {e.get('error', '')}"]
            else:
                lines += ["", f"State TTL (1 h, never firing: the write-side cost), {r['records']:,} records x "
                              f"{r['rounds']} interleaved rounds: TTL / none = {r['ttl_over_none']:.3f} wall, "
                              f"{r['ttl_over_none_per_cpu_s']:.3f} per CPU-second; both outputs exact."]
    return lines
