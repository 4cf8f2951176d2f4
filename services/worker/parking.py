"""One consumer range's failures touch only its own share of a producer's outbox.

A producer range (an injector's, or a computation's) sends its outbox to every
consumer range of its streams. One consumer range that keeps refusing its deliveries
(it cannot be built, its checkpoints keep failing, its code fails under ``on_error:
fail``, nobody owns it, it was unregistered) used to stop the others: slices were
taken oldest first, so its entries filled them; a failed slice backed off the whole
producer; and its entries filled an injector's outbox until every Inject to that
stream was refused. Now:

* each consumer range backs off on its own (:class:`ConsumerBackoff`), and a slice
  skips the entries of a consumer range in backoff (:func:`plan`);
* a failing (or unregistered) consumer range's share of the outbox is parked
  (:meth:`millwheel.runtime.outbox.Outbox.park`): its oldest ``keep`` entries stay in
  memory and are retried; the rest, and every later one, wait in the store, where the
  durable outbox holds every entry until acked. The injector's limit
  (``--max-injector-outbox``) thus counts what its healthy consumers have not taken;
* once the consumer range acks again, its entries come back from the store a chunk
  at a time (:func:`plan`), oldest first, until none is left in the store alone.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from millwheel.keys import key_range
from millwheel.runtime.outbox import Outbox
from millwheel.runtime.routing import LOG_PREFIX
from millwheel.state.protocol import Production
from millwheel.topology import Topology

Unit = tuple[str, int]
Entry = tuple[str, str]  # (consumer, record id): an outbox entry
UNKNOWN = -1  # the range of a consumer not registered (any more): never sent, parked
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 5.0


class UnitOf:
    """The consumer range a production goes to: ``(consumer, range)``, range
    :data:`UNKNOWN` for a consumer not in the registry, 0 for a stream log."""

    def __init__(self, topology: Topology) -> None:
        self.ranges = {c.name: c.options.key_ranges for c in topology.computations}

    def __call__(self, p: Production) -> Unit:
        n = self.ranges.get(p.consumer)
        if n is None:
            return (p.consumer, 0 if p.consumer.startswith(LOG_PREFIX) else UNKNOWN)
        return (p.consumer, key_range(p.record.key, n))


@dataclass
class _Retry:
    failures: int
    retry_at: float
    message: str


class ConsumerBackoff:
    """Consumer ranges of one producer range whose last delivery failed, each with its
    own exponential backoff (with jitter), so the others go on being sent to; and the
    consumer-range mapping its outbox parked under, when the registry changed since."""

    def __init__(self) -> None:
        self.failing: dict[Unit, _Retry] = {}
        self.parked_under: UnitOf | None = None  # the mapping before the registry changed

    def failed(self, unit: Unit, message: str) -> None:
        r = self.failing.get(unit) or _Retry(0, 0.0, "")
        r.failures += 1
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(r.failures, 10))
        r.retry_at = time.monotonic() + delay * random.uniform(0.5, 1.5)
        r.message = message
        self.failing[unit] = r

    def succeeded(self, unit: Unit) -> None:
        self.failing.pop(unit, None)

    def blocked(self, now: float) -> set[Unit]:
        return {u for u, r in self.failing.items() if r.retry_at > now}


def plan(outbox: Outbox, consumers: ConsumerBackoff, limit: int,
         unit_of: UnitOf, keep: int, chunk: int) -> list[Production]:
    """Up to ``limit`` outbox entries to send next, oldest first, not in flight and not
    of a consumer range in backoff, now taken (:meth:`Outbox.take`: the sender
    releases what it does not deliver, acks the rest). A consumer range in backoff
    found holding more than ``keep`` entries in memory is parked; a parked one no
    longer failing, with at most half a ``chunk`` left in memory, is refilled to a
    chunk from the store (while the outbox holds at most two chunks in memory: the
    other consumers keep their room; a chunk is half the injector's limit). The
    caller holds the range's lock. (With no consumer range in backoff this is the
    plain oldest-first take: nothing is computed per entry.)"""
    if consumers.parked_under is not None:
        registry_changed(outbox, consumers, consumers.parked_under, unit_of)
    if outbox.parked:  # recovered: refilled while half its chunk is still to send
        for unit, share in list(outbox.parked.items()):
            if share.in_memory <= chunk // 2 and unit not in consumers.failing and unit[1] != UNKNOWN \
                    and outbox.in_memory() + chunk - share.in_memory <= 2 * chunk:
                outbox.unpark_chunk(unit, chunk - share.in_memory)
    skip = consumers.blocked(time.monotonic())
    if not skip:
        return outbox.take(limit)
    held: dict[Unit, int] = {}

    def blocked(p: Production) -> bool:
        unit = unit_of(p)
        if unit in skip:
            held[unit] = held.get(unit, 0) + 1
            return True
        return False
    out = outbox.take(limit, blocked)
    over = [u for u, n in held.items() if n > keep]
    if over:
        outbox.park(over, unit_of, keep)
    return out


def park_failing(outbox: Outbox, consumers: ConsumerBackoff, unit_of: UnitOf, keep: int) -> int:
    """Park every failing consumer range's share of ``outbox`` (an injector at its
    limit, before it refuses a message); returns the entries let go. The caller holds
    the range's lock."""
    if not consumers.failing:
        return 0
    units = {unit_of(p) for p in outbox.pending(outbox.in_memory())}
    return outbox.park([u for u in units if u in consumers.failing], unit_of, keep)


def registry_changed(outbox: Outbox, consumers: ConsumerBackoff, old: UnitOf, new: UnitOf) -> None:
    """A consumer registered (again, maybe with other key ranges) or unregistered maps
    its entries to other consumer ranges now: its parked shares, found under the old
    mapping, come back into memory (and are parked again under the new one if they
    keep failing), and its old ranges' backoffs are forgotten."""
    for unit in list(outbox.parked):
        if old.ranges.get(unit[0]) != new.ranges.get(unit[0]):
            outbox.unpark_chunk(unit, 1 << 62, unit_of=old)
    for unit in [u for u in consumers.failing if old.ranges.get(u[0]) != new.ranges.get(u[0])]:
        del consumers.failing[unit]
    outbox.remap(new)
    consumers.parked_under = None
