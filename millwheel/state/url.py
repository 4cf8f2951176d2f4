"""The one place a store URL becomes a backend.

* ``sqlite:///relative/path.db`` (relative to the working directory, the SQLAlchemy
  convention) or ``sqlite:////absolute/path.db`` (``?synchronous=FULL``,
  ``?wal_checkpointer=off``: no background copy of the log, sqlite_checkpointer.py); every process
  prints the file a URL resolved to (:func:`describe_store`), so neither is a surprise
* ``redis://[user:password@]host:port/db`` and ``rediss://`` for TLS; the address of
  any Redis Cluster node works too (detected, see ``millwheel.state.redis_cluster``)
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from millwheel.errors import InvalidSpecError
from millwheel.state.protocol import StateStore
from millwheel.state.url_display import describe_store, redact

# The URL helpers live in url_display (the backends use them, and this module imports
# the backends); they stay importable from here too.
__all__ = ["describe_store", "open_store", "redact"]


def open_store(url: str) -> StateStore:
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        from millwheel.state.sqlite_store import SQLiteStore

        path = url[len("sqlite:///") :].split("?", 1)[0] if url.startswith("sqlite:///") else ""
        if not path:
            raise InvalidSpecError(f"store URL {url!r}: expected sqlite:///PATH")
        query = parse_qs(parts.query)
        synchronous = query.get("synchronous", ["NORMAL"])[0]
        checkpointer = query.get("wal_checkpointer", ["on"])[0]
        if checkpointer not in ("on", "off"):
            raise InvalidSpecError(f"store URL {url!r}: wal_checkpointer must be on or off, got {checkpointer!r}")
        return SQLiteStore(path, synchronous=synchronous, url=url, wal_checkpointer=checkpointer == "on")
    if parts.scheme in ("redis", "rediss"):
        try:
            from millwheel.state.redis_store import RedisStore
        except ImportError as exc:  # the Redis backend arrives with its own issue
            raise InvalidSpecError(f"store URL {url!r}: Redis backend unavailable: {exc}") from exc
        return RedisStore.from_url(url)
    raise InvalidSpecError(
        f"store URL {url!r}: unknown scheme {parts.scheme!r}; use sqlite:///PATH or "
        "redis://HOST:PORT/DB"
    )
