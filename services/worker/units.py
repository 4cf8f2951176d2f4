"""What a worker owns: key ranges of computations and injector outboxes.

Each owned range carries the sequencer token the controller issued with it; every
write for the range goes through the store under that token, so when the range is
moved the old owner's writes are fenced. A lock serialises everything done to one
range (deliveries, timers, sends, acks).

Watermark reports never wait on that lock (a batch may hold it for a long time): the
heartbeat takes a snapshot of the range's pending-work hold only when the lock is
free, and otherwise reports the last snapshot if nothing changed since it was taken
(:meth:`OwnedRange.report_nowait`). A change (checkpoint, ack, injection) discards the
snapshot; when the heartbeat found it discarded, the next change leaves a fresh one.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.runtime.outbox import Outbox
from millwheel.runtime.range_worker import RangeWorker
from millwheel.state.protocol import Checkpoint, Production, StateStore

from ..generated import millwheel_pb2 as pb
from . import overruns
from .overruns import Overruns
from .parking import ConsumerBackoff, Unit

INJ_WM_KEY = "__watermark__"


def injector_wm_key(range_id: int) -> str:
    """The state key of an injector range's watermark (range 0 keeps the key it had when
    injectors had one range)."""
    return INJ_WM_KEY if range_id == 0 else f"{INJ_WM_KEY}/{range_id}"


Entry = tuple[str, str]  # (consumer, record id): an outbox entry


@dataclass(frozen=True)
class OwnerInfo:
    """Who owns a range elsewhere in the cluster (from the controller's assignment):
    where to send its records, and under which token they are accepted."""

    worker_id: str
    address: str
    token: int


@dataclass
class Slice:
    """Outbox entries sent together; acked once their deliveries succeed. A range keeps
    several slices in flight (a window), so a round trip to a consumer does not stall
    the range: entries in a slice are not sent again until the slice is finished.

    A slice is planned under the range's lock and sent outside it (local consumers
    are processed in place, which may take a while), then finished under the lock.
    At most one batch per consumer range is in flight: a batch refused (the range
    moving, say) is resent before anything newer goes there, so each consumer key
    sees a producer's records in the order they were produced, failures or not."""

    started: float
    entries: list[Production]
    done_now: list[Entry] = field(default_factory=list)  # delivered (stream log, local consumers)
    # (ack, entries, owner's address, consumer range) of each batch sent to another worker
    remote: list[tuple[Future[Any], list[Production], str, Unit]] = field(default_factory=list)
    sent: bool = False
    units: set[tuple[str, int]] = field(default_factory=set)  # consumer ranges of ``remote``

    def busy(self) -> set[tuple[str, int]]:
        """Consumer ranges this slice still has a batch in flight to, or a failed batch
        not yet finished (its records go again before anything newer goes there: a link
        reset fails a batch the moment before a newer slice is sent)."""
        if not self.sent:
            return set(self.units)
        for fut, _, _, _ in self.remote:
            if not fut.done() or fut.exception() is not None or fut.result().status != pb.DeliverAck.OK:
                return self.units
        return set()

    def ready(self) -> bool:
        return self.sent and all(fut.done() for fut, _, _, _ in self.remote)

    def keys(self) -> list[Entry]:
        return [(p.consumer, p.record.record_id) for p in self.entries]


#: Keys whose state a worker keeps decoded in memory, over all its ranges: each range's
#: cache is cleared past its share (a range alone used to keep up to 200,000, so a
#: worker owning 64 ranges could hold 12.8 million). At least 10,000 per range.
WORKER_CACHED_KEYS = 1_000_000
MIN_RANGE_CACHED_KEYS = 10_000


