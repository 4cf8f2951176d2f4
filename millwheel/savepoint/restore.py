"""Checking a savepoint's frames, then writing them into a store (the store protocol only).

A restore reads a file it did not write, so nothing in it is trusted: after
:func:`millwheel.savepoint.format.verify` has checked the checksum, :func:`check`
parses every frame (types, sizes, timestamps, that each names a node and range of the
registry the file carries, consumers that exist) without writing anything; only then
does :func:`apply` write, the same parse again, frame by frame. The registry itself
is admitted by the caller (services/controller/savepoint.py) as a registration is.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import IO, Any, Callable

from millwheel import late
from millwheel.errors import CorruptDataError
from millwheel.limits import MAX_NAME_CHARS
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record, TimeDomain, Timer
from millwheel.state.protocol import Checkpoint, Production, StateStore

from .format import SavepointFileError, numbered_frames
from .logmap import LogMap, save

MAX_TEXT = 64 * 1024  #: a key, tag or record ID in a savepoint
MAX_ATTEMPTS = 10_000  #: a restored attempt count (bump_attempts is called that often)
WRITE_CHUNK = 2000  #: items per checkpoint when writing
COUNTERS = ("dead_lettered", "skipped", "late_dropped")  #: and the late counts per input (millwheel.late)


@dataclass
class Summary:
    """What :func:`check` found: counts per frame type, the ranges present, the streams'
    source positions ``stream -> (start, last, count)``."""

    counts: dict[str, int] = field(default_factory=dict)
    ranges: set[tuple[str, int]] = field(default_factory=set)
    streams: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def _text(v: Any, where: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise SavepointFileError(f"{where}: must be a string of at most {limit} characters")
    return v


def _int(v: Any, where: str, lo: int = MIN_TIMESTAMP, hi: int = MAX_TIMESTAMP) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise SavepointFileError(f"{where}: must be an integer in {lo}..{hi}")
    return v


def _bytes(v: Any, where: str) -> bytes:
    if isinstance(v, bytes):  # a value split across part frames, reassembled (format.frames)
        return v
    if not isinstance(v, str):
        raise SavepointFileError(f"{where}: must be base64 text")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise SavepointFileError(f"{where}: not valid base64") from None


def _items(obj: dict[str, Any], where: str) -> list[Any]:
    items = obj.get("items")
    if not isinstance(items, list) or not items:  # the format writes no frame without items
        raise SavepointFileError(f"{where}: 'items' must be a list of at least one item")
    return items


def _row(v: Any, n: int, where: str) -> list[Any]:
    if not isinstance(v, list) or len(v) != n:
        raise SavepointFileError(f"{where}: must be a list of {n} fields")
    return v


def _record(key: Any, value: Any, ts: Any, rid: Any, where: str) -> Record:
    rec = Record(_text(key, f"{where} key"), _bytes(value, f"{where} value"), _int(ts, f"{where} timestamp"),
                 _text(rid, f"{where} record id"))
    rec.validate(where)
    return rec


def parse(obj: dict[str, Any], index: int, nodes: dict[str, int], streams: set[str]) -> tuple[str, Any]:
    """One frame as (type, typed content); raises SavepointFileError naming the frame."""
    kind = obj["t"]
    where = f"savepoint frame {index} ({kind[:20]!r})"
    if kind in ("range", "state", "timers", "outbox", "ids", "buffers"):
        node = _text(obj.get("node"), f"{where} node", 2 * MAX_NAME_CHARS)
        if node not in nodes:
            raise SavepointFileError(f"{where}: node {node[:200]!r} is not in the savepoint's registry")
        r = _int(obj.get("range"), f"{where} range", 0, nodes[node] - 1)
        where = f"{where} of {node}/{r}"
        if kind == "range":
            wm = obj.get("watermark")
            counters = obj.get("counters")
            if not isinstance(counters, dict) or any(
                    k not in COUNTERS and late.parse(k) is None for k in counters):
                raise SavepointFileError(f"{where}: 'counters' must map some of {COUNTERS} and "
                                         "late:ACTION:STREAM (millwheel.late) to counts")
            recent = [_bytes(e, f"{where} recent error") for e in _as_list(obj.get("recent"), where)]
            attempts = [(_text(a[0], f"{where} attempt id"), _int(a[1], f"{where} attempts", 1, MAX_ATTEMPTS),
                         _bytes(a[2], f"{where} attempt error"))
                        for a in (_row(x, 3, f"{where} attempt") for x in _as_list(obj.get("attempts"), where))]
            return kind, (node, r, None if wm is None else _int(wm, f"{where} watermark"),
                          {k: _int(v, f"{where} counter {k}", 0, 1 << 62) for k, v in counters.items()},
                          recent, attempts)
        items = _items(obj, where)
        if kind == "state":
            rows = [_row(x, 2, f"{where} item") for x in items]
            return kind, (node, r, [(_text(k, f"{where} key"), _bytes(v, f"{where} value")) for k, v in rows])
        if kind == "timers":
            out = []
            for x in items:
                k, tag, t, dom, hold = _row(x, 5, f"{where} timer")
                if dom not in ("event", "processing") or not isinstance(hold, bool):
                    raise SavepointFileError(f"{where}: a timer's domain must be event|processing, hold a bool")
                out.append(Timer(_text(k, f"{where} timer key"), _text(tag, f"{where} timer tag"),
                                 _int(t, f"{where} timer time"), TimeDomain(dom), hold))
            return kind, (node, r, out)
        if kind == "outbox":
            prods = []
            for x in items:
                consumer, stream, k, v, ts, rid = _row(x, 6, f"{where} production")
                consumer = _text(consumer, f"{where} consumer", 2 * MAX_NAME_CHARS)
                if consumer not in nodes and not (consumer.startswith("log:") and consumer[4:] in streams):
                    raise SavepointFileError(f"{where}: consumer {consumer[:200]!r} is neither a computation "
                                             "nor a logged stream of the savepoint's registry")
                prods.append(Production(consumer, _text(stream, f"{where} stream", MAX_NAME_CHARS),
                                        _record(k, v, ts, rid, f"{where} production")))
            return kind, (node, r, prods)
        if kind == "buffers":
            rows = [_row(x, 2, f"{where} buffer item") for x in items]
            return kind, (node, r, [(_text(n, f"{where} buffer name", MAX_NAME_CHARS),
                                     _bytes(c, f"{where} buffer chunk")) for n, c in rows])
        return kind, (node, r, [_text(x, f"{where} record id") for x in items])
    if kind in ("log", "stream"):
        stream = _text(obj.get("stream"), f"{where} stream", MAX_NAME_CHARS)
        if kind == "stream":
            return kind, (stream, _int(obj.get("start"), f"{where} start", 0),
                          _int(obj.get("last"), f"{where} last", 0), _int(obj.get("count"), f"{where} count", 0))
        entries = []
        for x in _items(obj, where):
            seq, k, v, ts, rid = _row(x, 5, f"{where} entry")
            entries.append((_int(seq, f"{where} seq", 1), _record(k, v, ts, rid, f"{where} entry")))
        return kind, (stream, entries)
    raise SavepointFileError(f"{where}: unknown frame type (a newer savepoint format?)")


def _as_list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise SavepointFileError(f"{where}: a list was expected")
    return v


def check(f: IO[bytes], nodes: dict[str, int], streams: set[str]) -> Summary:
    """Parse every frame after the header (nothing is written); the summary of it all."""
    out = Summary()
    seqs: dict[str, int] = {}  # stream -> its last entry's position so far
    for n, (index, obj) in enumerate(numbered_frames(f)):
        if n == 0:
            continue  # the header, read by the caller
        kind, content = parse(obj, index, nodes, streams)
        if kind == "stream":
            if content[0] in out.streams or content[2] < seqs.get(content[0], 0):
                raise SavepointFileError(f"savepoint frame {index}: stream {content[0][:200]!r} given twice, or "
                                         "its last position below its entries'")
            out.streams[content[0]] = content[1:]
            continue
        if kind == "log":
            for seq, _rec in content[1]:  # sinks' positions are kept: they must rise
                if seq <= seqs.get(content[0], 0) or content[0] in out.streams:
                    raise SavepointFileError(f"savepoint frame {index}: log entry {seq} of {content[0][:200]!r} "
                                             "not after the one before it (or after the stream's end)")
                seqs[content[0]] = seq
        if kind in ("range", "state", "timers", "outbox", "ids", "buffers"):
            if kind == "range":
                out.ranges.add((content[0], content[1]))
            elif (content[0], content[1]) not in out.ranges:
                raise SavepointFileError(f"savepoint frame {index}: {kind} of {content[0]}/{content[1]} "
                                         "before that range's 'range' frame")
        n = len(content[-1]) if kind != "range" else 1
        out.counts[kind] = out.counts.get(kind, 0) + n
    return out


def apply(store: StateStore, f: IO[bytes], nodes: dict[str, int], streams: set[str], now_us: int,
          acquire: Callable[[str, int], int], progress: Callable[[str, int], None]) -> None:
    """Write every frame (after :func:`check` passed) into ``store``: each range under a
    token from ``acquire``; consumed IDs remembered at ``now_us`` (the cut)."""
    tokens: dict[tuple[str, int], int] = {}
    maps: dict[str, LogMap] = {}
    for n, (index, obj) in enumerate(numbered_frames(f)):
        if n == 0:
            continue
        kind, content = parse(obj, index, nodes, streams)
        if kind == "stream":
            m = maps.setdefault(content[0], LogMap())
            m.old_last = content[2]
            save(store, content[0], m)  # sinks' positions: millwheel/savepoint/logmap.py
            continue
        if kind == "log":
            stream, entries = content
            _append(store, stream, entries, maps.setdefault(stream, LogMap()))
            progress(kind, len(entries))
            continue
        node, r = content[0], content[1]
        if kind == "range":
            token = tokens[(node, r)] = acquire(node, r)
            _node, _r, wm, counters, recent, attempts = content
            if counters or recent:
                store.checkpoint(Checkpoint(node, r, token, now_us, counters=counters,
                                            errors=list(reversed(recent))))
            for item, n, err in attempts:
                for _ in range(n):
                    store.bump_attempts(node, r, token, item, err)
            if wm is not None:
                store.report_watermark(node, r, token, wm)
            progress(kind, 1)
            continue
        token = tokens[(node, r)]
        items = content[2]
        for i in range(0, len(items), WRITE_CHUNK):
            part = items[i:i + WRITE_CHUNK]
            cp = Checkpoint(node, r, token, now_us)
            if kind == "state":
                cp.state_writes = dict(part)
            elif kind == "timers":
                cp.timer_sets = part
            elif kind == "outbox":
                cp.productions = part
            elif kind == "buffers":
                cp.buffer_appends = part
            else:
                cp.consumed_ids = part
            store.checkpoint(cp)
        progress(kind, len(items))


def _append(store: StateStore, stream: str, entries: list[tuple[int, Record]], m: LogMap) -> None:
    """Append ``entries`` (after those already restored, ``m.new_last``) and map each
    one's new position to its position in the file. The log holds the file's entries
    alone, in order (also after a restore cut short and sent again: those appended then
    are found, not appended twice)."""
    store.append_log(stream, [rec for _seq, rec in entries])
    got = store.read_log(stream, m.new_last, len(entries))
    if [r.record_id for _s, r in got] != [r.record_id for _s, r in entries]:
        raise CorruptDataError(f"restore of stream {stream[:200]!r}: the store's log does not hold the "
                               "savepoint's entries in order after the restored ones (written to meanwhile?)")
    for (new, _r), (old, _e) in zip(got, entries, strict=True):
        m.add(new, old)
