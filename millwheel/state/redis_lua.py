"""The Lua scripts of the Redis store: each fenced write is one of these.

A script runs atomically on the server, but Redis does not roll back a script that
fails half-way, so each script first checks the type of every key it will touch
(foreign data -> an ``MWCORRUPT key ...`` error before any write) and the sequencer
token, and only then writes. Kept apart from :mod:`millwheel.state.redis_store` so
the store module stays readable; no redis-py import here.
"""

from __future__ import annotations

# Shared prologue of fenced scripts. KEYS[1] = token, KEYS[2] = last; ARGV[1] =
# token, ARGV[2] = this write's ID, ARGV[3] = the ID the writer last applied ('' =
# unknown). Returns from the script early with {0, current} when fenced, {2, ''}
# when this write was already applied, {3, last} when writes were lost.
PROLOGUE = """
local function corrupt(key, what)
  return redis.error_reply('MWCORRUPT ' .. key .. ' ' .. what)
end
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= TYPES[i] then
    return corrupt(KEYS[i], 'has type ' .. t .. ', expected ' .. TYPES[i])
  end
end
local cur = redis.call('GET', KEYS[1])
local curn = 0
if cur then
  curn = tonumber(cur)
  if not curn or not string.match(cur, '^%d+$') then
    return corrupt(KEYS[1], 'is not an integer sequencer token')
  end
end
if curn <= 0 or curn ~= tonumber(ARGV[1]) then return {0, tostring(curn)} end
local last = redis.call('GET', KEYS[2])
if last == ARGV[2] then return {2, ''} end
if ARGV[3] ~= '' and last ~= ARGV[3] then return {3, last or ''} end
"""

# Bulk commands: one redis.call per up to 500 arguments instead of one per item (each
# redis.call costs the script a round through the command table, and the AOF one
# command); 500 keeps unpack() far below Lua's stack limit and pairs aligned. The
# result is that of the items one by one: HSET, HDEL, ZREM, LPUSH and ZADD [NX]
# take many fields and apply them in order. ``zadd`` adds ARGV[first], ARGV[first +
# step], ... with ``score``.
BULK = """
local function many(cmd, key, first, last)
  local i = first
  while i <= last do
    local stop = math.min(last, i + 499)
    redis.call(cmd, key, unpack(ARGV, i, stop))
    i = stop + 1
  end
end
local function zadd(key, nx, score, first, last, step)
  local i = first
  while i <= last do
    local t, n = {}, 0
    if nx then t[1] = 'NX'; n = 1 end
    local stop = math.min(last, i + step * 250 - 1)
    for x = i, stop, step do
      t[n + 1] = score
      t[n + 2] = ARGV[x]
      n = n + 2
    end
    redis.call('ZADD', key, unpack(t, 1, n))
    i = i + step * 250
  end
end
"""

