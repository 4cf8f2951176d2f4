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

**Taking.** A sender that keeps several slices in flight takes entries with
:meth:`Outbox.take` (oldest first, skipping those taken and not yet released or acked)
and gives back what it did not deliver with :meth:`Outbox.release`. The entries not
taken are kept apart, in checkpoint order (a queue of entries never taken, and a heap
of released ones by their place in that order, every one older than the queue's), so a take does not walk past the
entries in flight: with 20,000 in flight, walking them was a tenth of the injector
owner's time (docs/bench.md, "Speed round 3"). A take returns exactly what a walk of
the outbox in checkpoint order, skipping the entries in flight, would.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Collection, Iterable, Sequence

from millwheel.record import MAX_TIMESTAMP
from millwheel.state.protocol import Production, StateStore

Unit = tuple[str, int]  # (consumer, key range): where an entry goes
UnitOf = Callable[[Production], Unit]
Entry = tuple[str, str]  # (consumer, record id)


@dataclass
class Parked:
    """A parked unit's share: entries in the store alone, and its entries still in memory."""

    stored: int = 0
    low: int = MAX_TIMESTAMP  # the oldest timestamp among ``stored``
    in_memory: int = 0


class Outbox:
    #: stale copies in the queue of entries not taken past which it is renumbered (:meth:`_renumber`)
    renumber_slack = 4096

    def __init__(self, store: StateStore, node: str, range_id: int) -> None:
        self._store = store
        self._node = node
        self._range_id = range_id
        self._entries: dict[Entry, Production] = {}
        # Taking (module docstring): entries never taken wait in ``_fresh``, in checkpoint
        # order; a taken one gets a number as it leaves it (so numbers follow that
        # order), kept in ``_taken`` while it is in flight and in the heap ``_back`` once
        # released; entries a take passed over (``skip``) wait in ``_front``, in order.
        # Entries acked or parked meanwhile are dropped from those lazily.
        self._seq = 0
        self._fresh: deque[Entry] = deque()
        self._back: list[tuple[int, Entry]] = []
        self._front: deque[tuple[int, Entry]] = deque()
        self._taken: dict[Entry, int] = {}
        self._hold: int | None = None
        self._oldest: Production | None = None  # an entry at ``_hold`` (:meth:`oldest`)
        self._parked: dict[Unit, Parked] = {}
        self._stored = 0  # sum of the parked units' ``stored``
        self._unit_of: UnitOf | None = None
        self._remember(store.read_outbox(node, range_id))

    def _remember(self, productions: Iterable[Production]) -> None:
        """Into memory, after every entry there (and not taken yet)."""
        entries, fresh = self._entries, self._fresh
        for p in productions:
            key = (p.consumer, p.record.record_id)
            entries[key] = p
            fresh.append(key)

    def _renumber(self) -> None:
        """Drop the stale copies from the queue and the heap of entries not taken (an
        outbox nobody takes from, local mode's, would otherwise keep one per entry
        ever added); what is left keeps its order."""
        entries, taken = self._entries, self._taken
        seen: set[Entry] = set()
        fresh: deque[Entry] = deque()
        for k in self._fresh:
            if k in entries and k not in taken and k not in seen:
                seen.add(k)
                fresh.append(k)
        self._fresh = fresh
        self._back = [i for i in self._back if i[1] in entries and i[1] not in taken]
        heapq.heapify(self._back)
        self._front = deque(i for i in self._front if i[1] in entries and i[1] not in taken)

    def __len__(self) -> int:
        """Every pending entry, parked ones too."""
        return len(self._entries) + self._stored

    def in_memory(self) -> int:
        return len(self._entries)

    @property
    def parked(self) -> dict[Unit, Parked]:
        return self._parked

    def add(self, productions: Iterable[Production]) -> None:
        entries, fresh = self._entries, self._fresh
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
            key = (p.consumer, p.record.record_id)
            entries[key] = p
            fresh.append(key)
            if p.record.timestamp < low:
                low = p.record.timestamp
        if len(fresh) > 2 * len(entries) + self.renumber_slack:  # never taken (local mode), or stale copies
            self._renumber()
        if self._hold is not None and low < self._hold:  # the minimum only falls on add
            self._hold = low

    def pending(self, limit: int) -> list[Production]:
        """Up to ``limit`` entries in memory, oldest checkpoint first."""
        return list(islice(self._entries.values(), max(limit, 1)))

    def taken(self) -> int:
        """Entries taken and neither released nor acked yet (in flight)."""
        return len(self._taken)

    def take(self, limit: int, skip: Callable[[Production], bool] | None = None) -> list[Production]:
        """Up to ``limit`` entries in memory not taken yet, oldest checkpoint first, now
        taken (until :meth:`release` or :meth:`ack`); with ``skip``, entries it is true
        for are passed over and stay where they are."""
        entries, fresh, back, front, taken = self._entries, self._fresh, self._back, self._front, self._taken
        out: list[Production] = []
        passed: list[tuple[int, Entry]] = []
        seq = self._seq
        while len(out) < limit:
            if front and (not back or front[0][0] < back[0][0]):
                n, key = front.popleft()
            elif back:  # released: older than any entry never taken
                n, key = heapq.heappop(back)
            elif fresh:
                key = fresh.popleft()
                n = -1
            else:
                break
            p = entries.get(key)
            if p is None or key in taken:  # acked or parked meanwhile; or a stale copy
                continue
            if n < 0:
                seq += 1
                n = seq
            if skip is not None and skip(p):
                passed.append((n, key))
                continue
            taken[key] = n
            out.append(p)
        self._seq = seq
        if passed:  # older than every entry not met yet: first in line again
            front.extendleft(reversed(passed))
        return out

    def release(self, keys: Iterable[Entry]) -> None:
        """Taken entries not delivered: taken again, in their place, by a later take."""
        taken, back = self._taken, self._back
        for key in keys:
            seq = taken.pop(key, None)
            if seq is not None and key in self._entries:
                heapq.heappush(back, (seq, key))

    def release_all(self) -> None:
        """Every taken entry not delivered (the sender forgot its slices)."""
        self.release(list(self._taken))

    def ack(self, token: int, acked: Sequence[tuple[str, str]]) -> None:
        """Consumers checkpointed these entries: delete them, fenced by ``token``."""
        if not acked:
            return
        self._store.ack(self._node, self._range_id, token, acked)
        pop = self._entries.pop
        untake = self._taken.pop
        hold = self._hold
        parked, unit_of = self._parked, self._unit_of
        for entry in acked:
            untake(entry, None)
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

    def oldest(self) -> Production | None:
        """An entry in memory at :meth:`hold`, to name what holds the watermark; None
        when the outbox is empty or a parked unit's entries in the store hold it. Found
        by a walk in checkpoint order that stops at the first entry with that timestamp
        (the oldest timestamp is usually near the front), kept until acked or passed."""
        hold = self.hold()
        if hold == MAX_TIMESTAMP or hold != self._hold:
            return None
        p = self._oldest
        if p is None or p.record.timestamp != hold or (p.consumer, p.record.record_id) not in self._entries:
            p = next((e for e in self._entries.values() if e.record.timestamp == hold), None)
            self._oldest = p
        return p

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
            self._taken.pop(key, None)
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
        self._remember(back)
        if back:
            self._hold = None
        return len(back)
