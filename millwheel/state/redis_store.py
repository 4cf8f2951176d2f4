"""The production store: Redis, with one Lua script per checkpoint.

The only module that imports redis-py. Same contract as the SQLite store
(:mod:`millwheel.state.protocol`); what is specific to Redis is written down here.
The same URL serves a single server and a Redis Cluster; what differs on a cluster
(detection, routing, replicated writes) is in :mod:`millwheel.state.redis_cluster`.

Key layout
----------
Every key starts with a prefix (``mw``, or ``?prefix=`` in the URL). All keys of one
key range of one computation carry the hash tag ``{COMPUTATION:RANGE}``, so every
script touches one hash slot and the same code runs on Redis Cluster::

    mw:r:{C:R}:token    STRING  sequencer token (INCR on acquire)
    mw:r:{C:R}:last     STRING  ID of the last fenced write applied (idempotent retry,
                                lost-write detection, see below)
    mw:r:{C:R}:state    HASH    key -> framed state value
    mw:r:{C:R}:skeys    ZSET    keys with state, all score 0 (lexicographic paging)
    mw:r:{C:R}:timers   HASH    timer field -> JSON [key, tag, time, domain, hold]
    mw:r:{C:R}:tkeys    ZSET    timer fields, score 0 (a key's timers by lex range)
    mw:r:{C:R}:outbox   HASH    outbox field -> framed production
    mw:r:{C:R}:oorder   ZSET    outbox field, score = checkpoint order
    mw:r:{C:R}:oseq     STRING  outbox order counter
    mw:r:{C:R}:ids      ZSET    consumed record ID, score = time first consumed (µs)
    mw:r:{C:R}:wm       STRING  the range's reported low watermark
    mw:r:{C:R}:attempts HASH    item (record ID / timer identity) -> failed attempts
    mw:r:{C:R}:atterr   HASH    item -> JSON of its last error
    mw:r:{C:R}:errcount HASH    counter name -> count (dead_lettered, skipped, late_dropped)
    mw:r:{C:R}:errlog   LIST    JSON of the last given-up errors, newest first
    mw:ranges:{C}       SET     range IDs of C ever acquired (the range registry)
    mw:log:{S}:seq      STRING  stream log sequence counter of stream S
    mw:log:{S}:ids      HASH    record ID -> sequence number (idempotent append)
    mw:log:{S}:entries  ZSET    "SEQ:" + framed record, score = SEQ
    mw:meta             HASH    name -> value (the service registry; untagged: one
                                key, on the master of its own slot in a cluster)

``C`` and ``S`` have ``%``, ``{`` and ``}`` percent-encoded, so a name never cuts its
own hash tag short. A timer field and an outbox field are ``LEN:FIRST`` + ``SECOND`` (``LEN`` is the byte
length of ``FIRST``): unique for any strings, and a key's timers are one lex range.

Where state lives: the writer of a key's state is its range, so state is stored
under the range's tag. ``read_state(C, keys, range_id=R)`` (what a range worker
calls) reads that one hash with one HMGET. Without ``range_id`` (queries, tools)
the store does not know the computation's range count, so it looks the keys up in
every range of the registry in one pipelined round trip (plus one for the registry)
and never guesses a count. Consequence: changing a computation's ``key_ranges``
with state already stored needs a migration (as timers and outboxes do on any
backend).

Stored values are framed (magic, length, CRC32): foreign or truncated data, like a
key of the wrong type, raises :class:`CorruptDataError` naming the Redis key.

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

import json
import os
import secrets
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from millwheel.errors import CorruptDataError, FencedError, InvalidSpecError, StoreError
from millwheel.record import Record, TimeDomain, Timer
from millwheel.state.protocol import RECENT_ERRORS, Checkpoint, ErrorReport, Production
from millwheel.state.redis_cluster import (
    check_database,
    cluster_mode,
    is_cluster_node,
    node_client,
    refresh_topology,
    replicated,
)
from millwheel.state.redis_lua import ACK, APPEND_LOG, BUMP_ATTEMPTS, CHECKPOINT, EXPIRE, WATERMARK
from millwheel.state.url import redact

T = TypeVar("T")

_MAGIC = b"\xffMW1"
_FRAME = struct.Struct(">II")  # body length, CRC32 of body
_CHUNK = 1000  # fields per HMGET / ZMSCORE / script call
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


@dataclass(frozen=True)
class _RangeKeys:
    token: str
    last: str
    state: str
    skeys: str
    timers: str
    tkeys: str
    outbox: str
    oorder: str
    oseq: str
    ids: str
    wm: str
    attempts: str
    atterr: str
    errcount: str
    errlog: str


def _field(first: str, second: str) -> bytes:
    """``LEN:FIRST`` + ``SECOND``: unique for any pair of strings."""
    head = first.encode()
    return str(len(head)).encode() + b":" + head + second.encode()


def _unfield(raw: bytes) -> tuple[str, str]:
    length_s, _, rest = raw.partition(b":")
    n = int(length_s)
    if len(rest) < n:
        raise ValueError("field shorter than its length prefix")
    return rest[:n].decode(), rest[n:].decode()


def _frame(header: Any, value: bytes) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode() + b"\n" + value
    return _MAGIC + _FRAME.pack(len(body), zlib.crc32(body)) + body


def _unframe(raw: bytes) -> tuple[Any, bytes]:
    """Inverse of :func:`_frame`; ValueError says what is wrong with ``raw``."""
    if not raw.startswith(_MAGIC):
        raise ValueError("not a millwheel value (bad magic)")
    head = len(_MAGIC) + _FRAME.size
    if len(raw) < head:
        raise ValueError(f"truncated value ({len(raw)} bytes)")
    length, crc = _FRAME.unpack_from(raw, len(_MAGIC))
    body = raw[head:]
    if len(body) != length:
        raise ValueError(f"truncated value (body {len(body)} bytes, expected {length})")
    if zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    header, sep, value = body.partition(b"\n")
    if not sep:
        raise ValueError("no header")
    return json.loads(header), value


def _tag(name: str) -> str:
    """``name`` made safe inside a hash tag: braces (and ``%``) percent-encoded."""
    return name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisStore:
    """A :class:`~millwheel.state.protocol.StateStore` on Redis (see the module docstring)."""

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
        self._where = _redact(url)
        self._prefix = prefix
        self._retry_deadline_s = retry_deadline_s
        self._backoff_cap_s = backoff_cap_s
        self._verify_lineage = verify_lineage
        self._sha: dict[str, str] = {}
        self._last_applied: dict[tuple[str, int, int], str] = {}

    # -- construction from a URL ------------------------------------------------
    @classmethod
    def from_url(cls, url: str) -> RedisStore:
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
            raise InvalidSpecError(f"store URL {_redact(url)!r}: expected redis:// or rediss://")
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
                f"store URL {_redact(url)!r}: unknown options {unknown}; known: {sorted(known)}"
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
            raise InvalidSpecError(f"store URL {_redact(url)!r}: database {path!r} is not a number") from None
        try:
            port = parts.port or 6379
        except ValueError:
            raise InvalidSpecError(f"store URL {_redact(url)!r}: bad port") from None
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
            cluster=cluster_mode(query.get("cluster", "auto") or "auto", _redact(url)),
            cluster_client=cluster_client,
            db=db,
            wait_replicas=int(number("wait_replicas", 0)),
        )

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
            "ids", "wm", "attempts", "atterr", "errcount", "errlog",
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
        op_id = secrets.token_hex(8)
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

    # -- ownership ----------------------------------------------------------------
    def acquire(self, computation: str, range_id: int) -> int:
        """Register the range, then INCR its token (one atomic bump: a retry after a lost
        reply bumps once more, which only fences harder)."""
        rk = self._range(computation, range_id)
        registry = self._registry(computation)
        if self._wait_replicas:  # two slots, each write replicated on its own connection
            self._call("acquire", [registry], lambda: self._write(registry, "SADD", registry, range_id))
            return int(self._call("acquire", [rk.token], lambda: self._write(rk.token, "INCR", rk.token)))
        _added, token = self._pipeline("acquire", [
            (registry, "sadd", (range_id,)), (rk.token, "incr", ()),
        ])
        return int(token)

    def current_token(self, computation: str, range_id: int) -> int:
        key = self._range(computation, range_id).token
        raw = self._call("current_token", [key], lambda: self._r.get(key))
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            raise self._corrupt(key, None, f"not an integer token: {_show(raw)}") from None

    def _ranges(self, computation: str) -> list[int]:
        key = self._registry(computation)
        members = self._call("read range registry", [key], lambda: self._r.smembers(key))
        try:
            return sorted(int(m) for m in members)
        except ValueError:
            raise self._corrupt(key, None, "holds a non-integer range id") from None

    # -- the checkpoint -----------------------------------------------------------
    def checkpoint(self, cp: Checkpoint) -> None:
        """One EVALSHA: check the token, then state, timers, outbox, IDs; all or nothing."""
        rk = self._range(cp.computation, cp.range_id)
        writes = [(k, v) for k, v in cp.state_writes.items() if v is not None]
        deletes = [k for k, v in cp.state_writes.items() if v is None]
        args: list[bytes | str | int] = [
            cp.now_us, len(writes), len(deletes), len(cp.timer_clears), len(cp.timer_sets),
            len(cp.productions), len(cp.consumed_ids), len(cp.resolved), len(cp.counters),
            len(cp.errors), RECENT_ERRORS,
        ]
        for key, value in writes:
            args += [key, _frame(None, value)]
        args += deletes
        args += [_field(k, t) for k, t in cp.timer_clears]
        for t in cp.timer_sets:
            args += [_field(t.key, t.tag), _timer_json(t)]
        for p in cp.productions:
            r = p.record
            args += [
                _field(p.consumer, r.record_id),
                _frame([p.consumer, p.stream, r.record_id, r.key, r.timestamp], r.value),
            ]
        args += cp.consumed_ids
        args += cp.resolved
        for name, n in cp.counters.items():
            args += [name, int(n)]
        args += cp.errors
        self._fenced(
            f"checkpoint of {cp.computation!r} range {cp.range_id}", CHECKPOINT,
            cp.computation, cp.range_id, cp.token,
            [rk.state, rk.skeys, rk.timers, rk.tkeys, rk.outbox, rk.oorder, rk.oseq, rk.ids,
             rk.attempts, rk.atterr, rk.errcount, rk.errlog],
            args,
        )

    # -- failing user code ------------------------------------------------------------
    def bump_attempts(
        self, computation: str, range_id: int, token: int, item_id: str, error: bytes
    ) -> int:
        rk = self._range(computation, range_id)
        detail = self._fenced(
            f"bump_attempts of {computation!r} range {range_id}", BUMP_ATTEMPTS, computation,
            range_id, token, [rk.attempts, rk.atterr], [item_id, error],
        )
        if not detail:  # a retry found the bump applied: read the count it left
            detail = self._call("bump_attempts", [rk.attempts],
                                lambda: self._r.hget(rk.attempts, item_id)) or b"0"
        return int(detail)

    def read_errors(self, computation: str, range_id: int) -> ErrorReport:
        rk = self._range(computation, range_id)
        counts, errors, counters, recent = self._pipeline("read_errors", [
            (rk.attempts, "hgetall", ()), (rk.atterr, "hgetall", ()),
            (rk.errcount, "hgetall", ()), (rk.errlog, "lrange", (0, RECENT_ERRORS - 1)),
        ])
        try:
            return ErrorReport(
                attempts={bytes(i).decode(): (int(n), bytes(errors.get(i, b"{}")))
                          for i, n in counts.items()},
                counters={bytes(k).decode(): int(v) for k, v in counters.items()},
                recent=[bytes(e) for e in recent],
            )
        except ValueError as exc:
            raise self._corrupt(rk.attempts, None, f"error counts unreadable: {exc}") from None

    def ack(
        self, producer: str, range_id: int, token: int, acked: Sequence[tuple[str, str]]
    ) -> None:
        rk = self._range(producer, range_id)
        self._fenced(
            f"ack of {producer!r} range {range_id}", ACK, producer, range_id, token,
            [rk.outbox, rk.oorder], [_field(c, r) for c, r in acked],
        )

    # -- reads --------------------------------------------------------------------
    def read_state(
        self, computation: str, keys: Iterable[str], range_id: int | None = None
    ) -> dict[str, bytes]:
        """State of those keys that have any: one HMGET per 1000 keys, one round trip.

        ``range_id`` is the range owning the keys (a range worker knows it); without
        it every registered range of the computation is searched.
        """
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        ranges = [range_id] if range_id is not None else self._ranges(computation)
        commands: list[tuple[str, str, tuple[Any, ...]]] = []
        for r in ranges:
            key = self._range(computation, r).state
            for start in range(0, len(wanted), _CHUNK):
                commands.append((key, "hmget", (wanted[start : start + _CHUNK],)))
        results = self._pipeline("read_state", commands)
        out: dict[str, bytes] = {}
        for (key, _c, (chunk,)), values in zip(commands, results, strict=True):
            for name, raw in zip(chunk, values, strict=True):
                if raw is not None:
                    out[name] = self._state_value(key, name, raw)
        return out

    def _state_value(self, key: str, name: str, raw: bytes) -> bytes:
        try:
            header, value = _unframe(raw)
        except ValueError as exc:
            raise self._corrupt(key, name, f"state value unreadable: {exc}") from None
        if header is not None:
            raise self._corrupt(key, name, "not a state value")
        return value

    def _decode_timers(self, key: str, items: Iterable[tuple[bytes, bytes | None]]) -> list[Timer]:
        timers = []
        for field, raw in items:
            if raw is None:
                continue
            try:
                k, tag, at, domain, hold = json.loads(raw)
                timer = Timer(str(k), str(tag), int(at), TimeDomain(domain), bool(hold))
                if _field(timer.key, timer.tag) != field:
                    raise ValueError("does not match its field")
            except (ValueError, TypeError) as exc:
                raise self._corrupt(key, field, f"timer unreadable: {exc}") from None
            timers.append(timer)
        return timers

    def read_timers(self, computation: str, range_id: int) -> list[Timer]:
        key = self._range(computation, range_id).timers
        items = self._call(
            "read_timers", [key], lambda: list(self._r.hscan_iter(key, count=1000))
        )
        return self._decode_timers(key, items)

    def read_key_timers(
        self, computation: str, key: str, range_id: int | None = None
    ) -> list[Timer]:
        ranges = [range_id] if range_id is not None else self._ranges(computation)
        prefix = _field(key, "")
        index = [(self._range(computation, r).tkeys, self._range(computation, r).timers) for r in ranges]
        fields = self._pipeline("read_key_timers", [
            (tkeys, "zrangebylex", (b"[" + prefix, b"[" + prefix + b"\xff")) for tkeys, _t in index
        ])
        lookups = [(timers, fs) for (_tk, timers), fs in zip(index, fields, strict=True) if fs]
        values = self._pipeline("read_key_timers", [(timers, "hmget", (fs,)) for timers, fs in lookups])
        out: list[Timer] = []
        for (timers, fs), vals in zip(lookups, values, strict=True):
            out += self._decode_timers(timers, zip(fs, vals, strict=True))
        return sorted(out, key=lambda t: (t.time, t.tag))

    def read_outbox(self, producer: str, range_id: int) -> list[Production]:
        rk = self._range(producer, range_id)
        fields = self._call("read_outbox", [rk.oorder], lambda: self._r.zrange(rk.oorder, 0, -1))
        out: list[Production] = []
        for start in range(0, len(fields), _CHUNK):
            chunk = fields[start : start + _CHUNK]
            values = self._call("read_outbox", [rk.outbox], partial(self._r.hmget, rk.outbox, chunk))
            for field, raw in zip(chunk, values, strict=True):
                if raw is None:
                    raise self._corrupt(rk.oorder, field, f"outbox entry missing from {rk.outbox!r}")
                out.append(self._production(rk.outbox, field, raw))
        return out

    def _production(self, key: str, field: bytes, raw: bytes) -> Production:
        try:
            header, value = _unframe(raw)
            consumer, stream, record_id, rkey, ts = header
            return Production(str(consumer), str(stream), Record(str(rkey), value, int(ts), str(record_id)))
        except (ValueError, TypeError) as exc:
            raise self._corrupt(key, field, f"outbox entry unreadable: {exc}") from None

    def contains_ids(self, computation: str, range_id: int, ids: Sequence[str]) -> set[str]:
        key = self._range(computation, range_id).ids
        chunks = [list(ids[s : s + _CHUNK]) for s in range(0, len(ids), _CHUNK)]
        results = self._pipeline("contains_ids", [(key, "zmscore", (c,)) for c in chunks])
        return {
            i for chunk, scores in zip(chunks, results, strict=True)
            for i, s in zip(chunk, scores, strict=True) if s is not None
        }

    def iter_ids(self, computation: str, range_id: int) -> Iterator[str]:
        key = self._range(computation, range_id).ids
        members = self._call(
            "iter_ids", [key], lambda: [m for m, _s in self._r.zscan_iter(key, count=5000)]
        )
        return (m.decode() for m in dict.fromkeys(members))

    def expire_ids(self, computation: str, range_id: int, token: int, older_than_us: int) -> int:
        rk = self._range(computation, range_id)
        detail = self._fenced(
            f"expire_ids of {computation!r} range {range_id}", EXPIRE, computation, range_id,
            token, [rk.ids], [older_than_us], advances=False,
        )
        return int(detail or b"0")

    def list_keys(self, computation: str, after: str | None, limit: int) -> list[str]:
        if limit <= 0:
            return []
        low = b"-" if after is None else b"(" + after.encode()
        ranges = self._ranges(computation)
        keys = [self._range(computation, r).skeys for r in ranges]
        results = self._pipeline("list_keys", [(k, "zrangebylex", (low, b"+", 0, limit)) for k in keys])
        merged = sorted({m for page in results for m in page})[:limit]
        return [m.decode() for m in merged]

    # -- stream log -----------------------------------------------------------------
    def append_log(self, stream: str, records: Sequence[Record]) -> int:
        seq, ids, entries = self._log(stream)
        added = 0
        for start in range(0, len(records), _CHUNK):
            args: list[bytes | str | int] = []
            for r in records[start : start + _CHUNK]:
                args += [r.record_id, _frame([r.record_id, r.key, r.timestamp], r.value)]
            added += int(self._call(
                f"append_log of {stream!r}", [seq, ids, entries],
                partial(self._script, APPEND_LOG, [seq, ids, entries], args),
            ))
        return added

    def read_log(self, stream: str, after_seq: int, limit: int) -> list[tuple[int, Record]]:
        if limit <= 0:
            return []
        _seq, _ids, entries = self._log(stream)
        members = self._call(
            "read_log", [entries],
            lambda: self._r.zrangebyscore(entries, f"({after_seq}", "+inf", start=0, num=limit),
        )
        out = []
        for member in members:
            try:
                seq_s, _, raw = member.partition(b":")
                (record_id, key, ts), value = _unframe(raw)
                out.append((int(seq_s), Record(str(key), value, int(ts), str(record_id))))
            except (ValueError, TypeError) as exc:
                raise self._corrupt(entries, member[:40], f"log entry unreadable: {exc}") from None
        return out

    # -- watermarks -------------------------------------------------------------------
    def report_watermark(self, node: str, range_id: int, token: int, watermark: int) -> int:
        rk = self._range(node, range_id)
        detail = self._fenced(
            f"report_watermark of {node!r} range {range_id}", WATERMARK, node, range_id, token,
            [rk.wm], [int(watermark)], advances=False,
        )
        return int(detail)

    def read_watermarks(self, node: str) -> dict[int, int]:
        ranges = self._ranges(node)
        keys = [self._range(node, r).wm for r in ranges]
        values = self._pipeline("read_watermarks", [(k, "get", ()) for k in keys])
        out = {}
        for r, key, raw in zip(ranges, keys, values, strict=True):
            if raw is None:
                continue
            try:
                out[r] = int(raw)
            except ValueError:
                raise self._corrupt(key, None, f"not an integer watermark: {_show(raw)}") from None
        return out

    # -- metadata -----------------------------------------------------------------------
    def put_meta(self, name: str, value: bytes | None) -> None:
        key = self._meta()
        if value is None:
            self._call("put_meta", [key], lambda: self._write(key, "HDEL", key, name))
        else:
            self._call("put_meta", [key], lambda: self._write(key, "HSET", key, name, value))

    def get_meta(self, name: str) -> bytes | None:
        key = self._meta()
        raw = self._call("get_meta", [key], lambda: self._r.hget(key, name))
        return None if raw is None else bytes(raw)

    def list_meta(self, prefix: str) -> dict[str, bytes]:
        key = self._meta()
        items = self._call(
            "list_meta", [key],
            lambda: list(self._r.hscan_iter(key, match=_glob_escape(prefix) + "*", count=1000)),
        )
        found = {bytes(n).decode(): bytes(v) for n, v in items}
        return {n: found[n] for n in sorted(found) if n.startswith(prefix)}

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


def _timer_json(t: Timer) -> bytes:
    return json.dumps([t.key, t.tag, t.time, t.domain.value, int(t.hold)]).encode()


def _show(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return repr(text if len(text) <= 60 else text[:60] + "...")


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    return redact(url)
