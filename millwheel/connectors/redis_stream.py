"""Redis Streams: a source reading a stream with XREAD, a sink appending with XADD.

Source: reads the entries after a checkpointed entry ID (``0-0`` at first), so a
restart resumes after the last entry the injector checkpointed; an entry without an
``id`` field gets the record ID ``redis:STREAM:ENTRY-ID``. Entries trimmed from the
stream (MAXLEN) before they were read are lost to it: keep the stream long enough.

Sink: one Lua script per batch (Redis runs it atomically, as MULTI/EXEC would) that
checks the sink's per-range position key ``millwheel:sink:NAME@STREAM:RANGE`` (a hash:
token, position) and refuses an older token, appends the entries past the stored
position and stores the new position. So a retry appends nothing twice and a zombie
appends nothing. Entries carry ``key``, ``value``, ``timestamp`` and ``id`` fields.
The position key and the stream share a hash tag only if the user gives one: on
Redis Cluster name the stream ``{tag}out`` and the sink keeps its key in that slot.
"""

from __future__ import annotations

from typing import Any, Sequence

from millwheel.connectors import Entry
from millwheel.errors import ConnectorError, FencedError
from millwheel.nodes import sink_node
from millwheel.record import Record
from millwheel.state.redis_connection import plain_client, redis_errors
from millwheel.state.url_display import redact


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class RedisStreamSource:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.url = settings["url"]
        self.stream = settings["stream"]
        self.until_end = settings.get("until") == "end"
        self.client: Any = None
        self.last = "0-0"
        self.end: str | None = None

    def open(self, position: str | None) -> None:
        self.client = plain_client(self.url)
        self.last = position or "0-0"
        if self.until_end:
            newest = self._call(lambda: self.client.xrevrange(self.stream, count=1))
            self.end = newest[0][0].decode() if newest else "0-0"

    def _call(self, fn: Any) -> Any:
        try:
            return fn()
        except redis_errors() as exc:
            raise ConnectorError(f"redis-stream source {redact(self.url)} stream {self.stream!r}: {exc}") from None

    def read_batch(self, max_records: int, wait_s: float) -> list[Entry]:
        if self.until_end and self.finished():
            return []
        block = max(1, int(wait_s * 1000)) if wait_s > 0 else None
        got = self._call(lambda: self.client.xread({self.stream: self.last}, count=max_records, block=block))
        entries: list[Entry] = []
        for _stream, items in got or []:
            for raw_id, fields in items:
                entry_id = raw_id.decode()
                if self.end is not None and _id_tuple(entry_id) > _id_tuple(self.end):
                    break
                entries.append(Entry(entry_id, {k.decode("utf-8", "replace"): v for k, v in fields.items()}))
        if entries:
            self.last = entries[-1].position
        return entries

    def record_id(self, entry: Entry) -> str:
        return f"redis:{self.stream}:{entry.position}"

    def finished(self) -> bool:
        return self.end is not None and _id_tuple(self.last) >= _id_tuple(self.end)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


# KEYS[1] position hash, KEYS[2] stream; ARGV: token, maxlen (0: none), then per entry
# position, key, value, timestamp, id. Returns the stored position, or -1 if fenced.
_WRITE = """
local stored = tonumber(redis.call('HGET', KEYS[1], 'token') or '0')
local token = tonumber(ARGV[1])
if stored > token then return -1 end
local pos = tonumber(redis.call('HGET', KEYS[1], 'position') or '0')
local maxlen = tonumber(ARGV[2])
local i = 3
while i <= #ARGV do
  local p = tonumber(ARGV[i])
  if p > pos then
    if maxlen > 0 then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*', 'key', ARGV[i+1], 'value', ARGV[i+2],
                 'timestamp', ARGV[i+3], 'id', ARGV[i+4])
    else
      redis.call('XADD', KEYS[2], '*', 'key', ARGV[i+1], 'value', ARGV[i+2], 'timestamp', ARGV[i+3], 'id', ARGV[i+4])
    end
    pos = p
  end
  i = i + 5
end
redis.call('HSET', KEYS[1], 'token', token, 'position', pos)
return pos
"""


class RedisStreamSink:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.url = settings["url"]
        self.stream = settings["redis_stream"]
        self.maxlen = int(settings.get("maxlen") or 0)
        self.client: Any = None
        self.key = ""
        self.sink, self.range_id = "", 0

    def _call(self, fn: Any) -> Any:
        try:
            return fn()
        except redis_errors() as exc:
            raise ConnectorError(f"redis-stream sink {redact(self.url)} stream {self.stream!r}: {exc}") from None

    def open(self, sink: str, range_id: int, token: int) -> int:
        self.client = plain_client(self.url)
        self.sink, self.range_id = sink, range_id
        self.key = f"millwheel:sink:{sink}@{self.stream}:{range_id}"
        return self.write_batch([], token)  # takes the sink over under this token

    def write_batch(self, records: Sequence[tuple[int, Record]], token: int) -> int:
        args: list[Any] = [token, self.maxlen]
        for pos, rec in records:
            args += [pos, rec.key, rec.value, rec.timestamp, rec.record_id]
        done = int(self._call(lambda: self.client.eval(_WRITE, 2, self.key, self.stream, *args)))
        if done < 0:
            raise FencedError(sink_node(self.sink), self.range_id, token, None)
        return done

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
