"""Record-ID deduplication for exactly-once (ARCHITECTURE.md step 1).

Bloom filters answer most lookups in memory: a miss means "certainly new". A maybe-hit
is confirmed against the store in one round trip for the whole batch. The filters are
built from the store's retained IDs when a worker takes a range, and follow the store
from then on: one filter per span of the retention, dropped whole once the store has
forgotten every generation of IDs in it (see :class:`Deduplicator`).

The filter is rbloom's (Rust): adds and lookups were a quarter of the three-stage
pipeline's CPU with pybloom-live (see docs/bench.md). It is never persisted, only
rebuilt from the store in the process that uses it, so rbloom's default hash
(Python's per-process ``hash``) is safe here.
"""

from __future__ import annotations

from typing import Callable, Sequence

from rbloom import Bloom

from millwheel.state.protocol import StateStore


class ScalableBloom:
    """Bloom filters of growing capacity (x2) and tightening error (x0.9), so the
    overall false-positive rate stays under ``error_rate`` however many IDs arrive
    (the scheme of pybloom-live's ScalableBloomFilter)."""

    def __init__(self, initial_capacity: int = 100_000, error_rate: float = 0.001) -> None:
        self._capacity = initial_capacity
        self._error = error_rate * 0.1  # the first filter's share; sum over filters <= error_rate
        self._filters: list[Bloom] = []
        self._room = 0
        self._grow()

    def _grow(self) -> None:
        if self._filters:
            self._capacity *= 2
            self._error *= 0.9
        self._filters.append(Bloom(self._capacity, self._error))
        self._room = self._capacity

    def __contains__(self, item: str) -> bool:
        return any(item in f for f in self._filters)

    def maybe_seen(self, items: Sequence[str]) -> list[str]:
        """The items the filter may have seen (a superset of those added), in no order.

        One pass over the batch per filter (a C-level membership test per item) rather
        than a Python call per item trying each filter: the filters multiply as a long
        run retains more IDs (5 at 2.5M per range), and the per-item call cost 1.5 us
        there against 0.8 us this way (docs/bench.md, "Speed round 2")."""
        filters = self._filters
        if len(filters) == 1:
            f = filters[0]
            return [i for i in items if i in f]
        found: set[str] = set()
        for f in filters:
            found.update([i for i in items if i in f])
        return list(found)

    def update(self, items: Sequence[str]) -> None:
        start = 0
        while start < len(items):
            if self._room == 0:
                self._grow()
            chunk = items[start : start + self._room]
            self._filters[-1].update(chunk)
            self._room -= len(chunk)
            start += len(chunk)


#: Filters per retention: a filter is dropped a quarter of the retention after the
#: newest ID it holds could still be asked for, so memory holds the retained IDs and at
#: most a quarter more; a lookup probes ~5 filters.
ID_BUCKETS = 4
#: Each filter's error rate (its first slice's is a tenth of it, ScalableBloom):
#: ~5 live filters keep the overall false-positive rate near 0.001 (a store lookup).
BUCKET_ERROR_RATE = 0.0015


class _Bucket:
    """The filter of one span of generations, and which generations it holds."""

    __slots__ = ("bloom", "generations", "count")

    def __init__(self, capacity: int) -> None:
        self.bloom = ScalableBloom(initial_capacity=capacity, error_rate=BUCKET_ERROR_RATE)
        self.generations: set[int | None] = set()
        self.count = 0

    def add(self, generation: int | None, ids: Sequence[str]) -> None:
        self.bloom.update(ids)
        self.generations.add(generation)
        self.count += len(ids)


