"""Plain-Python references and seeded workloads for ``session_window`` and
``interval_join``, shared by the local-runner tests and the service crash test.

A workload's records come in event-time order with jitter within the source's
disorder bound, plus two kinds of late records whose fate does not depend on when the
runner's watermark catches up: *late* ones, at most 30 s behind the newest timestamp
so far (inside a 60 s lateness however the watermark lags by a batch), and *beyond*
ones, at least 200 s behind (outside it, once the run is under way).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from typing import Any

from millwheel.record import Record

S = 1_000_000
DISORDER = 2 * S
LATENESS = 60 * S


def timeline(seed: int, n: int, prefix: str, keys: int = 4, late: bool = True, beyond_too: bool = True
             ) -> tuple[list[Record], set[str]]:
    """``n`` records and the IDs of those beyond the lateness."""
    rng = random.Random(seed)
    base = 1_000 * S
    records: list[Record] = []
    beyond: set[str] = set()
    for i in range(n):
        base += rng.randint(0, 3 * S)
        ts = base - rng.randint(0, DISORDER)
        roll = rng.random()
        rid = f"{prefix}{i}"
        if late and i > 60 and roll < 0.10:
            ts = base - rng.randint(5 * S, 30 * S)
        elif beyond_too and i > 60 and roll > 0.95:
            ts = base - rng.randint(200 * S, 400 * S)
            beyond.add(rid)
        records.append(Record(f"k{rng.randrange(keys)}", json.dumps({"x": rng.randint(-50, 50)}).encode(),
                              ts, rid))
    return records, beyond


def sessions(records: list[Record], gap: int, agg: str) -> dict[tuple[str, int, int], tuple[int, Any]]:
    """``(key, start, end) -> (count, value)`` of every session of ``records``."""
    by_key: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in records:
        by_key[r.key].append((r.timestamp, json.loads(r.value)["x"]))
    out: dict[tuple[str, int, int], tuple[int, Any]] = {}
    for key, items in by_key.items():
        items.sort()
        group: list[tuple[int, int]] = []
        for t, x in items + [(None, None)]:  # type: ignore[list-item]
            if group and (t is None or t - group[-1][0] >= gap):
                xs = [v for _t, v in group]
                value = {"count": len(xs), "sum": float(sum(xs)), "min": float(min(xs)),
                         "max": float(max(xs)), "mean": sum(xs) / len(xs)}[agg]
                out[(key, group[0][0], group[-1][0] + gap)] = (len(xs), value)
                group = []
            if t is not None:
                group.append((t, x))
    return out


def final_sessions(outputs: list[Record]) -> dict[tuple[str, int, int], tuple[int, Any]]:
    """The results a user keeps: per key, the latest result of each ``[start, end)``,
    minus those inside a wider one (a merge or widening supersedes them)."""
    latest: dict[tuple[str, int, int], tuple[int, Any]] = {}
    for r in outputs:
        v = json.loads(r.value)
        assert r.timestamp == v["end"] - 1 and r.key == v["key"]
        latest[(v["key"], v["start"], v["end"])] = (v["count"], v["value"])
    return {k: v for k, v in latest.items()
            if not any(o != k and o[0] == k[0] and o[1] <= k[1] and k[2] <= o[2] for o in latest)}


def joined(left: list[Record], right: list[Record], lower: int, upper: int) -> list[tuple[Any, ...]]:
    """Every ``(key, left value, right value, t_left, t_right, timestamp)`` pair, sorted."""
    out = []
    for a in left:
        for b in right:
            if a.key == b.key and lower <= b.timestamp - a.timestamp <= upper:
                out.append((a.key, json.loads(a.value), json.loads(b.value), a.timestamp, b.timestamp,
                            max(a.timestamp, b.timestamp)))
    return sorted(out, key=repr)


def join_outputs(outputs: list[Record]) -> list[tuple[Any, ...]]:
    out = []
    for r in outputs:
        v = json.loads(r.value)
        assert r.key == v["key"]
        out.append((v["key"], v["left"], v["right"], v["left_ts"], v["right_ts"], r.timestamp))
    return sorted(out, key=repr)
