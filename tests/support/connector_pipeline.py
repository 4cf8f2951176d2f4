"""The pipeline the connector tests run: a Redis stream -> filter -> map -> window sums
-> PostgreSQL, its input, and the table a plain-Python reference expects."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

S = 1_000_000
WINDOW_US = 10 * S


def entries(n: int, keys: int = 7) -> list[dict[str, str]]:
    """``n`` stream entries: key kK, value {"n": i}, timestamps a second apart, a few
    negative values the filter drops."""
    out = []
    for i in range(n):
        value = -1 if i % 11 == 0 else i
        out.append({"key": f"k{i % keys}", "value": json.dumps({"n": value}), "timestamp": str(1_000 * S + i * S)})
    return out


def expected_sums(items: list[dict[str, str]]) -> dict[tuple[str, int], tuple[float, int]]:
    """(key, window start) -> (sum of 2n, count) for n >= 0: what the table must hold."""
    sums: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0])
    for e in items:
        n = json.loads(e["value"])["n"]
        if n < 0:
            continue
        ts = int(e["timestamp"])
        start = ts - ts % WINDOW_US
        acc = sums[(e["key"], start)]
        acc[0] += 2 * n
        acc[1] += 1
    return {k: (v[0], int(v[1])) for k, v in sums.items()}


def spec(redis_url: str, pg_url: str, *, until_end: bool, key_ranges: int = 2,
         source: dict[str, Any] | None = None, sink: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pipeline from a Redis stream to PostgreSQL, or from/to what ``source`` and
    ``sink`` say."""
    source = dict(source or {"type": "redis-stream", "url": redis_url, "stream": "events"})
    source["max_disorder_us"] = 0
    if until_end:
        source["until"] = "end"
    opts = {"key_ranges": key_ranges}
    return {
        "injectors": [{"name": "ev", "stream": "ev", "source": source}],
        "computations": [
            {"name": "pos", "inputs": ["ev"], "outputs": ["kept"],
             "code": {"name": "filter", "params": {"expr": "json['n'] >= 0"}}, "options": opts},
            {"name": "dbl", "inputs": ["kept"], "outputs": ["doubled"],
             "code": {"name": "map", "params": {"value": "str(json['n'] * 2)"}}, "options": opts},
            {"name": "sums", "inputs": ["doubled"], "outputs": ["sums"],
             "code": {"name": "window_aggregate", "params": {"size_us": WINDOW_US, "aggregation": "sum"}},
             "options": opts},
        ],
        "sinks": [{"stream": "sums", **(sink or {"type": "postgres", "url": pg_url, "table": "sums"})}],
    }


def message_sums(messages: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[float, int]]:
    """A sink's messages ({key, value, timestamp, id}) as :func:`table_sums` reads rows."""
    return table_sums([(m["id"], m["key"], json.loads(m["value"])["start"], None, json.loads(m["value"]), 0)
                       for m in messages])


def table_sums(rows: list[tuple[Any, ...]]) -> dict[tuple[str, int], tuple[float, int]]:
    """The table's rows as (key, window start) -> (sum, count); a window twice fails."""
    out: dict[tuple[str, int], tuple[float, int]] = {}
    for _rid, key, start, _end, value, _ts in rows:
        assert (key, start) not in out, f"window {(key, start)} written twice"
        out[(key, start)] = (float(value["value"]), int(value["count"]))
    return out
