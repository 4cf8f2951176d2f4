"""Plain-Python references for ``window_top``, ``window_join`` and ``stream_join``,
shared by the local-runner tests and the service crash test. Workloads come from
:func:`tests.support.operator_refs.timeline` (on-time, late and beyond-lateness records)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from millwheel.record import Record


def start_of(t: int, size: int, offset: int = 0) -> int:
    return t - (t - offset) % size


def tops(records: list[Record], size: int, field: str, offset: int = 0) -> dict[tuple[str, int], list[bytes]]:
    """``(key, end - 1) -> sorted values`` of the records holding each window's maximum."""
    windows: dict[tuple[str, int], list[tuple[Any, bytes]]] = defaultdict(list)
    for r in records:
        windows[(r.key, start_of(r.timestamp, size, offset) + size - 1)].append((json.loads(r.value)[field], r.value))
    out = {}
    for w, items in windows.items():
        top = max(x for x, _v in items)
        out[w] = sorted(v for x, v in items if x == top)
    return out


def final_tops(outputs: list[Record], field: str) -> dict[tuple[str, int], list[bytes]]:
    """What a consumer keeps of ``window_top``'s output: per key and timestamp (the
    window's ``end - 1``), the produced records with the greatest number."""
    windows: dict[tuple[str, int], list[tuple[Any, bytes]]] = defaultdict(list)
    for r in outputs:
        windows[(r.key, r.timestamp)].append((json.loads(r.value)[field], r.value))
    out = {}
    for w, items in windows.items():
        top = max(x for x, _v in items)
        out[w] = sorted(v for x, v in items if x == top)
    return out


def window_pairs(left: list[Record], right: list[Record], size: int, offset: int = 0,
                 semi: bool = False) -> list[tuple[Any, ...]]:
    """Every ``window_join`` output as ``(key, left, right, left_ts, right_ts, start,
    end, timestamp)`` (under ``semi``: ``(key, left, left_ts, start, end, timestamp)``), sorted."""
    out: list[tuple[Any, ...]] = []
    for a in left:
        start = start_of(a.timestamp, size, offset)
        partners = [b for b in right if b.key == a.key and start_of(b.timestamp, size, offset) == start]
        if semi:
            if partners:
                out.append((a.key, json.loads(a.value), a.timestamp, start, start + size, start + size - 1))
            continue
        for b in partners:
            out.append((a.key, json.loads(a.value), json.loads(b.value), a.timestamp, b.timestamp,
                        start, start + size, start + size - 1))
    return sorted(out, key=repr)


def window_join_outputs(outputs: list[Record], semi: bool = False) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for r in outputs:
        v = json.loads(r.value)
        assert r.key == v["key"] and r.timestamp == v["end"] - 1
        if semi:
            assert "right" not in v
            out.append((v["key"], v["left"], v["left_ts"], v["start"], v["end"], r.timestamp))
        else:
            out.append((v["key"], v["left"], v["right"], v["left_ts"], v["right_ts"], v["start"], v["end"],
                        r.timestamp))
    return sorted(out, key=repr)
