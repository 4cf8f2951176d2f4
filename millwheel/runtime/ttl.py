"""Per-key state time to live (``Options.state_ttl_us``): state of idle keys does not
grow forever.

Each state write (re)sets a processing-time timer of the key, tagged
:data:`TTL_TAG`, in the same transaction, so the expiry is checkpointed with the state
like any timer and survives crashes and range moves. The timer never holds the
watermark. When it fires the runtime deletes the key's state in that firing's
checkpoint; user code never sees it, and the key's own timers stay.

Re-setting a timer on every write would push a heap entry per write (the in-memory
queue deletes lazily, :mod:`millwheel.timers`) and a timer row per write. So a write
moves the expiry only when it is due sooner than ``ttl`` from now, and then to
``now + ttl + ttl/16``: a key's state expires between ``ttl`` and ``ttl * 17/16``
after its last write, never earlier, and a hot key rewrites its timer at most once
per ``ttl/16``.
"""

from __future__ import annotations

from typing import Protocol

from millwheel.clock import Clock
from millwheel.errors import InvalidSpecError
from millwheel.record import TimeDomain, Timer
from millwheel.timers import TimerQueue

RESERVED_PREFIX = "millwheel:"
TTL_TAG = RESERVED_PREFIX + "ttl"


class TTLWorker(Protocol):
    """What the TTL uses of a key range's worker: its timers, its clock, its state
    cache. :class:`~millwheel.runtime.range_worker.RangeWorker` satisfies it; declared
    here so that this module, below both, imports neither range_worker nor
    :mod:`millwheel.runtime.context` (both call it)."""

    @property
    def timers(self) -> TimerQueue: ...

    @property
    def clock(self) -> Clock: ...

    def put_state(self, key: str, value: bytes | None) -> None: ...


class TTLTransaction(Protocol):
    """What the TTL writes into of a batch's transaction
    (:class:`~millwheel.runtime.context.RangeTransaction` satisfies it)."""

    timer_ops: dict[tuple[str, str], Timer | None]
    state_writes: dict[str, bytes | None]
    expired: int

    @property
    def worker(self) -> TTLWorker: ...


def check_user_tag(computation: str, key: str, tag: str) -> None:
    if isinstance(tag, str) and tag.startswith(RESERVED_PREFIX):
        raise InvalidSpecError(f"computation {computation!r} key {key!r}: timer tag {tag!r}: tags "
                               f"starting with {RESERVED_PREFIX!r} are the runtime's own")


def after_write(txn: TTLTransaction, key: str, value: bytes | None, ttl_us: int) -> None:
    """Called on every state write of a computation with a TTL."""
    worker = txn.worker
    existing = worker.timers.get(key, TTL_TAG)
    if value is None:
        if existing is not None:
            worker.timers.clear(key, TTL_TAG)
            txn.timer_ops[(key, TTL_TAG)] = None
        return
    now = worker.clock.now_us()
    if existing is not None and existing.time >= now + ttl_us:
        return
    timer = Timer(key, TTL_TAG, now + ttl_us + ttl_us // 16, TimeDomain.PROCESSING, False)
    worker.timers.set(timer)
    txn.timer_ops[(key, TTL_TAG)] = timer


def expire(txn: TTLTransaction, key: str) -> None:
    """The key's TTL timer fired: delete its state in this transaction."""
    txn.worker.put_state(key, None)
    txn.state_writes[key] = None
    txn.expired += 1
