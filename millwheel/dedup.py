"""Record-ID deduplication for exactly-once (ARCHITECTURE.md step 1).

A scalable Bloom filter (pybloom-live) answers most lookups in memory: a miss means
"certainly new". A maybe-hit is confirmed against the store in one round trip for the
whole batch. The filter is rebuilt from the store's retained IDs when a worker takes
a range, and rebuilt again after expiry so forgotten IDs stop costing lookups.
"""

from __future__ import annotations

from typing import Sequence

from pybloom_live import ScalableBloomFilter

from millwheel.state.protocol import StateStore


class Deduplicator:
    def __init__(self, store: StateStore, computation: str, range_id: int) -> None:
        self._store = store
        self._computation = computation
        self._range_id = range_id
        self.store_lookups = 0
        self.rebuild()

    def rebuild(self) -> None:
        self._bloom = ScalableBloomFilter(
            initial_capacity=100_000, error_rate=0.001, mode=ScalableBloomFilter.SMALL_SET_GROWTH
        )
        for record_id in self._store.iter_ids(self._computation, self._range_id):
            self._bloom.add(record_id)

    def seen(self, record_ids: Sequence[str]) -> set[str]:
        """The IDs of ``record_ids`` that were already consumed (checkpointed)."""
        maybe = [rid for rid in record_ids if rid in self._bloom]
        if not maybe:
            return set()
        self.store_lookups += 1
        return self._store.contains_ids(self._computation, self._range_id, maybe)

    def remember(self, record_ids: Sequence[str]) -> None:
        """Add IDs to the filter; call only after their checkpoint committed."""
        for rid in record_ids:
            self._bloom.add(rid)
