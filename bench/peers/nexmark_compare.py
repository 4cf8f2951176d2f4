"""Running a Nexmark query in millwheel's local mode and in Flink SQL, and comparing the rows.

Shared by the cross-check test (tests/integration/test_nexmark_vs_flink.py: asserts that
each verdict is exact) and the benchmark (bench/cases/nexmark.py: a run whose output
differs from the other system's is marked wrong and never reported as a figure).

**How rows compare.** Rows are sorted lists (multisets), column by column in the SQL's
order. Where the two systems differ by definition, :func:`compare` states the
difference exactly rather than hiding it (docs/nexmark.md says the same):

* q4: Flink's result updates as bids raise an auction's maximum (mini-batched); ours is
  updated when an auction closes. The final table (category -> truncated mean) is
  compared: the last row per category of each.
* q7: Flink's ``BETWEEN window_end - 10 s AND window_end`` is inclusive at both ends,
  so a bid made at exactly ``window_end`` (the next window's first millisecond) at the
  window's maximum price joins that window too; ours takes a window's own bids only.
  Flink's rows = ours + exactly those bids (computed from the data).
* q11: Flink's session windows merge when they touch (a bid exactly 10 s after the
  last); ``session_window``'s are half-open and do not. Flink's rows = ours with
  touching sessions of a bidder merged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from bench.peers.peer_common import venv_python
from bench.peers.peer_flink import java_home

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "bench" / "peers" / "nexmark_flink_job.py"
WINDOW_US = 10_000_000
Row = tuple[Any, ...]
#: The output columns of the queries compared row for row, in the SQL's order.
COLUMNS: dict[str, tuple[str, ...]] = {
    "q0": ("auction", "bidder", "price", "dateTime", "extra"),
    "q1": ("auction", "bidder", "price", "dateTime", "extra"),
    "q2": ("auction", "price"),
    "q3": ("name", "city", "state", "id"),
    "q5": ("auction", "num"),
    "q7": ("auction", "price", "bidder", "dateTime", "extra"),
    "q8": ("id", "name", "starttime"),
    "q11": ("bidder", "bid_count", "starttime", "endtime"),
}


@dataclass(frozen=True)
class Verdict:
    """Whether two systems' rows of a query agree, and what was compared (or what differs)."""

    ok: bool
    detail: str
    rows: int  #: rows compared (of millwheel's side)


def run_command(spec: Path, query: str, store_url: str) -> list[str]:
    """``millwheel run`` of a rendered spec, printing the query's output stream."""
    return [sys.executable, "-m", "services.cli", "run", str(spec), "--store", store_url, "--quiet",
            "--print", query]


def values(lines: list[str]) -> list[dict[str, Any]]:
    """The values of a sink's records from JSON lines (``run --print``, ``subscribe --json``)."""
    return [json.loads(json.loads(line)["value"]) for line in lines if line.strip()]


def run_millwheel(data: Path, query: str, timeout_s: float = 600) -> list[dict[str, Any]]:
    """The values of the query's output stream, through ``millwheel run`` on the rendered
    spec ``data/QUERY.yaml`` and a fresh SQLite file beside it."""
    done = subprocess.run(run_command(data / f"{query}.yaml", query, f"sqlite:///{data / query}.db"),
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"millwheel run {query} exited {done.returncode}: {done.stderr[-3000:]}")
    return values(done.stdout.splitlines())


def flink_command(data: Path, out: Path, queries: list[str], parallelism: int = 2) -> tuple[list[str], dict[str, str]]:
    """The Flink job's command line and environment (its own virtualenv, JAVA_HOME set)."""
    spec = {"data": str(data), "out": str(out), "queries": queries, "parallelism": parallelism}
    return ([str(venv_python()), str(JOB), json.dumps(spec)], {**os.environ, "JAVA_HOME": java_home() or ""})


def read_flink(out: Path, query: str) -> list[list[Any]]:
    """A query's rows as the Flink job wrote them: [row kind, columns...]."""
    return [json.loads(line) for line in (out / f"{query}.jsonl").read_text().splitlines()]


def run_flink(data: Path, out: Path, queries: list[str], parallelism: int = 2,
              timeout_s: float = 900) -> dict[str, list[list[Any]]]:
    """Every query's rows from Flink SQL over the files in ``data``."""
    cmd, env = flink_command(data, out, queries, parallelism)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=data, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"the Flink job exited {done.returncode}: {done.stderr[-3000:]}")
    return {q: read_flink(out, q) for q in queries}


def inserted(rows: list[list[Any]]) -> list[Row]:
    """An append-only query's rows without their row kind (all must be inserts)."""
    kinds = {r[0] for r in rows}
    if kinds - {"+I"}:
        raise ValueError(f"an append-only query's rows are all inserts, got {sorted(kinds)}")
    return [tuple(r[1:]) for r in rows]


def columns(vals: list[dict[str, Any]], *names: str) -> list[Row]:
    return [tuple(v[n] for n in names) for v in vals]


def read_bids(data: Path) -> list[dict[str, Any]]:
    return [json.loads(line)["value"] for line in (data / "bid.jsonl").read_text().splitlines()]


