"""A node's checkpointed productions not yet acked by their consumers.

The outbox is durable in the store (written by checkpoints, deleted by acks); this
mirror answers what to send next and the oldest timestamp still pending, which holds
the node's output watermark (ARCHITECTURE.md, "Low watermarks").

**Parking.** A consumer (a "unit": whatever ``unit_of`` maps a production to, the
service's consumer key range) that keeps refusing its deliveries must not keep its
whole share in memory, where it fills the outbox for the other consumers (an
injector's outbox has a limit). :meth:`Outbox.park` lets a unit's share go from the
mirror but for its oldest few entries (retried, to learn when it recovers); its later
entries are counted and go to the store alone, where every entry is anyway until
acked. :meth:`Outbox.unpark_chunk` brings them back, oldest first, a chunk at a time
once the unit acks again. Parked entries still hold the watermark (:meth:`hold`) and
count in ``len()``; :meth:`in_memory` is what the mirror holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Callable, Collection, Iterable, Sequence

from millwheel.record import MAX_TIMESTAMP
from millwheel.state.protocol import Production, StateStore

Unit = tuple[str, int]  # (consumer, key range): where an entry goes
UnitOf = Callable[[Production], Unit]


@dataclass
class Parked:
    """A parked unit's share: entries in the store alone, and its entries still in memory."""

    stored: int = 0
    low: int = MAX_TIMESTAMP  # the oldest timestamp among ``stored``
    in_memory: int = 0


class Outbox:
    def __init__(self, store: StateStore, node: str, range_id: int) -> None:
        self._store = store
        self._node = node
        self._range_id = range_id
        self._entries: dict[tuple[str, str], Production] = {
            (p.consumer, p.record.record_id): p for p in store.read_outbox(node, range_id)
        }
        self._hold: int | None = None
        self._parked: dict[Unit, Parked] = {}
        self._stored = 0  # sum of the parked units' ``stored``
        self._unit_of: UnitOf | None = None

    def __len__(self) -> int:
        """Every pending entry, parked ones too."""
        return len(self._entries) + self._stored

    def in_memory(self) -> int:
        return len(self._entries)

    @property
    def parked(self) -> dict[Unit, Parked]:
        return self._parked

    def add(self, productions: Iterable[Production]) -> None:
        entries = self._entries
        parked, unit_of = self._parked, self._unit_of
        low = MAX_TIMESTAMP
        for p in productions:
            if parked:
                assert unit_of is not None
                share = parked.get(unit_of(p))
                if share is not None:  # checkpointed already: it waits in the store
                    share.stored += 1
                    share.low = min(share.low, p.record.timestamp)
                    self._stored += 1
                    continue
            entries[p.consumer, p.record.record_id] = p
            if p.record.timestamp < low:
                low = p.record.timestamp
        if self._hold is not None and low < self._hold:  # the minimum only falls on add
            self._hold = low

    def pending(self, limit: int) -> list[Production]:
        """Up to ``limit`` entries in memory, oldest checkpoint first."""
        return list(islice(self._entries.values(), max(limit, 1)))

    def ack(self, token: int, acked: Sequence[tuple[str, str]]) -> None:
        """Consumers checkpointed these entries: delete them, fenced by ``token``."""
        if not acked:
            return
        self._store.ack(self._node, self._range_id, token, acked)
        pop = self._entries.pop
        hold = self._hold
        parked, unit_of = self._parked, self._unit_of
        for entry in acked:
            p = pop(entry, None)
            if p is None:
                continue
            if hold is not None and p.record.timestamp <= hold:
                hold = None  # the minimum may have left: scan again when asked
            if parked:
                assert unit_of is not None
                share = parked.get(unit_of(p))
                if share is not None:
                    share.in_memory -= 1
        self._hold = hold

    def hold(self) -> int:
        """The oldest pending timestamp, parked entries included (MAX_TIMESTAMP when
        empty). Kept as entries come and go; the mirror is scanned again only after the
        entry holding it was acked (the heartbeat asks for it every period, and the
        outbox may hold 50,000 entries)."""
        if self._hold is None:
            self._hold = min((p.record.timestamp for p in self._entries.values()), default=MAX_TIMESTAMP)
        if not self._parked:
            return self._hold
        return min(self._hold, min(share.low for share in self._parked.values()))

    # -- parking ------------------------------------------------------------------------
    def park(self, units: Collection[Unit], unit_of: UnitOf, keep: int) -> int:
        """Let every entry of ``units`` but the oldest ``keep`` of each go from memory
        (they stay in the store), and every later one of theirs; returns how many went.
        ``unit_of`` is kept: it must keep mapping an entry to the same unit."""
        self._unit_of = unit_of
        kept: dict[Unit, int] = {}
        gone = 0
        for key, p in list(self._entries.items()):
            unit = unit_of(p)
            if unit not in units:
                continue
            share = self._parked.get(unit)
            if share is None:
                share = self._parked[unit] = Parked()
            if kept.get(unit, 0) < keep:
                kept[unit] = kept.get(unit, 0) + 1
                continue
            del self._entries[key]
            share.stored += 1
            share.low = min(share.low, p.record.timestamp)
            self._stored += 1
            gone += 1
        for unit in units:
            if unit in self._parked:
                self._parked[unit].in_memory = kept.get(unit, 0)
        if gone:
            self._hold = None
        return gone

    def remap(self, unit_of: UnitOf) -> None:
        """Map entries to units with ``unit_of`` from now on (after the units changed:
        each parked unit whose entries map elsewhere now must be unparked first)."""
        self._unit_of = unit_of

    def unpark_chunk(self, unit: Unit, limit: int, unit_of: UnitOf | None = None) -> int:
        """Bring up to ``limit`` of a parked unit's stored entries back into memory,
        oldest first (one read of the store's outbox); the unit is no longer parked once
        none is left. ``unit_of``: the mapping the unit was parked under, if it changed
        since (a consumer registered again with other key ranges). Returns how many came."""
        share = self._parked.get(unit)
        of = unit_of or self._unit_of
        if share is None or of is None:
            return 0
        back: list[Production] = []
        left, low = 0, MAX_TIMESTAMP
        for p in self._store.read_outbox(self._node, self._range_id):
            if p.consumer != unit[0] or (p.consumer, p.record.record_id) in self._entries or of(p) != unit:
                continue
            if len(back) < limit:
                back.append(p)
            else:
                left += 1
                low = min(low, p.record.timestamp)
        self._stored -= share.stored
        if left:
            share.stored, share.low = left, low
            share.in_memory += len(back)
            self._stored += left
        else:
            del self._parked[unit]
        for p in back:
            self._entries[p.consumer, p.record.record_id] = p
        if back:
            self._hold = None
        return len(back)
