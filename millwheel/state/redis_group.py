"""A write group on Redis: the local runner's writes of one step in one Lua script.

The local runner holds a step's store writes and applies them at its end inside the
store's ``write_group`` (:mod:`millwheel.runtime.grouped`). On SQLite that is one
transaction. Here, inside :meth:`RedisGrouping.write_group`, the fenced writes
(``checkpoint``, ``ack``, ``report_watermark``) and ``append_log`` are encoded as they
are called and kept; at the end of the block they go to Redis as **one** EVALSHA of
:data:`GROUP`, which

1. checks the type of every key the group touches, that each range's outbox counter
   and watermark are integers, and the token of every fenced write (in the writes'
   order); then that no range's ``:last`` already holds this group's ID (a retry
   after a lost reply: nothing is applied twice) and that each range's ``:last`` is
   the write this store last applied there (else Redis lost acknowledged writes);
2. only then applies every write, in the order the runner made them, with the same
   Lua as the single-write scripts (:mod:`millwheel.state.redis_lua`);
3. stores the group's ID in ``:last`` of every range a checkpoint or ack advanced.

A Lua script runs atomically and step 2 starts only once nothing can refuse a write,
so the group is applied whole or not at all; a refused token refuses the whole group
(:class:`~millwheel.errors.FencedError` of the first refused write). All or nothing is
required, not a nicety: the grouped runner drops outbox entries that a checkpoint
writes and a later ack of the same group deletes (``GroupedStore._cancel_acked``). A
pipeline of EVALSHAs, or a script that applied the writes before the first refused
one, could leave the producer's checkpoint (its inputs consumed, its outbox entry
dropped) without the consumer's checkpoint that took the entry: records lost. Redis
writes a script's effects to the AOF as one MULTI/EXEC, which a truncated AOF loads
whole or not at all, so a Redis crash keeps the all-or-nothing too.

Replies stay idempotent as for single writes (:mod:`millwheel.state.redis_connection`):
a retry after a lost reply finds the group's ID in ``:last`` and applies nothing; the
log appends are idempotent by record ID and a watermark only rises, so a group with
neither checkpoint nor ack may simply run again.

Only on one Redis node: on Redis Cluster a range's keys live in their own slot and one
script cannot reach several, so ``write_group`` is None there and the runner writes at
once, one script per write, as before.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, Sequence

from millwheel.errors import FencedError, StoreError
from millwheel.state.protocol import RECENT_ERRORS, Checkpoint
from millwheel.state.redis_connection import LostWritesError, RedisConnection
from millwheel.state.redis_keys import _field, _frame, _timer_json
from millwheel.state.redis_lua import APPLY_ACK, APPLY_APPEND, APPLY_CHECKPOINT, APPLY_WATERMARK

# KEYS: NB range blocks of 15 keys (_RangeKeys order), then NL log blocks of 3.
# ARGV[1] group ID, ARGV[2] NB, ARGV[3] NL; per range block: the ID this store last
# applied there ('' unknown), '1' if a checkpoint or ack of the group advances it; then
# each write: kind (c checkpoint, a ack, w watermark, l log append), block, token,
# number of arguments, the arguments. Returns {1, ''} applied, {2, ''} applied before,
# {0, write number, current token} refused, {3, block, :last} writes lost.
GROUP = """
local function corrupt(key, what)
  return redis.error_reply('MWCORRUPT ' .. key .. ' ' .. what)
end
local RT = {'string', 'string', 'hash', 'zset', 'hash', 'zset', 'hash', 'zset', 'string', 'zset',
  'string', 'hash', 'hash', 'hash', 'list'}
local LT = {'string', 'hash', 'zset'}
""" + APPLY_CHECKPOINT + APPLY_ACK + APPLY_WATERMARK + APPLY_APPEND + """
local gid, nb, nl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for b = 0, nb - 1 do
  for j = 1, 15 do
    local key = KEYS[b * 15 + j]
    local t = redis.call('TYPE', key).ok
    if t ~= 'none' and t ~= RT[j] then return corrupt(key, 'has type ' .. t .. ', expected ' .. RT[j]) end
  end
  local o = redis.call('GET', KEYS[b * 15 + 9])
  if o and not string.match(o, '^%d+$') then return corrupt(KEYS[b * 15 + 9], 'is not an integer') end
  if watermark_bad(KEYS[b * 15 + 11]) then
    return corrupt(KEYS[b * 15 + 11], 'is not an integer watermark')
  end
