"""Record-ID deduplication for exactly-once (ARCHITECTURE.md step 1).

A scalable Bloom filter answers most lookups in memory: a miss means "certainly new".
A maybe-hit is confirmed against the store in one round trip for the whole batch.
The filter is rebuilt from the store's retained IDs when a worker takes a range, and
rebuilt again once half of what it holds has expired (see :class:`Deduplicator`).

The filter is rbloom's (Rust): adds and lookups were a quarter of the three-stage
pipeline's CPU with pybloom-live (see docs/bench.md). It is never persisted, only
rebuilt from the store in the process that uses it, so rbloom's default hash
(Python's per-process ``hash``) is safe here.
"""

from __future__ import annotations

from typing import Sequence

from rbloom import Bloom

from millwheel.state.protocol import ID_PAGE, StateStore


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


class Deduplicator:
    """A range's record-ID filter over the store's retained IDs.

    Its memory is bounded twice over. A rebuild streams the store's IDs into a fresh
    filter page by page (:data:`~millwheel.state.protocol.ID_PAGE` at a time), so it
    never holds a range's IDs as Python objects at once: at the default retention of
    an hour that was millions of strings, a transient of ~120 bytes per ID that the
    allocator then kept (docs/service.md, "Memory"). And the filter is rebuilt only
    once at least half of what it holds has expired from the store, so it holds at
    most twice the retained IDs, and it is rebuilt about once per retention period
    instead of after every expiry pass (every minute). IDs expired but still in the
    filter cost nothing in correctness: a maybe-hit is confirmed against the store.
    """

    def __init__(self, store: StateStore, computation: str, range_id: int) -> None:
        self._store = store
        self._computation = computation
        self._range_id = range_id
        self.store_lookups = 0
        self.rebuilds = 0
        self.held = 0  # IDs added to the filter since it was built (some may have expired since)
        self._expired = 0  # of those, how many the store has forgotten
        self.rebuild()

    def rebuild(self) -> None:
        bloom = ScalableBloom(initial_capacity=100_000, error_rate=0.001)
        held = 0
        page: list[str] = []
        for record_id in self._store.iter_ids(self._computation, self._range_id):
            page.append(record_id)
            if len(page) >= ID_PAGE:
                bloom.update(page)
                held += len(page)
                page = []
        bloom.update(page)
        self._bloom, self.held, self._expired = bloom, held + len(page), 0
        self.rebuilds += 1

    def expired(self, count: int) -> None:
        """The store forgot ``count`` of this range's IDs (past the retention): rebuild
        the filter once at least half of what it holds is gone."""
        self._expired += count
        if count and self._expired * 2 >= self.held:
            self.rebuild()

    def seen(self, record_ids: Sequence[str]) -> set[str]:
        """The IDs of ``record_ids`` that were already consumed (checkpointed)."""
        maybe = self._bloom.maybe_seen(record_ids)
        if not maybe:
            return set()
        self.store_lookups += 1
        return self._store.contains_ids(self._computation, self._range_id, maybe)

    def remember(self, record_ids: Sequence[str]) -> None:
        """Add IDs to the filter; call only after their checkpoint committed."""
        self._bloom.update(record_ids)
        self.held += len(record_ids)
