"""Where millwheel's Redis bytes go: MEMORY USAGE of every ``mw:*`` key, grouped by
role (state, timers, consumed IDs, outbox, stream log ...), per entry.

"Bytes per key" of the suite is the ``state`` group: bytes per key with state,
hash overhead included; ``ids`` is the cost of remembering one consumed record ID.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

_LENGTH = {"hash": "hlen", "zset": "zcard", "set": "scard", "list": "llen", "string": None}


def _role(key: str) -> str:
    if "}:" in key:
        head, _, suffix = key.rpartition("}:")
        return ("log:" if ":log:" in head else "") + suffix
    return key.split(":")[1] if ":" in key else key


def snapshot(url: str) -> dict[str, Any]:
    import redis

    r = redis.Redis.from_url(url)
    try:
        groups: dict[str, dict[str, float]] = defaultdict(lambda: {"keys": 0, "entries": 0, "bytes": 0})
        for raw in r.scan_iter(match="mw:*", count=1000):
            key = raw.decode()
            kind = r.type(raw).decode()
            size = r.memory_usage(raw, samples=0) or 0
            length_cmd = _LENGTH.get(kind)
            entries = getattr(r, length_cmd)(raw) if length_cmd else 1
            g = groups[_role(key)]
            g["keys"] += 1
            g["entries"] += entries
            g["bytes"] += size
        for g in groups.values():
            g["bytes_per_entry"] = g["bytes"] / g["entries"] if g["entries"] else 0.0
        info = r.info("memory")
        return {"used_memory": info["used_memory"], "groups": dict(groups)}
    finally:
        r.close()
