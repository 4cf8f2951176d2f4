"""The worker's progress block: what user code runs right now, shared with its watchdog.

A small shared-memory block (a ``memfd`` mapped by the worker and by its watchdog
process, see :mod:`services.worker.watchdog`). Before user code runs on a batch (or on a
range's due timers) the worker writes a slot: computation, range, token, start time
(``CLOCK_MONOTONIC``, the same clock in both processes), deadline, and the batch's
record IDs (at most ``MAX_IDS`` / ``IDS_BYTES``); it clears the slot after. The
heartbeat thread writes the time of its last successful heartbeat in the header.

The watchdog only reads. The block lives in memory shared with a second process, so
it stays readable when the worker holds the interpreter in one C call, is stopped,
or was just killed. Several batches can run at once (one per thread), each in its
own slot, guarded by a seqlock: the writer makes the slot's sequence number odd, writes
the fields, and publishes the next even number last; the reader reads the number, the
fields, and the number again, and keeps what it read only if both are the same even
number. (One ``pack_into`` of the whole slot is no atomic write: it stores the fields
in order, sequence first, so a reader could see the new even number over the old
fields.) Writing a slot costs a few microseconds plus one join of the batch's IDs.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from millwheel.record import Record

SLOTS = 48
MAX_IDS = 5000
IDS_BYTES = 256 * 1024
NAME_BYTES = 256
SEP = "\x00"  # between IDs (record IDs and timer causes may hold newlines)
_HEADER = struct.Struct("<d")  # last successful heartbeat (monotonic seconds)
_HEADER_SIZE = 64
_SEQ = struct.Struct("<Q")  # the slot's sequence number: odd while being written
_FIELDS = struct.Struct("<BddqiII")  # active, start, deadline_s, token, range, n_ids, lens
_SLOT = struct.Struct("<Q" + _FIELDS.format[1:])  # the sequence number, then the fields
_SLOT_SIZE = _SLOT.size + NAME_BYTES + IDS_BYTES
SIZE = _HEADER_SIZE + SLOTS * _SLOT_SIZE


@dataclass(frozen=True)
class Running:
    """One batch (or timer firing) in progress, as the watchdog reads it."""

    slot: int
    seq: int
    start: float
    deadline_s: float
    computation: str
    range_id: int
    token: int
    n_ids: int


class ProgressBlock:
    """The shared block; the worker writes through :meth:`batch`, the watchdog reads."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("millwheel-progress")  # close-on-exec: shared only via pass_fds
            os.ftruncate(fd, SIZE)
        self.fd = fd
        self.mm = mmap.mmap(fd, SIZE)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._lock = threading.Lock()

    # -- the worker's side -----------------------------------------------------------
    def heartbeat_ok(self) -> None:
        _HEADER.pack_into(self.mm, 0, time.monotonic())

    @contextmanager
    def batch(self, computation: str, range_id: int, token: int, deadline_s: float,
              records: Sequence[Record] = (), ids: Sequence[str] = ()) -> Iterator[None]:
        """Mark user code running on ``records`` (or on what ``ids`` name: timers) for
        the duration of the block."""
        with self._lock:
            slot = self._free.pop() if self._free else -1
        if slot < 0:  # more concurrent batches than slots: not watched (never expected)
            yield
            return
        base = _HEADER_SIZE + slot * _SLOT_SIZE
        mm = self.mm
        seq = _SEQ.unpack_from(mm, base)[0]
        n = len(records) or len(ids)
        joined = SEP.join(r.record_id for r in records[:MAX_IDS]) if records else SEP.join(ids[:MAX_IDS])
        raw = joined.encode()[:IDS_BYTES]
        name = computation.encode()[:NAME_BYTES]
        # 1. odd: being written; 2. the fields, name and IDs; 3. even, published last.
        _SEQ.pack_into(mm, base, seq + 1)
        head = base + _SLOT.size
        mm[head:head + len(name)] = name
        mm[head + NAME_BYTES:head + NAME_BYTES + len(raw)] = raw
        _FIELDS.pack_into(mm, base + _SEQ.size, 1, time.monotonic(), deadline_s, token, range_id,
                          n, len(raw) | (len(name) << 20))
        _SEQ.pack_into(mm, base, seq + 2)
        try:
            yield
        finally:  # the same three steps: the slot is inactive when the even number shows
            _SEQ.pack_into(mm, base, seq + 3)
            _FIELDS.pack_into(mm, base + _SEQ.size, 0, 0.0, 0.0, 0, 0, 0, 0)
            _SEQ.pack_into(mm, base, seq + 4)
            with self._lock:
                self._free.append(slot)

    # -- the watchdog's side ---------------------------------------------------------
    def last_heartbeat(self) -> float:
        return float(_HEADER.unpack_from(self.mm, 0)[0])

    def running(self) -> list[Running]:
        """Every active slot as one consistent read. A slot being written is read again
        (for up to ~10 ms); a writer stopped mid-write leaves it odd, and it is skipped."""
        out = []
        for slot in range(SLOTS):
            read = self._read(_HEADER_SIZE + slot * _SLOT_SIZE)
            if read is not None:
                seq, (active, start, deadline, token, range_id, n_ids, lens), name = read
                if active:
                    out.append(Running(slot, seq, start, deadline, name, range_id, token, n_ids))
        return out

    def _read(self, base: int) -> tuple[int, tuple[Any, ...], str] | None:
        mm = self.mm
        for _ in range(100):
            seq = _SEQ.unpack_from(mm, base)[0]
            if seq % 2 == 0:
                fields = _FIELDS.unpack_from(mm, base + _SEQ.size)
                head = base + _SLOT.size
                name = bytes(mm[head:head + (fields[6] >> 20)]).decode(errors="replace")
                if _SEQ.unpack_from(mm, base)[0] == seq:  # nothing was written meanwhile
                    return seq, fields, name
            time.sleep(0.0001)
        return None

    def record_ids(self, r: Running) -> list[str]:
        """The IDs of a running batch (empty if the slot moved on meanwhile)."""
        base = _HEADER_SIZE + r.slot * _SLOT_SIZE
        lens = _FIELDS.unpack_from(self.mm, base + _SEQ.size)[6]
        start = base + _SLOT.size + NAME_BYTES
        raw = bytes(self.mm[start:start + (lens & 0xFFFFF)])
        if _SEQ.unpack_from(self.mm, base)[0] != r.seq:
            return []
        return raw.decode(errors="replace").split(SEP) if raw else []

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


class NoProgress:
    """Stands in for the block when the worker runs without a watchdog."""

    def heartbeat_ok(self) -> None:
        pass

    @contextmanager
    def batch(self, computation: str, range_id: int, token: int, deadline_s: float,
              records: Sequence[Record] = (), ids: Sequence[str] = ()) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass
