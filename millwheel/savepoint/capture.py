"""Reading a whole deployment's store into savepoint frames (through the store protocol
only, so any backend writes the same file).

The caller makes the cut consistent (services/controller/savepoint.py: every key range
fenced with a fresh token nobody writes under until the capture ends); this module only
reads. Per node (computation, or an injector's one range) and range, in this order:
``range`` (watermark, error counters and attempts), ``state``, ``timers``, ``outbox``
(pending productions, in checkpoint order), ``ids`` (retained consumed record IDs),
``buffers`` (window buffers: ``[name, chunk]`` in append order);
then per stream with a log: ``log`` frames (the retained entries) and a ``stream``
frame (its positions in the source). Items are cut into frames of about
:data:`FRAME_TARGET` bytes, so no frame (and no gRPC message) holds a whole range; a
value over :data:`millwheel.savepoint.format.PART_BYTES` (a key's state, a record's
value, an error) is written as part frames before the frame holding its item
(:meth:`Writer.value`), so no key's state is too large for a savepoint. Keys' values
and log entries are read a page at a time, the page sized to about :data:`PAGE_BYTES`
of values once their sizes are seen (a range of large states, a log of large records,
is not read whole into memory).
"""

from __future__ import annotations

import base64
from typing import Any, Callable, Iterable

from millwheel.keys import key_range
from millwheel.nodes import injector_node, is_injector
from millwheel.state.protocol import ID_PAGE, StateStore

from .format import Writer
from .logmap import load as load_logmap

FRAME_TARGET = 1 << 20
KEY_PAGE = 1000  #: keys listed per store call, and values read per call at most
FIRST_VALUE_PAGE = 100  #: values (or log entries) read in the first call, before any size is seen
PAGE_BYTES = 32 << 20  #: about how many bytes of values one read_state call returns
LOG_PAGE = 2000
BUFFER_PIECE = 256 * 1024  # bytes of a window-buffer chunk per savepoint item at most

Progress = Callable[[str, int], None]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class _Batcher:
    """Items of one frame type, flushed as a frame near :data:`FRAME_TARGET` bytes."""

    def __init__(self, writer: Writer, head: dict[str, Any], counts: dict[str, int], progress: Progress) -> None:
        self.writer, self.head, self.counts, self.progress = writer, head, counts, progress
        self.items: list[Any] = []
        self.size = 0

    def add(self, item: Any, size: int) -> None:
        """``size``: about its bytes in the frame (a split value's: its whole length,
        which flushes the frame right after its parts)."""
        self.items.append(item)
        self.size += size + 16
        if self.size >= FRAME_TARGET or len(self.items) >= ID_PAGE:
            self.flush()

    def flush(self) -> None:
        if self.items:
            self.writer.frame({**self.head, "items": self.items})
            kind = self.head["t"]
            self.counts[kind] = self.counts.get(kind, 0) + len(self.items)
            self.progress(kind, len(self.items))
            self.items, self.size = [], 0