end
for l = 0, nl - 1 do
  for j = 1, 3 do
    local key = KEYS[nb * 15 + l * 3 + j]
    local t = redis.call('TYPE', key).ok
    if t ~= 'none' and t ~= LT[j] then return corrupt(key, 'has type ' .. t .. ', expected ' .. LT[j]) end
  end
end
local first = 4 + 2 * nb
local cur = {}
local a, n = first, 0
while a <= #ARGV do
  n = n + 1
  local b = tonumber(ARGV[a + 1])
  if ARGV[a] ~= 'l' then
    local c = cur[b]
    if c == nil then
      local key = KEYS[(b - 1) * 15 + 1]
      local raw = redis.call('GET', key)
      c = 0
      if raw then
        c = tonumber(raw)
        if not c or not string.match(raw, '^%d+$') then return corrupt(key, 'is not an integer sequencer token') end
      end
      cur[b] = c
    end
    if c <= 0 or c ~= tonumber(ARGV[a + 2]) then return {0, n, tostring(c)} end
  end
  a = a + 4 + tonumber(ARGV[a + 3])
end
local last = {}
for b = 1, nb do
  last[b] = redis.call('GET', KEYS[(b - 1) * 15 + 2])
  if ARGV[3 + 2 * b] == '1' and last[b] == gid then return {2, ''} end
end
for b = 1, nb do
  local expected = ARGV[2 + 2 * b]
  if expected ~= '' and last[b] ~= expected then return {3, b, last[b] or ''} end
end
a = first
while a <= #ARGV do
  if ARGV[a] == 'c' then
    local bad = buffers_bad(KEYS[(tonumber(ARGV[a + 1]) - 1) * 15 + 3], a + 4)
    if bad then return corrupt(bad, 'is not a window buffer or consumed-ID set (a list, a set)') end
  end
  a = a + 4 + tonumber(ARGV[a + 3])
end
local roles = {}
a = first
while a <= #ARGV do
  local kind, b, m = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
  local base = (b - 1) * 15
  if kind == 'c' then
    local k = roles[b]
    if k == nil then
      k = {state = KEYS[base + 3], skeys = KEYS[base + 4], timers = KEYS[base + 5],
        tkeys = KEYS[base + 6], outbox = KEYS[base + 7], oorder = KEYS[base + 8], oseq = KEYS[base + 9],
        ids = KEYS[base + 10], attempts = KEYS[base + 12], atterr = KEYS[base + 13],
        errcount = KEYS[base + 14], errlog = KEYS[base + 15]}
      roles[b] = k
    end
    apply_checkpoint(k, a + 4)
  elseif kind == 'a' then
    apply_ack(KEYS[base + 7], KEYS[base + 8], a + 4, a + 3 + m)
  elseif kind == 'w' then
    raise_watermark(KEYS[base + 11], ARGV[a + 4])
  else
    local lb = nb * 15 + (b - 1) * 3
    apply_append(KEYS[lb + 1], KEYS[lb + 2], KEYS[lb + 3], a + 4, a + 3 + m)
  end
  a = a + 4 + m
end
for b = 1, nb do
  if ARGV[3 + 2 * b] == '1' then redis.call('SET', KEYS[(b - 1) * 15 + 2], gid) end
