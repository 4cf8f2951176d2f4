"""The Redis store's connection: URL parsing, the client (one node or a cluster),
retries, scripts, fenced writes and error mapping.

The only module that imports redis-py. :class:`RedisConnection` is the base of
:class:`millwheel.state.redis_store.RedisStore`, which holds the StateStore
operations; key layout and value framing are in :mod:`millwheel.state.redis_keys`;
what differs on a cluster (detection, routing, replicated writes) is in
:mod:`millwheel.state.redis_cluster`.

Retries, idempotence, lost writes
---------------------------------
A lost connection, a timeout or a Redis still loading its AOF is retried with
exponential backoff until ``retry_deadline`` seconds pass. A script is atomic, so a
checkpoint is never half-applied; but its reply can be lost after it was applied.
Every fenced write (checkpoint, ack) therefore carries a random ID, stored in
``:last`` by the same script; a retry that finds its own ID there returns without
applying anything twice. The store also remembers, per range and token, the ID of
the last write it applied and passes it along: if ``:last`` holds anything else,
Redis lost acknowledged writes (restarted without an fsynced AOF) and the store
raises :class:`LostWritesError` instead of building on a past that changed.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Self, Sequence, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from millwheel.errors import CorruptDataError, FencedError, InvalidSpecError, StoreError
from millwheel.state.redis_cluster import (
    check_database,
    cluster_mode,
    is_cluster_node,
    node_client,
    refresh_topology,
    replicated,
)
from millwheel.state.redis_keys import _RangeKeys, _show, _tag
from millwheel.state.url_display import redact

T = TypeVar("T")

_RETRYABLE: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a replica promoted mid-failover
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterError,  # CLUSTERDOWN, MASTERDOWN, redirections past redis-py's TTL
    redis.exceptions.AskError,  # and MOVED: redis-py follows them, until its TTL runs out
    redis.exceptions.SlotNotCoveredError,  # mid-failover, no master for a slot yet
)
_FATAL: tuple[type[Exception], ...] = (redis.exceptions.AuthenticationError,)
# A cluster client that cannot reach any node raises a plain RedisClusterException.
_MAYBE_TRANSIENT: tuple[type[Exception], ...] = (*_RETRYABLE, redis.exceptions.RedisClusterException)


class LostWritesError(StoreError):
    """Redis no longer holds writes it acknowledged (it restarted from a stale AOF or
    snapshot). Continuing would mix in-memory progress with an older store, so the
    worker must stop and restart from the store."""


class RedisConnection:
    """Calling Redis for :class:`~millwheel.state.redis_store.RedisStore` (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        url: str = "",
        prefix: str = "mw",
        retry_deadline_s: float = 30.0,
        backoff_cap_s: float = 1.0,
        verify_lineage: bool = True,
        cluster: str = "no",
        cluster_client: Callable[[], Any] | None = None,
        db: int = 0,
        wait_replicas: int = 0,
    ) -> None:
        if "{" in prefix or "}" in prefix:
            raise InvalidSpecError(f"redis store prefix {prefix!r} must not contain braces")
        self._client: Any = client  # redis-py's reply types are unions of sync and async
        # Whether ``_client`` is a cluster client; None until the first call asks the server
        # (see millwheel.state.redis_cluster). ``cluster_client`` builds the cluster client.
        self._cluster: bool | None = isinstance(client, redis.RedisCluster)
        if cluster != "no" and cluster_client is not None:
            self._cluster = None
        self._cluster_mode = cluster
        self._cluster_client = cluster_client
        self._switch = threading.Lock()
        self._db = db
        self._wait_replicas = wait_replicas
        self.url = url
        self._where = redact(url)
        self._prefix = prefix
        self._retry_deadline_s = retry_deadline_s
        self._backoff_cap_s = backoff_cap_s
        self._verify_lineage = verify_lineage
        self._sha: dict[str, str] = {}
        self._last_applied: dict[tuple[str, int, int], str] = {}

    # -- construction from a URL ------------------------------------------------
    @classmethod
    def from_url(cls, url: str) -> Self:
        """``redis[s]://[user[:password]@]host[:port][/db][?option=value&...]``.

        Options: ``max_connections`` (16), ``socket_timeout`` (s, 10),
        ``connect_timeout`` (s, 2), ``pool_timeout`` (s, 10), ``retry_deadline`` (s, 30),
        ``backoff_cap`` (s, 1), ``prefix`` (mw), ``health_check_interval`` (s, 0),
        ``verify_lineage`` (1), ``cluster`` (auto|yes|no, auto), ``wait_replicas`` (0),
        and for ``rediss://``: ``ssl_ca_certs``, ``ssl_certfile``,
        ``ssl_keyfile``, ``ssl_cert_reqs`` (required|optional|none). The password and
        user default to ``MILLWHEEL_REDIS_PASSWORD`` and ``MILLWHEEL_REDIS_USERNAME``.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise InvalidSpecError(f"store URL {redact(url)!r}: expected redis:// or rediss://")
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        known = {
            "max_connections", "socket_timeout", "connect_timeout", "pool_timeout",
            "retry_deadline", "backoff_cap", "prefix", "health_check_interval",
            "verify_lineage", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
            "cluster", "wait_replicas",
        }
        unknown = sorted(set(query) - known)
        if unknown:
            raise InvalidSpecError(
                f"store URL {redact(url)!r}: unknown options {unknown}; known: {sorted(known)}"
            )

        def number(name: str, default: float) -> float:
            try:
                value = float(query.get(name, default))
            except ValueError:
                raise InvalidSpecError(f"store URL option {name}: not a number") from None
            if value < 0:
                raise InvalidSpecError(f"store URL option {name}: must be >= 0")
            return value

        path = parts.path.strip("/")
        try:
            db = int(path) if path else 0
        except ValueError:
            raise InvalidSpecError(f"store URL {redact(url)!r}: database {path!r} is not a number") from None
        try:
            port = parts.port or 6379
        except ValueError:
            raise InvalidSpecError(f"store URL {redact(url)!r}: bad port") from None
        password = unquote(parts.password) if parts.password else os.environ.get("MILLWHEEL_REDIS_PASSWORD")
        username = unquote(parts.username) if parts.username else os.environ.get("MILLWHEEL_REDIS_USERNAME")
        kwargs: dict[str, Any] = {
            "host": parts.hostname or "127.0.0.1",
            "port": port,
            "db": db,
            "username": username or None,
            "password": password or None,
            "socket_timeout": number("socket_timeout", 10.0),
            "socket_connect_timeout": number("connect_timeout", 2.0),
            "health_check_interval": int(number("health_check_interval", 0)),
            "max_connections": int(number("max_connections", 16)) or 16,
            "timeout": number("pool_timeout", 10.0),
            "retry": Retry(NoBackoff(), 0),  # RedisStore retries itself, idempotently
        }
        if parts.scheme == "rediss":
            kwargs["connection_class"] = redis.SSLConnection
            for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
                if name in query:
                    kwargs[name] = query[name]
        pool = redis.BlockingConnectionPool(**kwargs)  # type: ignore[no-untyped-call]
        client = redis.Redis(connection_pool=pool)

        def cluster_client() -> Any:
            """The same options, per node of the cluster (one pool per node)."""
            # (redis-py builds its node clients with these; pool_timeout stays at its 20 s)
            per_node = {
                k: v for k, v in kwargs.items() if k not in ("db", "connection_class", "timeout")
            }
            if parts.scheme == "rediss":
                per_node["ssl"] = True
            return redis.RedisCluster(connection_pool_class=redis.BlockingConnectionPool, **per_node)

        return cls(
            client,
            url=url,
            prefix=query.get("prefix", "mw") or "mw",
            retry_deadline_s=number("retry_deadline", 30.0),
            backoff_cap_s=number("backoff_cap", 1.0),
            verify_lineage=query.get("verify_lineage", "1") not in ("0", "false", "no"),
            cluster=cluster_mode(query.get("cluster", "auto") or "auto", redact(url)),
            cluster_client=cluster_client,
            db=db,
            wait_replicas=int(number("wait_replicas", 0)),
        )

    def servers(self) -> list[tuple[str, int]]:
        """The servers this store's data is on, as (host, port): its URL's, and on Redis
        Cluster every node its client knows (replicas too). No call is made: what a
        connector is compared with (millwheel/connectors/own_store.py)."""
        parts = urlsplit(self.url)
        try:
            port = parts.port or 6379
        except ValueError:
            port = 6379
        out = [(parts.hostname or "127.0.0.1", port)] if self.url else []
        if self._cluster:
            try:
                out += [(str(n.host), int(n.port)) for n in self._client.get_nodes()]
            except Exception:  # noqa: BLE001 - a cluster client not yet initialized: the URL's node alone
                pass
        return out

    # -- the client: one node, or a cluster --------------------------------------
    @property
    def _r(self) -> Any:
        """The client; on first use, a cluster client if the server is a cluster node."""
        if self._cluster is None:
            self._choose_client()
        return self._client

    def _choose_client(self) -> None:
        with self._switch:
            if self._cluster is not None:
                return
            try:
                on_cluster = self._cluster_mode == "yes" or is_cluster_node(self._client.info("cluster"))
            except redis.exceptions.ResponseError as exc:
                if "not allowed in cluster mode" not in str(exc):  # SELECT of a database != 0
                    raise
                on_cluster = True
            if on_cluster:
                check_database(self._db, self._where)
                assert self._cluster_client is not None
                single, self._client = self._client, self._cluster_client()
                single.close()
                single.connection_pool.disconnect()
                self._cluster = True
            else:
                self._cluster = False

    def _write(self, key: str, *args: Any) -> Any:
        """One write command; with ``wait_replicas`` it returns once replicas have it."""
        if not self._wait_replicas:
            return self._r.execute_command(*args)
        client = node_client(self._r, key, bool(self._cluster))
        deadline = time.monotonic() + self._retry_deadline_s
        return replicated(client, args, self._wait_replicas, deadline, _RETRYABLE)

    # -- key names --------------------------------------------------------------
    def _range(self, computation: str, range_id: int) -> _RangeKeys:
        base = f"{self._prefix}:r:{{{_tag(computation)}:{range_id}}}:"
        return _RangeKeys(*(base + s for s in (
            "token", "last", "state", "skeys", "timers", "tkeys", "outbox", "oorder", "oseq",
            "idgens", "wm", "attempts", "atterr", "errcount", "errlog",
        )))

    def _registry(self, computation: str) -> str:
        return f"{self._prefix}:ranges:{{{_tag(computation)}}}"

    def _log(self, stream: str) -> tuple[str, str, str]:
        base = f"{self._prefix}:log:{{{_tag(stream)}}}:"
        return base + "seq", base + "ids", base + "entries"

    def _meta(self) -> str:
        return f"{self._prefix}:meta"

    # -- calling Redis: retries, scripts, errors ---------------------------------
    def _call(self, what: str, keys: Sequence[str], fn: Callable[[], T]) -> T:
        """Run ``fn`` (idempotent), retrying lost connections with backoff."""
        deadline = time.monotonic() + self._retry_deadline_s
        delay = 0.02
        while True:
            try:
                return fn()
            except _FATAL as exc:
                raise StoreError(f"{self._where}: {what}: {exc}") from None
            except _MAYBE_TRANSIENT as exc:
                if isinstance(exc, redis.exceptions.AskError) and not self._cluster:
                    raise StoreError(
                        f"{self._where}: {what}: {exc.__class__.__name__}: {exc}: the server is a "
                        "Redis Cluster node; drop ?cluster=no from the store URL"
                    ) from None
                if not _transient(exc):
                    raise StoreError(f"{self._where}: {what}: {exc.__class__.__name__}: {exc}") from None
                if self._cluster:
                    refresh_topology(self._client)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreError(
                        f"{self._where}: {what}: Redis unreachable for "
                        f"{self._retry_deadline_s:g}s: {exc.__class__.__name__}: {exc}"
                    ) from None
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, self._backoff_cap_s)
            except redis.exceptions.ResponseError as exc:
                raise self._response_error(what, keys, exc) from None
            except redis.exceptions.RedisError as exc:
                raise StoreError(f"{self._where}: {what}: {exc.__class__.__name__}: {exc}") from None

    def _response_error(self, what: str, keys: Sequence[str], exc: Exception) -> StoreError:
        message = str(exc)
        if message.startswith("MWCORRUPT "):
            return CorruptDataError(f"{self._where}: {what}: Redis key {message[10:]}")
        if "WRONGTYPE" in message or "not an integer" in message or "not a valid float" in message:
            named = ", ".join(repr(k) for k in keys)
            return CorruptDataError(
                f"{self._where}: {what}: Redis key {named} holds the wrong kind of value ({message})"
            )
        return StoreError(f"{self._where}: {what}: {exc.__class__.__name__}: {message}")

    def _script(self, source: str, keys: Sequence[str], args: Sequence[bytes | str | int]) -> Any:
        """EVALSHA, loading the script once and again after NOSCRIPT (e.g. a restart)."""
        sha = self._sha.get(source)
        if sha is not None:
            try:
                return self._write(keys[0], "EVALSHA", sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                pass
        sha = self._sha[source] = str(self._r.script_load(source))
        return self._write(keys[0], "EVALSHA", sha, len(keys), *keys, *args)

    def _fenced(
        self, what: str, source: str, computation: str, range_id: int, token: int,
        keys: Sequence[str], args: Sequence[bytes | str | int], advances: bool = True,
    ) -> bytes:
        """Run a fenced script (prologue above) with retry; raise on fence or lost writes.

        Scripts that ``advance`` the range's lineage (checkpoint, ack) store their ID in
        ``:last``; the others (watermark, expiry) only check it.
        """
        rk = self._range(computation, range_id)
        op_id = os.urandom(8).hex()  # as secrets.token_hex(8), without its layers
        lineage_key = (computation, range_id, token)
        expected = self._last_applied.get(lineage_key, "") if self._verify_lineage else ""
        all_keys = [rk.token, rk.last, *keys]
        head: list[bytes | str | int] = [token, op_id, expected]
        try:
            status, detail = self._call(
                what, all_keys, lambda: self._script(source, all_keys, [*head, *args])
            )
        except StoreError:
            # Whether the write was applied is unknown now: stop expecting a lineage.
            self._last_applied.pop(lineage_key, None)
            raise
        status = int(status)
        if status == 0:
            raise FencedError(computation, range_id, token, int(detail))
        if status == 3:
            raise LostWritesError(
                f"{self._where}: {what}: Redis lost acknowledged writes of {computation!r} range "
                f"{range_id} (last write applied by this worker was {expected}, Redis has "
                f"{detail.decode() or 'none'}); Redis restarted without an fsynced AOF? Restart "
                "the workers so they recover from what Redis holds"
            )
        if advances:
            self._last_applied[lineage_key] = op_id
        return bytes(detail)

    def _pipeline(self, what: str, commands: Sequence[tuple[str, str, tuple[Any, ...]]]) -> list[Any]:
        """Run ``(key, command, args)`` triples in one round trip; errors name their key."""

        def run() -> list[Any]:
            pipe = self._r.pipeline(transaction=False)
            for key, command, args in commands:
                getattr(pipe, command)(key, *args)
            results = list(pipe.execute(raise_on_error=False))
            for result in results:
                if isinstance(result, _RETRYABLE):
                    raise result  # the whole pipeline is retried (reads, or INCR on acquire)
            return results

        results = self._call(what, [k for k, _c, _a in commands], run)
        for (key, _c, _a), result in zip(commands, results, strict=True):
            if isinstance(result, redis.exceptions.ResponseError):
                raise self._response_error(what, [key], result)
        return results

    def _corrupt(self, key: str, field: bytes | str | None, problem: str) -> CorruptDataError:
        where = f"Redis key {key!r}" + (f" field {_show(field)}" if field is not None else "")
        return CorruptDataError(f"{self._where}: {where}: {problem}")

    def close(self) -> None:
        """Close every connection: the one pool, or each node's pool of a cluster."""
        self._client.close()
        pool = getattr(self._client, "connection_pool", None)
        if pool is not None:
            pool.disconnect()


def _transient(exc: BaseException) -> bool:
    """Worth retrying: a lost connection, a failover in progress, a cluster client that
    could not reach any node or found slots without a master (not a wrong password)."""
    if isinstance(exc, _RETRYABLE):
        return True
    if isinstance(exc.__cause__, _FATAL):
        return False
    text = str(exc)
    if "cannot be connected" in text:  # the cause says why: a refused connection, or a bug
        return isinstance(exc.__cause__, _RETRYABLE)
    return "not covered" in text or "could not agree" in text


def plain_client(url: str, socket_timeout_s: float = 10.0) -> Any:
    """A plain redis-py client for a connector (millwheel.connectors.redis_stream): this
    module stays the one importer of redis-py. Its errors are :func:`redis_errors`."""
    return redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=2.0)


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a connector retries: the server gone or slow."""
    return (redis.ConnectionError, redis.TimeoutError)