# The writes of a checkpoint, shared by CHECKPOINT and the write group's script
# (millwheel.state.redis_group). ``k`` names the range's keys by role; the arguments
# start at ARGV[a]: now (µs), the ten counts, then the items (the consumed IDs after
# their generation), then the two counts of window-buffer appends and deletes and their
# items. Consumed IDs: ``k.ids`` is the range's ZSET of generations (score: the newest
# ID's time) and each generation's IDs a SET named from it, so expiry drops whole sets.
# Returns nothing.
APPLY_CHECKPOINT = BULK + """
local function apply_checkpoint(k, a)
  local nw, nd, nc, ns, np, ni = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]),
    tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local nr, nk, ne, keep = tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8]), tonumber(ARGV[a + 9]),
    tonumber(ARGV[a + 10])
  local i = a + 11
  many('HSET', k.state, i, i + 2 * nw - 1)
  zadd(k.skeys, false, 0, i, i + 2 * nw - 1, 2)
  i = i + 2 * nw
  many('HDEL', k.state, i, i + nd - 1)
  many('ZREM', k.skeys, i, i + nd - 1)
  i = i + nd
  many('HDEL', k.timers, i, i + nc - 1)
  many('ZREM', k.tkeys, i, i + nc - 1)
  i = i + nc
  many('HSET', k.timers, i, i + 2 * ns - 1)
  zadd(k.tkeys, false, 0, i, i + 2 * ns - 1, 2)
  i = i + 2 * ns
  for _ = 1, np do
    if redis.call('HSETNX', k.outbox, ARGV[i], ARGV[i + 1]) == 1 then
      redis.call('ZADD', k.oorder, redis.call('INCR', k.oseq), ARGV[i])
    end
    i = i + 2
  end
  if ni > 0 then  -- the IDs into their generation's set, the generation's time raised
    many('SADD', string.sub(k.ids, 1, -7) .. 'ids:' .. ARGV[i], i + 1, i + ni)
    redis.call('ZADD', k.ids, 'GT', ARGV[a], ARGV[i])
  end
  i = i + 1 + ni
  many('HDEL', k.attempts, i, i + nr - 1)
  many('HDEL', k.atterr, i, i + nr - 1)
  i = i + nr
  for _ = 1, nk do
    redis.call('HINCRBY', k.errcount, ARGV[i], ARGV[i + 1])
    i = i + 2
  end
  many('LPUSH', k.errlog, i, i + ne - 1)
  if ne > 0 then redis.call('LTRIM', k.errlog, 0, keep - 1) end
  i = i + ne
  local na, nx = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  if na == 0 and nx == 0 then return end
  local base = string.sub(k.state, 1, -6)
  for _ = 1, na do
    redis.call('RPUSH', base .. 'buf:' .. ARGV[i], ARGV[i + 1])
    redis.call('SADD', base .. 'bufs', ARGV[i])
    i = i + 2
  end
  for _ = 1, nx do
    redis.call('DEL', base .. 'buf:' .. ARGV[i])
    redis.call('SREM', base .. 'bufs', ARGV[i])
    i = i + 1
  end
end
-- The window-buffer keys a checkpoint at ARGV[a] touches are named from its range's
-- state key (same hash tag, so the same slot); checked before any write: the name of
-- the first one of a foreign type, or nil.
local function buffers_bad(state, a)
  local g = a + 11 + 2 * tonumber(ARGV[a + 1]) + tonumber(ARGV[a + 2]) + tonumber(ARGV[a + 3])
    + 2 * tonumber(ARGV[a + 4]) + 2 * tonumber(ARGV[a + 5])
  if tonumber(ARGV[a + 6]) > 0 then  -- the generation's set of consumed IDs
    local key = string.sub(state, 1, -6) .. 'ids:' .. ARGV[g]
    local t = redis.call('TYPE', key).ok
    if t ~= 'none' and t ~= 'set' then return key end
  end
  local i = g + 1 + tonumber(ARGV[a + 6])
    + tonumber(ARGV[a + 7]) + 2 * tonumber(ARGV[a + 8]) + tonumber(ARGV[a + 9])
  local na, nx = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  if na == 0 and nx == 0 then return nil end
  local base = string.sub(state, 1, -6)
  local t = redis.call('TYPE', base .. 'bufs').ok
  if t ~= 'none' and t ~= 'set' then return base .. 'bufs' end
  i = i + 2
  for j = 1, na + nx do
    local key = base .. 'buf:' .. ARGV[i]
    t = redis.call('TYPE', key).ok
    if t ~= 'none' and t ~= 'list' then return key end
    if j <= na then i = i + 2 else i = i + 1 end
  end
  return nil
end
"""

CHECKPOINT = """
local TYPES = {'string', 'string', 'hash', 'zset', 'hash', 'zset', 'hash', 'zset', 'string', 'zset',
  'hash', 'hash', 'hash', 'list'}
""" + PROLOGUE + APPLY_CHECKPOINT + """
local o = redis.call('GET', KEYS[9])
if o and not string.match(o, '^%d+$') then return corrupt(KEYS[9], 'is not an integer') end
local bad = buffers_bad(KEYS[3], 4)
if bad then return corrupt(bad, 'is not a window buffer or consumed-ID set (a list, a set)') end
apply_checkpoint({state = KEYS[3], skeys = KEYS[4], timers = KEYS[5], tkeys = KEYS[6],
  outbox = KEYS[7], oorder = KEYS[8], oseq = KEYS[9], ids = KEYS[10], attempts = KEYS[11],
  atterr = KEYS[12], errcount = KEYS[13], errlog = KEYS[14]}, 4)
redis.call('SET', KEYS[2], ARGV[2])
return {1, ''}
"""

# One more failed attempt of an item (KEYS[3] counts, KEYS[4] last errors; ARGV[4]
# the item, ARGV[5] its error). A retry of an applied bump returns {2, ''}: no double count.
BUMP_ATTEMPTS = """
local TYPES = {'string', 'string', 'hash', 'hash'}
""" + PROLOGUE + """
local n = redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
redis.call('SET', KEYS[2], ARGV[2])
return {1, tostring(n)}
"""

# Shared like APPLY_CHECKPOINT: delete the outbox fields ARGV[first..last].
APPLY_ACK = """
local function apply_ack(outbox, oorder, first, last)
  many('HDEL', outbox, first, last)
  many('ZREM', oorder, first, last)
end
"""

ACK = """
local TYPES = {'string', 'string', 'hash', 'zset'}
""" + PROLOGUE + BULK + APPLY_ACK + """
apply_ack(KEYS[3], KEYS[4], 4, #ARGV)
redis.call('SET', KEYS[2], ARGV[2])
return {1, ''}
"""

