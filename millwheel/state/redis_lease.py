"""The controller lease on Redis (see :mod:`millwheel.state.lease`), and the
epoch-fenced controller writes: Lua scripts on the ``mw:meta`` hash, so the lease,
the registry and the assignments share one key (one slot on a cluster) and every
check-and-write is one atomic script. Time is the server's ``TIME``: controllers on
different hosts need no synchronised clocks.

A range's token lives in the range's own slot. ``acquire(..., epoch=E)`` checks the
range's ``lepoch`` (the highest leader epoch that moved it) and, on a single node, the
lease itself, in one script. On a cluster the lease is in another slot: the epoch is
read first and ``lepoch`` checked in the script, so a deposed leader paused between
the two can still bump the token of a range the new leader has not moved yet. That
only fences the range's owner, whose next report makes the leader issue it a fresh
token (docs/redis.md); output stays exact because tokens, not leaders, guard data.

:class:`RedisLease` is a mixin of :class:`millwheel.state.redis_store.RedisStore`; no
redis-py import here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, TypeVar

from millwheel.state.lease import EPOCH, HOLDER, UNTIL, LeadershipLostError, Lease, check_ttl

T = TypeVar("T")

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local kind = redis.call('TYPE', KEYS[1]).ok
if kind ~= 'none' and kind ~= 'hash' then
  return redis.error_reply('MWCORRUPT ' .. KEYS[1] .. ' is not a hash')
end
local holder = redis.call('HGET', KEYS[1], '""" + HOLDER + """') or ''
local epoch = tonumber(redis.call('HGET', KEYS[1], '""" + EPOCH + """') or '0')
local untl = tonumber(redis.call('HGET', KEYS[1], '""" + UNTIL + """') or '0')
local function set(h, e, u)
  redis.call('HSET', KEYS[1], '""" + HOLDER + """', h, '""" + EPOCH + """', e, '""" + UNTIL + """', u)
end
"""

# ARGV: holder, ttl_ms -> epoch (0: held by another)
CLAIM = _NOW + """
if holder ~= ARGV[1] then
  if holder ~= '' and untl > now then return 0 end
  epoch = epoch + 1
end
set(ARGV[1], epoch, now + tonumber(ARGV[2]))
return epoch
"""

# ARGV: holder, epoch, ttl_ms -> 1 renewed, 0 lost
RENEW = _NOW + """
if holder ~= ARGV[1] or epoch ~= tonumber(ARGV[2]) then return 0 end
set(holder, epoch, now + tonumber(ARGV[3]))
return 1
"""

# ARGV: holder, epoch
RELEASE = _NOW + """
if holder == ARGV[1] and epoch == tonumber(ARGV[2]) then set(holder, epoch, 0) end
return 1
"""

READ = _NOW + """
return {holder, epoch, untl - now}
"""

# ARGV: epoch, name, value ('' + ARGV[4] == '1' means delete) -> {1, epoch} or {0, current}
PUT_META = _NOW + """
if epoch ~= tonumber(ARGV[1]) then return {0, epoch} end
if ARGV[4] == '1' then redis.call('HDEL', KEYS[1], ARGV[2])
else redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
return {1, epoch}
"""

# ARGV: epoch ('' for none: unfenced), then per entry: name, '1' delete or '0' set, value
# -> {1, epoch} or {0, current}. Every entry or, with a stale epoch, none (put_metas).
PUT_METAS = _NOW + """
if ARGV[1] ~= '' and epoch ~= tonumber(ARGV[1]) then return {0, epoch} end
for i = 2, #ARGV, 3 do
  if ARGV[i + 1] == '1' then redis.call('HDEL', KEYS[1], ARGV[i])
  else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2]) end
end
return {1, epoch}
"""

# KEYS: token, lepoch[, meta]; ARGV: epoch -> {1, token} or {0, current epoch}
ACQUIRE = """
local e = tonumber(ARGV[1])
if #KEYS == 3 then
  local cur = tonumber(redis.call('HGET', KEYS[3], '""" + EPOCH + """') or '0')
  if cur ~= e then return {0, cur} end
end
local floor = tonumber(redis.call('GET', KEYS[2]) or '0')
if floor > e then return {0, floor} end
if floor < e then redis.call('SET', KEYS[2], e) end
return {1, redis.call('INCR', KEYS[1])}
"""


class RedisLease:
    """Lease operations and epoch-fenced writes (a mixin of RedisStore)."""

    _cluster: bool | None
    _r: Any
    _meta: Callable[[], str]
    _call: Callable[..., Any]
    _script: Callable[[str, Sequence[str], Sequence[bytes | str | int]], Any]

    def _lease_script(self, what: str, source: str, args: Sequence[bytes | str | int]) -> Any:
        key = self._meta()
        return self._call(what, [key], lambda: self._script(source, [key], args))

    def claim_lease(self, holder: str, ttl_ms: int) -> int | None:
        check_ttl(ttl_ms)
        epoch = int(self._lease_script("claim_lease", CLAIM, [holder, ttl_ms]))
        return epoch or None

    def renew_lease(self, holder: str, epoch: int, ttl_ms: int) -> bool:
        check_ttl(ttl_ms)
        return bool(int(self._lease_script("renew_lease", RENEW, [holder, epoch, ttl_ms])))

    def release_lease(self, holder: str, epoch: int) -> None:
        self._lease_script("release_lease", RELEASE, [holder, epoch])

    def read_lease(self) -> Lease | None:
        holder, epoch, remaining = self._lease_script("read_lease", READ, [])
        if int(epoch) == 0:
            return None
        return Lease(bytes(holder).decode(), int(epoch), int(remaining))

    def _put_meta_fenced(self, name: str, value: bytes | None, epoch: int) -> None:
        args: list[bytes | str | int] = [epoch, name, value or b"", "1" if value is None else "0"]
        ok, current = self._lease_script("put_meta", PUT_META, args)
        if not int(ok):
            raise LeadershipLostError(f"put_meta {name[:100]!r}", epoch, int(current))

    def _put_metas(self, entries: Mapping[str, bytes | None], epoch: int | None) -> None:
        """Several entries of the ``meta`` hash in one script: atomic on a single node and
        on a cluster alike (one key, which holds the lease too), fenced when ``epoch``
        is given. A retry after a lost reply writes the same values again."""
        args: list[bytes | str | int] = ["" if epoch is None else epoch]
        for name, value in entries.items():
            args += [name, "1" if value is None else "0", value or b""]
        ok, current = self._lease_script("put_metas", PUT_METAS, args)
        if not int(ok):
            assert epoch is not None
            raise LeadershipLostError(f"put_metas of {len(entries)} entries", epoch, int(current))

    def _acquire_fenced(self, token_key: str, computation: str, range_id: int, epoch: int) -> int:
        _ = self._r  # decides single node or cluster on first use
        keys = [token_key, token_key[: -len("token")] + "lepoch"]
        if not self._cluster:
            keys.append(self._meta())
        else:  # the lease is in another slot: check it first, then the range's floor
            meta = self._meta()
            raw = self._call("acquire", [meta], lambda: self._r.hget(meta, EPOCH))
            current = int(raw or 0)
            if current != epoch:
                raise LeadershipLostError(f"acquire of {computation!r} range {range_id}", epoch, current)
        ok, value = self._call("acquire", keys, lambda: self._script(ACQUIRE, keys, [epoch]))
        if not int(ok):
            raise LeadershipLostError(f"acquire of {computation!r} range {range_id}", epoch, int(value))
        return int(value)