end
return {1, ''}
"""


def checkpoint_args(cp: Checkpoint) -> list[bytes | str | int]:
    """The arguments of a checkpoint after the prologue's (now, ten counts, items), as
    ``apply_checkpoint`` in :mod:`millwheel.state.redis_lua` reads them."""
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
    args.append(cp.now_us if cp.ids_generation is None else cp.ids_generation)
    args += cp.consumed_ids
    args += cp.resolved
    for name, n in cp.counters.items():
        args += [name, int(n)]
    args += cp.errors
    args += [len(cp.buffer_appends), len(cp.buffer_deletes)]
    for name, data in cp.buffer_appends:
        args += [name, data]
    args += cp.buffer_deletes
    return args


class _Group:
    """The encoded writes of one open group, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.ranges: dict[tuple[str, int], int] = {}  # (computation, range) -> block, from 1
        self.tokens: list[int] = []  # per block: the token its lineage is kept under
        self.advances: list[bool] = []
        self.logs: dict[str, int] = {}  # stream -> log block, from 1
        self.writes: list[tuple[str, str, int, int]] = []  # what, computation, range, token
        self.args: list[bytes | str | int] = []

    def add(self, kind: str, what: str, computation: str, range_id: int, token: int,
            args: Sequence[bytes | str | int]) -> None:
        block = self.ranges.get((computation, range_id))
        if block is None:
            block = self.ranges[(computation, range_id)] = len(self.ranges) + 1
            self.tokens.append(token)
            self.advances.append(False)
        if kind in ("c", "a"):
            self.advances[block - 1] = True
        self.writes.append((what, computation, range_id, token))
        self.args += [kind, block, token, len(args)]
        self.args += args

    def add_log(self, stream: str, args: Sequence[bytes | str | int]) -> None:
        block = self.logs.setdefault(stream, len(self.logs) + 1)
        self.writes.append((f"append_log of {stream!r}", "", 0, 0))
        self.args += ["l", block, 0, len(args)]
        self.args += args


class RedisGrouping(RedisConnection):
    """The write group of :class:`~millwheel.state.redis_store.RedisStore` (see the
    module docstring). Writes of other threads than the group's are not held."""

    _held: _Group | None = None
    _held_by = 0

    @property
    def write_group(self) -> Callable[[], ContextManager[None]] | None:
        """The group on one Redis node; None on a cluster (asks the server on first use)."""
        if self._call("detect cluster", [], lambda: self._r is not None and self._cluster):
            return None
        return self._write_group

    @contextmanager
    def _write_group(self) -> Iterator[None]:
        if self._holding():  # nested: part of the open group
            yield
            return
        self._held, self._held_by = _Group(), threading.get_ident()
        try:
            yield
        except BaseException:
            self._held = None  # nothing was sent: none applied
            raise
        group, self._held = self._held, None
        if group.writes:
            self._apply_group(group)

    def _holding(self) -> bool:
        return self._held is not None and self._held_by == threading.get_ident()

    def _fenced(self, what: str, *args: Any, **kwargs: Any) -> bytes:
        """A single fenced write; refused inside a group (applied now, it would come
        before the group's held writes: bump_attempts, expire_ids)."""
        if self._holding():
            raise StoreError(f"{self._where}: {what}: not allowed inside a write group")
        return super()._fenced(what, *args, **kwargs)

    def _apply_group(self, group: _Group) -> None:
        """One EVALSHA of :data:`GROUP`; raise as the first refused write would."""
        gid = os.urandom(8).hex()  # as secrets.token_hex(8), without its layers
        keys: list[str] = []
        head: list[bytes | str | int] = [gid, len(group.ranges), len(group.logs)]
        lineages: list[tuple[str, int, int]] = []
        for ((computation, range_id), token, advances) in zip(group.ranges, group.tokens, group.advances,
                                                              strict=True):
            keys += vars(self._range(computation, range_id)).values()
            lineage = (computation, range_id, token)
            lineages.append(lineage)
            head += [self._last_applied.get(lineage, "") if self._verify_lineage else "", "1" if advances else "0"]
        for stream in group.logs:
            keys += self._log(stream)
        what = f"write group of {len(group.writes)} writes"
        argv = head + group.args
        try:
            reply = self._call(what, keys, lambda: self._script(GROUP, keys, argv))
        except StoreError:
            for lineage in lineages:  # applied or not is unknown now: stop expecting a lineage
                self._last_applied.pop(lineage, None)
            raise
        status = int(reply[0])
        if status == 0:
            write, current = int(reply[1]), int(reply[2])
            _what, computation, range_id, token = group.writes[write - 1]
            raise FencedError(computation, range_id, token, current)
        if status == 3:
            computation, range_id, _token = lineages[int(reply[1]) - 1]
            raise LostWritesError(
                f"{self._where}: {what}: Redis lost acknowledged writes of {computation!r} range "
                f"{range_id} (last write applied by this worker was {head[1 + 2 * int(reply[1])]!s}, "
                f"Redis has {bytes(reply[2]).decode() or 'none'}); Redis restarted without an "
                "fsynced AOF? Restart the workers so they recover from what Redis holds"
            )
        for lineage, advances in zip(lineages, group.advances, strict=True):
            if advances:
                self._last_applied[lineage] = gid