def capture_nodes(store: StateStore, nodes: dict[str, int], writer: Writer, counts: dict[str, int],
                  progress: Progress) -> None:
    """Every range of every node in ``nodes`` (node -> range count)."""
    for node, ranges in nodes.items():
        by_range = _state_ranges(store, node, ranges)
        watermarks = store.read_watermarks(node)
        for r in range(ranges):
            errors = store.read_errors(node, r)
            where = f"an error of {node}/{r}"
            writer.frame({"t": "range", "node": node, "range": r, "watermark": watermarks.get(r),
                          "counters": errors.counters, "recent": [writer.value(e, where) for e in errors.recent],
                          "attempts": [[i, n, writer.value(e, where)]
                                       for i, (n, e) in sorted(errors.attempts.items())]})
            counts["ranges"] = counts.get("ranges", 0) + 1
            head = {"node": node, "range": r}
            state = _Batcher(writer, {"t": "state", **head}, counts, progress)
            keys = by_range.get(r, [])
            i, n = 0, FIRST_VALUE_PAGE
            while i < len(keys):
                page = keys[i:i + n]
                i += len(page)
                values = store.read_state(node, page, r)
                size = 0
                for k in page:
                    if k in values:
                        v = values.pop(k)  # each value let go once written
                        size += len(v)
                        state.add([k, writer.value(v, f"the state of key {k[:200]!r} of {node}/{r}")],
                                  len(k) + len(v) * 4 // 3)
                n = max(1, min(KEY_PAGE, PAGE_BYTES * len(page) // max(1, size)))
            state.flush()
            timers = _Batcher(writer, {"t": "timers", **head}, counts, progress)
            for t in store.read_timers(node, r):
                timers.add([t.key, t.tag, t.time, str(t.domain), t.hold], len(t.key) + len(t.tag) + 40)
            timers.flush()
            outbox = _Batcher(writer, {"t": "outbox", **head}, counts, progress)
            for p in store.read_outbox(node, r):
                rec = p.record
                value = writer.value(rec.value, f"record {rec.record_id[:200]!r} pending in {node}/{r}")
                outbox.add([p.consumer, p.stream, rec.key, value, rec.timestamp, rec.record_id],
                           len(p.consumer) + len(p.stream) + len(rec.key) + len(rec.value) * 4 // 3
                           + len(rec.record_id) + 30)
            outbox.flush()
            ids = _Batcher(writer, {"t": "ids", **head}, counts, progress)
            for rid in store.iter_ids(node, r):
                ids.add(rid, len(rid) + 3)
            ids.flush()
            buffers = _Batcher(writer, {"t": "buffers", **head}, counts, progress)
            for name in store.list_buffers(node, r):
                for chunk in store.read_buffer(node, r, name):
                    # Readers concatenate a buffer's chunks, so a big one may be cut.
                    for i in range(0, max(1, len(chunk)), BUFFER_PIECE):
                        piece = chunk[i:i + BUFFER_PIECE]
                        buffers.add([name, b64(piece)], len(name) + len(piece) * 4 // 3)
            buffers.flush()


def _state_ranges(store: StateStore, node: str, ranges: int) -> dict[int, list[str]]:
    """The node's keys with state, by the range that owns them (an injector's, range 0)."""
    out: dict[int, list[str]] = {}
    after: str | None = None
    while True:
        page = store.list_keys(node, after, KEY_PAGE)
        for k in page:
            out.setdefault(0 if is_injector(node) else key_range(k, ranges), []).append(k)
        if len(page) < KEY_PAGE:
            return out
        after = page[-1]


def capture_logs(store: StateStore, streams: Iterable[str], writer: Writer, counts: dict[str, int],
                 progress: Progress) -> dict[str, tuple[int, int]]:
    """The retained entries of every stream's log; returns stream -> (start, last) of
    the logs that have any entry (or ever had). Positions are written as the stream's
    sinks know them: the store's, unless it was restored from a savepoint (logmap.py)."""
    out: dict[str, tuple[int, int]] = {}
    for stream in streams:
        start = store.log_start(stream)
        last, count = store.log_end(stream, start)
        if last == 0 and start == 0:
            continue
        m = load_logmap(store, stream)
        sink_pos: Callable[[int], int] = (lambda seq: seq) if m is None else m.to_sink
        batch = _Batcher(writer, {"t": "log", "stream": stream}, counts, progress)
        after, n = start, FIRST_VALUE_PAGE
        while after < last:
            entries = store.read_log(stream, after, n)
            if not entries:
                break
            size = 0
            for seq, rec in entries:
                if seq > last:
                    break
                size += len(rec.value)
                value = writer.value(rec.value, f"record {rec.record_id[:200]!r} in the log of {stream[:200]!r}")
                batch.add([sink_pos(seq), rec.key, value, rec.timestamp, rec.record_id],
                          len(rec.key) + len(rec.value) * 4 // 3 + len(rec.record_id) + 40)
            after = entries[-1][0]
            n = max(1, min(LOG_PAGE, PAGE_BYTES * len(entries) // max(1, size)))
        batch.flush()
        writer.frame({"t": "stream", "stream": stream, "start": sink_pos(start), "last": sink_pos(last),
                      "count": count})
        out[stream] = (sink_pos(start), sink_pos(last))
    return out


def node_ranges(computations: Iterable[tuple[str, int]], injectors: Iterable[str]) -> dict[str, int]:
    """node -> range count, the injectors' nodes (one range each) first."""
    out = {injector_node(name): 1 for name in injectors}
    out.update(dict(computations))
    return out