def _diff(ours: list[Row], theirs: list[Row]) -> str:
    """What differs between two sorted row lists, briefly."""
    from collections import Counter

    a, b = Counter(ours), Counter(theirs)
    only_ours, only_theirs = a - b, b - a
    return (f"{len(ours):,} rows vs Flink's {len(theirs):,}; {sum(only_ours.values()):,} only ours "
            f"(e.g. {next(iter(only_ours), None)}), {sum(only_theirs.values()):,} only Flink's "
            f"(e.g. {next(iter(only_theirs), None)})")


def _same(ours: list[Row], theirs: list[Row], how: str) -> Verdict:
    ours, theirs = sorted(ours), sorted(theirs)
    if ours == theirs:
        return Verdict(True, f"equal ({len(ours):,} rows{how})", len(ours))
    return Verdict(False, f"differs{how}: {_diff(ours, theirs)}", len(ours))


def q4_finals(ours: list[dict[str, Any]], theirs: list[list[Any]]) -> tuple[dict[int, int], dict[int, int]]:
    """q4's final table of each: category -> truncated mean (ours: a category's record with
    the most auctions is its latest; Flink's: what its changelog leaves)."""
    final: dict[int, int] = {}
    for kind, category, mean in theirs:
        if kind in ("+I", "+U"):
            final[category] = mean
        elif final.pop(category, None) != mean:
            raise ValueError(f"Flink's q4 changelog retracts a row it does not hold: {category} {mean}")
    latest: dict[int, dict[str, Any]] = {}
    for v in ours:
        if int(v["key"]) not in latest or v["count"] > latest[int(v["key"])]["count"]:
            latest[int(v["key"])] = v
    return {c: int(v["value"]) for c, v in latest.items()}, final


def q7_edge(ours: list[Row], bids: list[dict[str, Any]]) -> list[Row]:
    """The bids Flink's q7 adds to ours: made at exactly a window's end (the next window's
    first millisecond) at that window's maximum price."""
    highest = {t - t % WINDOW_US: price for _, price, _, t, _ in ours}  # window start -> its max
    return [(b["auction"], b["price"], b["bidder"], b["dateTime"], b["extra"]) for b in bids
            if b["dateTime"] % WINDOW_US == 0 and highest.get(b["dateTime"] - WINDOW_US) == b["price"]]


def q11_merged(ours: list[Row]) -> list[Row]:
    """Our q11 sessions with touching sessions of a bidder merged (Flink's windows merge
    when a bid comes exactly the gap after the last); raises if two of ours overlap."""
    by_bidder: dict[int, list[list[int]]] = defaultdict(list)
    for bidder, count, start, end in sorted(ours, key=lambda r: (r[0], r[2])):
        sessions = by_bidder[bidder]
        if sessions and sessions[-1][2] == start:
            sessions[-1][0] += count
            sessions[-1][2] = end
        else:
            if sessions and sessions[-1][2] > start:
                raise ValueError(f"bidder {bidder}'s sessions overlap at {start}")
            sessions.append([count, start, end])
    return sorted((b, c, s, e) for b, sessions in by_bidder.items() for c, s, e in sessions)


def compare(query: str, ours: list[dict[str, Any]], theirs: list[list[Any]], data: Path) -> Verdict:
    """millwheel's output values of ``query`` against Flink's rows, as the module's doc says."""
    try:
        if query == "q4":
            mine, final = q4_finals(ours, theirs)
            if mine == final:
                return Verdict(True, f"final table equal ({len(final)} categories)", len(ours))
            return Verdict(False, f"final table differs: ours {mine}, Flink's {final}", len(ours))
        rows = columns(ours, *COLUMNS[query])
        if query == "q1":
            return _same([(a, b, Decimal(repr(p)), t, x) for a, b, p, t, x in rows],
                         [(a, b, Decimal(p), t, x) for a, b, p, t, x in inserted(theirs)], ", prices as decimals")
        if query == "q7":
            edge = q7_edge(rows, read_bids(data))
            return _same(rows + edge, inserted(theirs), f", ours + {len(edge)} bid(s) at exactly window end")
        if query == "q11":
            merged = q11_merged(rows)
            return _same(merged, inserted(theirs), f", touching sessions merged: {len(rows):,} -> {len(merged):,}")
        return _same(rows, inserted(theirs), "")
    except (KeyError, ValueError, TypeError) as exc:
        return Verdict(False, f"cannot compare: {exc.__class__.__name__}: {exc}", len(ours))


def same_output(query: str, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> Verdict:
    """Two millwheel runs' outputs of ``query`` (the service's against local mode's, or with
    no Flink run to compare to): equal as multisets of their values."""
    def canon(vals: list[dict[str, Any]]) -> list[str]:
        return sorted(json.dumps(v, sort_keys=True) for v in vals)

    if canon(a) == canon(b):
        return Verdict(True, f"equal ({len(a):,} rows)", len(a))
    return Verdict(False, f"differs: {len(a):,} rows vs {len(b):,}", len(a))