class Deduplicator:
    """A range's record-ID filters over the store's retained IDs.

    The store keeps consumed IDs in generations (``Checkpoint.ids_generation``, 1/16 of
    the retention each) and forgets a generation whole. The filters follow it: one per
    ``bucket_us`` of generations (a quarter of the retention), each dropped once none of
    its generations is left in the store (:meth:`forget_expired`, after an expiry
    pass). So memory is flat over a long run: the retained IDs and at most one bucket
    more, with no rebuild while the range runs. Before this, one scalable filter held up
    to twice the retained IDs and was rebuilt from the store whenever half of it had
    expired: a worker's memory stepped up by the filter's doubling (issue 31's 20-minute
    soak: +57 MB) and each rebuild re-read every retained ID.

    A rebuild (when a worker takes the range) streams the store's IDs page by page
    (:data:`~millwheel.state.protocol.ID_PAGE` at a time), so it never holds a range's
    IDs as Python objects at once: at the default retention of an hour that was
    millions of strings, a transient of ~120 bytes per ID that the allocator then kept
    (docs/service.md, "Memory"). IDs written before generations existed (Redis) go into
    a filter of their own, dropped once an expiry pass has passed the rebuild's time:
    every one of them was consumed before it. Dropping a filter early would let a
    duplicate through, so a filter goes only when the store says its generations are
    gone; a filter kept late costs only memory (a maybe-hit is confirmed against the
    store). ``remember`` and ``forget_expired`` are called by the range's owner, one at
    a time (the range's lock), after the checkpoint they follow committed.
    """

    def __init__(self, store: StateStore, computation: str, range_id: int,
                 bucket_us: int = 15 * 60_000_000, now_us: Callable[[], int] | None = None) -> None:
        self._store = store
        self._computation = computation
        self._range_id = range_id
        self._bucket_us = max(1, bucket_us)
        self._now_us = now_us
        self.store_lookups = 0
        self.rebuilds = 0
        self._buckets: dict[int | None, _Bucket] = {}
        self._legacy_before: int | None = None  # pre-generation IDs: all consumed before this
        self._last_count = 0  # IDs in the newest bucket filled: the next one's first size
        self.rebuild()

    @property
    def held(self) -> int:
        """IDs in the filters (some may have expired from the store since)."""
        return sum(b.count for b in self._buckets.values())

    @property
    def filters(self) -> int:
        return len(self._buckets)

    def _bucket_of(self, generation: int | None) -> int | None:
        return None if generation is None else generation - generation % self._bucket_us

    def _add(self, generation: int | None, ids: Sequence[str]) -> None:
        key = self._bucket_of(generation)
        bucket = self._buckets.get(key)
        if bucket is None:
            capacity = max(10_000, self._last_count + self._last_count // 4) if self._last_count else 100_000
            bucket = self._buckets[key] = _Bucket(capacity)
        bucket.add(generation, ids)
        if key is not None and key >= max((k for k in self._buckets if k is not None), default=key):
            self._last_count = max(self._last_count, bucket.count)

    def rebuild(self) -> None:
        """Fresh filters from every ID the store retains, a page at a time."""
        self._buckets, self._last_count, self._legacy_before = {}, 0, None
        # Without a clock the pre-generation filter stays until the next rebuild.
        started = self._now_us() if self._now_us is not None else None
        for generation, page in self._store.iter_id_generations(self._computation, self._range_id):
            if generation is None:
                self._legacy_before = started
            self._add(generation, page)
        self.rebuilds += 1

    def forget_expired(self, older_than_us: int) -> None:
        """The store has just forgotten its generations older than ``older_than_us``:
        drop each filter none of whose generations the store still holds."""
        live: set[int | None] = set(self._store.id_generations(self._computation, self._range_id))
        if self._legacy_before is None or older_than_us <= self._legacy_before:
            live.add(None)  # pre-generation IDs may still be in the store
        for key in [k for k, b in self._buckets.items() if not (b.generations & live)]:
            del self._buckets[key]

    def seen(self, record_ids: Sequence[str]) -> set[str]:
        """The IDs of ``record_ids`` that were already consumed (checkpointed)."""
        buckets = list(self._buckets.values())
        if len(buckets) == 1:
            maybe = buckets[0].bloom.maybe_seen(record_ids)
        else:
            found: set[str] = set()
            for b in buckets:
                found.update(b.bloom.maybe_seen(record_ids))
            maybe = list(found)
        if not maybe:
            return set()
        self.store_lookups += 1
        return self._store.contains_ids(self._computation, self._range_id, maybe)

    def remember(self, record_ids: Sequence[str], generation: int) -> None:
        """Add IDs to the filter of ``generation`` (the checkpoint's
        ``ids_generation``); call only after their checkpoint committed."""
        if record_ids:
            self._add(generation, record_ids)
