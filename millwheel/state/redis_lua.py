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

CHECKPOINT = """
local TYPES = {'string', 'string', 'hash', 'zset', 'hash', 'zset', 'hash', 'zset', 'string', 'zset',
  'hash', 'hash', 'hash', 'list'}
""" + PROLOGUE + """
local o = redis.call('GET', KEYS[9])
if o and not string.match(o, '^%d+$') then return corrupt(KEYS[9], 'is not an integer') end
local nw, nd, nc, ns, np, ni = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]),
  tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local nr, nk, ne, keep = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local i = 15
for _ = 1, nw do
  redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[4], 0, ARGV[i])
  i = i + 2
end
for _ = 1, nd do
  redis.call('HDEL', KEYS[3], ARGV[i])
  redis.call('ZREM', KEYS[4], ARGV[i])
  i = i + 1
end
for _ = 1, nc do
  redis.call('HDEL', KEYS[5], ARGV[i])
  redis.call('ZREM', KEYS[6], ARGV[i])
  i = i + 1
end
for _ = 1, ns do
  redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[6], 0, ARGV[i])
  i = i + 2
end
for _ = 1, np do
  if redis.call('HSETNX', KEYS[7], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('ZADD', KEYS[8], redis.call('INCR', KEYS[9]), ARGV[i])
  end
  i = i + 2
end
for _ = 1, ni do
  redis.call('ZADD', KEYS[10], 'NX', ARGV[4], ARGV[i])
  i = i + 1
end
for _ = 1, nr do
  redis.call('HDEL', KEYS[11], ARGV[i])
  redis.call('HDEL', KEYS[12], ARGV[i])
  i = i + 1
end
for _ = 1, nk do
  redis.call('HINCRBY', KEYS[13], ARGV[i], ARGV[i + 1])
  i = i + 2
end
for _ = 1, ne do
  redis.call('LPUSH', KEYS[14], ARGV[i])
  i = i + 1
end
if ne > 0 then redis.call('LTRIM', KEYS[14], 0, keep - 1) end
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

ACK = """
local TYPES = {'string', 'string', 'hash', 'zset'}
""" + PROLOGUE + """
for i = 4, #ARGV do
  redis.call('HDEL', KEYS[3], ARGV[i])
  redis.call('ZREM', KEYS[4], ARGV[i])
end
redis.call('SET', KEYS[2], ARGV[2])
return {1, ''}
"""

EXPIRE = """
local TYPES = {'string', 'string', 'zset'}
""" + PROLOGUE + """
return {1, tostring(redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[4]))}
"""

# Watermarks are compared as decimal strings: Lua numbers are doubles, timestamps
# up to 2^62 are not all exact in them.
WATERMARK = """
local TYPES = {'string', 'string', 'string'}
""" + PROLOGUE + """
local function less(a, b)
  local na, nb = string.sub(a, 1, 1) == '-', string.sub(b, 1, 1) == '-'
  if na ~= nb then return na end
  if na then a, b = string.sub(b, 2), string.sub(a, 2) end
  if #a ~= #b then return #a < #b end
  return a < b
end
local stored = redis.call('GET', KEYS[3])
if stored and not string.match(stored, '^-?%d+$') then
  return corrupt(KEYS[3], 'is not an integer watermark')
end
if not stored or less(stored, ARGV[4]) then
  redis.call('SET', KEYS[3], ARGV[4])
  stored = ARGV[4]
end
return {1, stored}
"""

APPEND_LOG = """
local TYPES = {'string', 'hash', 'zset'}
for i = 1, #KEYS do
  local t = redis.call('TYPE', KEYS[i]).ok
  if t ~= 'none' and t ~= TYPES[i] then
    return redis.error_reply('MWCORRUPT ' .. KEYS[i] .. ' has type ' .. t .. ', expected ' .. TYPES[i])
  end
end
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 then
    local seq = redis.call('INCR', KEYS[1])
    redis.call('HSET', KEYS[2], ARGV[i], seq)
    redis.call('ZADD', KEYS[3], seq, seq .. ':' .. ARGV[i + 1])
    n = n + 1
  end
end
return n
"""
