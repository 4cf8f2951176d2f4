"""How the Redis store lays out its keys and frames its values (no redis-py here).

Used by :mod:`millwheel.state.redis_connection` (key names) and
:mod:`millwheel.state.redis_store` (the StateStore operations).

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
    mw:r:{C:R}:idgens   ZSET    generations of consumed record IDs, score = newest ID's
                                time (µs); expiry drops whole generations
    mw:r:{C:R}:ids:GEN  SET     the consumed record IDs of generation GEN
    mw:r:{C:R}:ids      ZSET    consumed IDs as versions before generations kept them
                                (score = time first consumed): read and expired only
    mw:r:{C:R}:wm       STRING  the range's reported low watermark
    mw:r:{C:R}:attempts HASH    item (record ID / timer identity) -> failed attempts
    mw:r:{C:R}:atterr   HASH    item -> JSON of its last error
    mw:r:{C:R}:errcount HASH    counter name -> count (dead_lettered, skipped, late_dropped, late:ACTION:STREAM)
    mw:r:{C:R}:errlog   LIST    JSON of the last given-up errors, newest first
    mw:r:{C:R}:bufs     SET     names of the range's window buffers
    mw:r:{C:R}:buf:NAME LIST    window buffer NAME: appended chunks, oldest first
    mw:ranges:{C}       SET     range IDs of C ever acquired (the range registry)
    mw:log:{S}:seq      STRING  stream log sequence counter of stream S
    mw:log:{S}:ids      HASH    record ID -> sequence number (idempotent append)
    mw:log:{S}:entries  ZSET    "SEQ:" + framed record, score = SEQ
    mw:log:{S}:start    STRING  SEQ through which retention removed the log (redis_log)
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
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from millwheel.record import Timer

_MAGIC = b"\xffMW1"
_FRAME = struct.Struct(">II")  # body length, CRC32 of body
_CHUNK = 1000  # fields per HMGET / ZMSCORE / script call


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


#: ``json.dumps(header, separators=(",", ":"))`` without building an encoder per call (it
#: did for every production framed: ~10% of a worker's CPU on Redis); the same bytes.
_COMPACT = json.JSONEncoder(separators=(",", ":")).encode


def _frame(header: Any, value: bytes) -> bytes:
    body = (b"null\n" if header is None else _COMPACT(header).encode() + b"\n") + value
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


def _timer_json(t: Timer) -> bytes:
    return json.dumps([t.key, t.tag, t.time, t.domain.value, int(t.hold)]).encode()


def _show(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return repr(text if len(text) <= 60 else text[:60] + "...")
