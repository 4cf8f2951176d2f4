"""The production store: Redis, with one Lua script per checkpoint.

Same contract as the SQLite store (:mod:`millwheel.state.protocol`). The store is
split by concern: :class:`RedisStore` here holds the StateStore operations (ownership,
checkpoint, reads, watermarks, metadata); :mod:`millwheel.state.redis_log` the stream
log and its retention; its base
:class:`~millwheel.state.redis_connection.RedisConnection` (the only module that
imports redis-py) parses the URL, picks the client, retries, runs scripts and fenced
writes; :mod:`millwheel.state.redis_keys` documents the key layout and frames values;
:mod:`millwheel.state.redis_cluster` is what differs on Redis Cluster;
:mod:`millwheel.state.redis_lua` holds the scripts; :mod:`millwheel.state.redis_group`
holds the write group (a local runner step's writes in one script).
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Iterable, Iterator, Mapping, Sequence

from millwheel.record import Record, TimeDomain, Timer
from millwheel.state.lease import check_meta_name
from millwheel.state.protocol import ID_PAGE, RECENT_ERRORS, Checkpoint, ErrorReport, Production
from millwheel.state.redis_group import checkpoint_args
from millwheel.state.redis_keys import _CHUNK, _field, _glob_escape, _show, _unframe
from millwheel.state.redis_lease import RedisLease
from millwheel.state.redis_log import RedisLog
from millwheel.state.redis_lua import ACK, BUMP_ATTEMPTS, CHECKPOINT, EXPIRE, WATERMARK


class RedisStore(RedisLease, RedisLog):
    """A :class:`~millwheel.state.protocol.StateStore` on Redis (see the module docstring)."""

    # -- ownership ----------------------------------------------------------------
    def acquire(self, computation: str, range_id: int, epoch: int | None = None) -> int:
        """Register the range, then INCR its token (one atomic bump: a retry after a lost
        reply bumps once more, which only fences harder). With ``epoch``, the bump is a
        script checking the leader epoch (millwheel.state.redis_lease)."""
        rk = self._range(computation, range_id)
        registry = self._registry(computation)
        if epoch is not None:
            token = self._acquire_fenced(rk.token, computation, range_id, epoch)
            self._call("acquire", [registry], lambda: self._write(registry, "SADD", registry, range_id))
            return token
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
        """One EVALSHA: check the token, then state, timers, outbox, IDs; all or nothing.
        Inside a write group: held, and applied with the group (redis_group)."""
        args = checkpoint_args(cp)
        what = f"checkpoint of {cp.computation!r} range {cp.range_id}"
        if self._holding():
            assert self._held is not None
            self._held.add("c", what, cp.computation, cp.range_id, cp.token, args)
            return
        rk = self._range(cp.computation, cp.range_id)
        self._fenced(
            what, CHECKPOINT, cp.computation, cp.range_id, cp.token,
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
        what = f"ack of {producer!r} range {range_id}"
        fields = [_field(c, r) for c, r in acked]
        if self._holding():
            assert self._held is not None
            self._held.add("a", what, producer, range_id, token, fields)
            return
        rk = self._range(producer, range_id)
        self._fenced(what, ACK, producer, range_id, token, [rk.outbox, rk.oorder], fields)

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

    @staticmethod
    def _base(rk: Any) -> str:
        """The range's key prefix (``mw:r:{C:R}:``), for the keys named from it: window
        buffers, consumed-ID generation sets, the pre-generation ID ZSET."""
        return str(rk.state)[: -len("state")]

    def _legacy_ids(self, rk: Any) -> str:
        """The ZSET of consumed IDs written before generations (read and expired only)."""
        return self._base(rk) + "ids"

    def contains_ids(self, computation: str, range_id: int, ids: Sequence[str]) -> set[str]:
        """Two round trips: the live generations, then one SMISMEMBER per generation and
        chunk (and the pre-generation ZSET) pipelined. Runs for Bloom filter hits only."""
        rk = self._range(computation, range_id)
        gens = self._call("contains_ids", [rk.ids], partial(self._r.zrange, rk.ids, 0, -1))
        base = self._base(rk) + "ids:"
        chunks = [list(ids[s : s + _CHUNK]) for s in range(0, len(ids), _CHUNK)]
        calls: list[tuple[str, str, tuple[Any, ...]]] = [
            (self._legacy_ids(rk), "zmscore", (c,)) for c in chunks
        ]
        calls += [(base + g.decode(), "smismember", (c,)) for g in gens for c in chunks]
        results = self._pipeline("contains_ids", calls)
        found: set[str] = set()
        for (_key, cmd, (chunk,)), answer in zip(calls, results, strict=True):
            found.update(i for i, hit in zip(chunk, answer, strict=True)
                         if (hit is not None if cmd == "zmscore" else hit == 1))
        return found

    def iter_ids(self, computation: str, range_id: int) -> Iterator[str]:
        for _gen, page in self.iter_id_generations(computation, range_id):
            yield from page

    def iter_id_generations(self, computation: str, range_id: int) -> Iterator[tuple[int | None, list[str]]]:
        # Each generation's set by SSCAN, :data:`ID_PAGE` at a time (only the owner
        # changes the sets and not while it iterates), then the pre-generation ZSET by
        # rank (generation None). An ID consumed in two generations comes once per generation.
        rk = self._range(computation, range_id)
        base = self._base(rk) + "ids:"
        for gen in self.id_generations(computation, range_id):
            key = base + str(gen)
            cursor = 0
            while True:
                cursor, page = self._call(
                    "iter_ids", [key], partial(self._r.sscan, key, cursor, count=ID_PAGE))
                if page:
                    yield gen, [m.decode() for m in page]
                if not cursor:
                    break
        legacy = self._legacy_ids(rk)
        start = 0
        while True:
            page = self._call("iter_ids", [legacy], partial(self._r.zrange, legacy, start, start + ID_PAGE - 1))
            if page:
                yield None, [m.decode() for m in page]
            if len(page) < ID_PAGE:
                return
            start += ID_PAGE

    def id_generations(self, computation: str, range_id: int) -> list[int]:
        rk = self._range(computation, range_id)
        gens = self._call("id_generations", [rk.ids], partial(self._r.zrange, rk.ids, 0, -1))
        return sorted(int(g) for g in gens)

    def expire_ids(self, computation: str, range_id: int, token: int, older_than_us: int) -> int:
        rk = self._range(computation, range_id)
        detail = self._fenced(
            f"expire_ids of {computation!r} range {range_id}", EXPIRE, computation, range_id,
            token, [rk.ids, self._legacy_ids(rk)], [older_than_us], advances=False,
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

    # -- window buffers (written by checkpoints, see redis_lua) ----------------------
    def _buffer_base(self, computation: str, range_id: int) -> str:
        return self._base(self._range(computation, range_id))

    def read_buffer(self, computation: str, range_id: int, name: str) -> list[bytes]:
        """The list's entries, :data:`_CHUNK` per LRANGE (the range's owner is the only
        writer, and it does not append while it reads)."""
        key = self._buffer_base(computation, range_id) + "buf:" + name
        out: list[bytes] = []
        while True:
            start = len(out)
            page = self._call("read_buffer", [key],
                              partial(self._r.lrange, key, start, start + _CHUNK - 1))
            out += (bytes(p) for p in page)
            if len(page) < _CHUNK:
                return out

    def list_buffers(self, computation: str, range_id: int) -> list[str]:
        key = self._buffer_base(computation, range_id) + "bufs"
        members = self._call("list_buffers", [key], lambda: self._r.smembers(key))
        return sorted(bytes(m).decode() for m in members)

    # -- watermarks -------------------------------------------------------------------
    def report_watermark(self, node: str, range_id: int, token: int, watermark: int) -> int:
        """The stored watermark (inside a write group: ``watermark``, not known yet)."""
        what = f"report_watermark of {node!r} range {range_id}"
        if self._holding():
            assert self._held is not None
            self._held.add("w", what, node, range_id, token, [int(watermark)])
            return int(watermark)
        rk = self._range(node, range_id)
        detail = self._fenced(what, WATERMARK, node, range_id, token, [rk.wm], [int(watermark)], advances=False)
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
    def put_meta(self, name: str, value: bytes | None, epoch: int | None = None) -> None:
        check_meta_name(name)
        if epoch is not None:
            self._put_meta_fenced(name, value, epoch)
            return
        key = self._meta()
        if value is None:
            self._call("put_meta", [key], lambda: self._write(key, "HDEL", key, name))
        else:
            self._call("put_meta", [key], lambda: self._write(key, "HSET", key, name, value))

    def put_metas(self, entries: Mapping[str, bytes | None], epoch: int | None = None) -> None:
        """One script on the ``meta`` hash (millwheel.state.redis_lease): all or nothing."""
        for name in entries:
            check_meta_name(name)
        if entries or epoch is not None:
            self._put_metas(entries, epoch)

    def insert_meta(self, name: str, value: bytes) -> bool:
        check_meta_name(name)
        key = self._meta()
        if int(self._call("insert_meta", [key], lambda: self._write(key, "HSETNX", key, name, value))):
            return True
        # taken: by another caller, or by this very call whose reply was lost and retried
        return self.get_meta(name) == value

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