# Forget every generation of consumed IDs whose newest is older than ARGV[4] (KEYS[3]
# the generations, KEYS[4] the single ZSET of IDs written before generations existed):
# UNLINK frees a generation's set off the main thread. Returns {1, IDs forgotten}.
EXPIRE = """
local TYPES = {'string', 'string', 'zset', 'zset'}
""" + PROLOGUE + """
local base = string.sub(KEYS[3], 1, -7) .. 'ids:'
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[4])
for _, gen in ipairs(due) do
  local t = redis.call('TYPE', base .. gen).ok
  if t ~= 'none' and t ~= 'set' then return corrupt(base .. gen, 'has type ' .. t .. ', expected set') end
end
local n = redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. ARGV[4])
for _, gen in ipairs(due) do
  n = n + redis.call('SCARD', base .. gen)
  redis.call('UNLINK', base .. gen)
  redis.call('ZREM', KEYS[3], gen)
end
return {1, tostring(n)}
"""

# Watermarks are compared as decimal strings: Lua numbers are doubles, timestamps
# up to 2^62 are not all exact in them. ``watermark_bad`` is the check made before any
# write; ``raise_watermark`` stores ``value`` unless the stored one is higher and
# returns what is stored.
APPLY_WATERMARK = """
local function less(a, b)
  local na, nb = string.sub(a, 1, 1) == '-', string.sub(b, 1, 1) == '-'
  if na ~= nb then return na end
  if na then a, b = string.sub(b, 2), string.sub(a, 2) end
  if #a ~= #b then return #a < #b end
  return a < b
end
local function watermark_bad(key)
  local stored = redis.call('GET', key)
  return stored and not string.match(stored, '^-?%d+$')
end
local function raise_watermark(key, value)
  local stored = redis.call('GET', key)
  if not stored or less(stored, value) then
    redis.call('SET', key, value)
    stored = value
  end
  return stored
end
"""

WATERMARK = """
local TYPES = {'string', 'string', 'string'}
""" + PROLOGUE + APPLY_WATERMARK + """
if watermark_bad(KEYS[3]) then return corrupt(KEYS[3], 'is not an integer watermark') end
return {1, raise_watermark(KEYS[3], ARGV[4])}
"""

# Appends the records ARGV[first..last] (pairs: record ID, framed record) not yet in
# the log; returns how many were new. Idempotent by record ID.
APPLY_APPEND = """
local function apply_append(seq, ids, entries, first, last)
  local n = 0
  for i = first, last, 2 do
    if redis.call('HEXISTS', ids, ARGV[i]) == 0 then
      local s = redis.call('INCR', seq)
      redis.call('HSET', ids, ARGV[i], s)
      redis.call('ZADD', entries, s, s .. ':' .. ARGV[i + 1])
      n = n + 1
    end
  end
  return n
end
"""

APPEND_LOG = """
local TYPES = {'string', 'hash', 'zset'}
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= TYPES[i] then
    return redis.error_reply('MWCORRUPT ' .. KEYS[i] .. ' has type ' .. t .. ', expected ' .. TYPES[i])
  end
end
""" + APPLY_APPEND + """
return apply_append(KEYS[1], KEYS[2], KEYS[3], 1, #ARGV)
"""

# Retention's measure of a log (millwheel.runtime.retention): KEYS[1] entries; ARGV[1]
# after this sequence number, ARGV[2] at most this many entries. Returns {entries,
# bytes (member sizes), last sequence number (as text: exact)}.
LOG_STATS = """
local t = redis.call('TYPE', KEYS[1]).ok
if t ~= 'none' and t ~= 'zset' then
  return redis.error_reply('MWCORRUPT ' .. KEYS[1] .. ' has type ' .. t .. ', expected zset')
end
local m = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf', 'LIMIT', 0, ARGV[2])
local bytes = 0
for i = 1, #m do bytes = bytes + #m[i] end
local last = ARGV[1]
if #m > 0 then last = string.match(m[#m], '^(%d+):') or ARGV[1] end
return {#m, bytes, last}
"""

# Remove a log's entries through ARGV[1] (the last of those read), forget their record
# IDs (ARGV[2..]: pairs of record ID, sequence number; only where the ID still maps to
# that entry) and raise the start (KEYS: ids, entries, start). Returns how many entries
# were removed.
TRIM_LOG = """
local TYPES = {'hash', 'zset', 'string'}
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= TYPES[i] then
    return redis.error_reply('MWCORRUPT ' .. KEYS[i] .. ' has type ' .. t .. ', expected ' .. TYPES[i])
  end
end
local start = redis.call('GET', KEYS[3])
if start and not string.match(start, '^%d+$') then
  return redis.error_reply('MWCORRUPT ' .. KEYS[3] .. ' is not an integer log start')
end
local n = redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then redis.call('HDEL', KEYS[1], ARGV[i]) end
end
if not start or tonumber(start) < tonumber(ARGV[1]) then redis.call('SET', KEYS[3], ARGV[1]) end
return n
"""