def share_cache(units: dict[Unit, OwnedRange], budget: int = WORKER_CACHED_KEYS) -> int:
    """Give each owned computation range its share of ``budget``; returns the share."""
    ranges = [o.worker for o in list(units.values()) if o.worker is not None]
    share = max(MIN_RANGE_CACHED_KEYS, budget // max(1, len(ranges)))
    for rw in ranges:
        rw.max_cached_keys = share
    return share


@dataclass
class OwnedRange:
    node: str
    range_id: int
    token: int
    store: StateStore
    worker: RangeWorker | None = None  # None for an injector's outbox
    lock: threading.RLock = field(default_factory=threading.RLock)
    outbox: Outbox | None = None
    injector_wm: int = MIN_TIMESTAMP
    cursor: bytes | None = None  # a pulled source's position (services/worker/connectors.py); None: unread
    slices: list[Slice] = field(default_factory=list)  # their entries are taken from the outbox
    retry_at: float = 0.0
    failures: int = 0
    consumers: ConsumerBackoff = field(default_factory=ConsumerBackoff)  # services/worker/parking.py
    dropped: bool = False
    published: int | None = None  # hold() snapshot taken under the lock; None once changed
    wanted: bool = False  # the heartbeat found the lock busy and no valid snapshot
    held: str = ""  # what holds ``published`` below the input watermark, for people (WatermarkReport.held)
    input_wm: int = MIN_TIMESTAMP  # the input watermark of the last report
    overruns: Overruns = field(default_factory=dict)  # records that overran their deadline
    taken_at: float = field(default_factory=time.monotonic)
    _overruns_read: float = 0.0

    def __post_init__(self) -> None:
        if self.worker is not None:
            self.outbox = self.worker.outbox
            self.overruns = overruns.load(self.store, self.node, self.range_id)
        else:
            key = injector_wm_key(self.range_id)
            raw = self.store.read_state(self.node, [key]).get(key)
            self.injector_wm = int(raw) if raw is not None else MIN_TIMESTAMP
            self.outbox = Outbox(self.store, self.node, self.range_id)

    def fresh_overruns(self, min_age_s: float = 0.0) -> Overruns:
        """The range's recorded overruns. Read again (if older than ``min_age_s``) while
        the range is new here: the previous owner may still overrun a batch for up to
        its deadline after the move, and its watchdog records that just before the
        batch is resent to us. Later, the map read at take time stays current. A range
        under its first token (1) had no previous owner: nothing to read again (it was a
        store read per batch for the first minute of every new range)."""
        assert self.worker is not None
        now = time.monotonic()
        if self.token > 1 and now - self.taken_at < self.worker.spec.options.max_batch_seconds + 10 and \
                now - self._overruns_read >= min_age_s:
            self.overruns = overruns.load(self.store, self.node, self.range_id)
            self._overruns_read = now
        return self.overruns

    @property
    def is_injector(self) -> bool:
        return self.worker is None

    def inject(self, productions: list[Production], watermark: int | None, now_us: int) -> None:
        """Checkpoint the productions of injected records (those the receiver did not
        deliver at once: services/worker/receive.py) and the injector's watermark into
        this range's outbox (under its token), the way
        :class:`~millwheel.runtime.injector.InjectorWorker` checkpoints a source batch;
        the sender is acked only after this. Nothing to keep (all delivered, the
        watermark unchanged): no checkpoint."""
        wm = self.injector_wm if watermark is None else max(self.injector_wm, watermark)
        if not productions and wm == self.injector_wm and watermark is None:
            return
        writes: dict[str, bytes | None] = {}
        if wm != self.injector_wm or not productions:  # unchanged: no write
            writes[injector_wm_key(self.range_id)] = str(wm).encode()
        self.store.checkpoint(Checkpoint(
            computation=self.node, range_id=self.range_id, token=self.token, now_us=now_us,
            state_writes=writes, productions=productions))
        assert self.outbox is not None
        self.outbox.add(productions)
        self.injector_wm = wm
        self.changed()

    def hold(self) -> int:
        """Oldest pending work (an injector: also its own watermark); caller holds the lock."""
        assert self.outbox is not None
        if self.worker is None:
            return min(self.injector_wm, self.outbox.hold())
        return self.worker.hold()

    def changed(self) -> None:
        """After a change to pending work (caller holds the lock): the snapshot is stale;
        take a fresh one now if the heartbeat is waiting for one."""
        self.published = self.hold() if self.wanted else None
        if self.published is not None:
            self.held = self.held_reason(self.published)
        self.wanted = False

    def held_reason(self, hold: int) -> str:
        """What holds this computation range below its input watermark (its earliest
        timer, its oldest production not yet acked); "" at its input, or for an
        injector. Only worked out while below (caller holds the lock)."""
        if self.worker is None or hold >= self.input_wm:
            return ""
        return self.worker.held_reason()

    def report_nowait(self, input_wm: int) -> int | None:
        """This range's low watermark, min(input watermark, oldest pending work), without
        waiting for the lock; None (report nothing this time) if a batch holds the lock
        and pending work changed since the last snapshot. A snapshot is a valid bound
        while a batch runs: the batch's own records are still held by its sender.
        :attr:`held` says what holds the snapshot, as of when it was taken."""
        self.input_wm = input_wm
        if self.lock.acquire(blocking=False):
            try:
                self.published = self.hold()
                self.held = self.held_reason(self.published)
                self.wanted = False
            finally:
                self.lock.release()
        hold = self.published
        if hold is None:
            self.wanted = True
            return None
        return hold if self.worker is None else min(input_wm, hold)

    def reset_slices(self) -> None:
        """Forget every slice in flight (their entries are sent again; consumers dedup)."""
        self.slices = []
        if self.outbox is not None:
            self.outbox.release_all()

    def backoff(self, base_s: float = 0.05, cap_s: float = 2.0) -> None:
        """Exponential backoff with jitter before the next send attempt of the whole
        range (after a failure no consumer range is to blame for: those back off alone,
        services/worker/parking.py)."""
        self.failures += 1
        delay = min(cap_s, base_s * 2 ** min(self.failures, 10))
        self.retry_at = time.monotonic() + delay * random.uniform(0.5, 1.5)

    def succeeded(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def idle(self) -> bool:
        return self.outbox is None or (len(self.outbox) == 0 and (
            self.worker is None or self.worker.timers.hold() == MAX_TIMESTAMP))


def merged_owners(current: dict[Unit, OwnerInfo], resp: pb.HeartbeatResponse) -> dict[Unit, OwnerInfo] | None:
    """The owners table after a heartbeat answer, or None when it is unchanged. An
    incremental answer (``assignments_epoch`` set) replaces the table when
    ``assignments_full``, else changes only the ranges it names (a range without an
    owner is forgotten); an older controller's answer lists every range."""
    if not resp.assignments_epoch:
        return {(a.node, a.range_id): OwnerInfo(a.worker_id, a.worker_address, a.token)
                for a in resp.assignments}
    if not resp.assignments_full and not resp.owners:
        return None
    out = {} if resp.assignments_full else dict(current)
    for o in resp.owners:
        if o.worker_id:
            out[(o.node, o.range_id)] = OwnerInfo(o.worker_id, o.worker_address, o.token)
        else:
            out.pop((o.node, o.range_id), None)
    return out
