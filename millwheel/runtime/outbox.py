"""A node's checkpointed productions not yet acked by their consumers.

The outbox is durable in the store (written by checkpoints, deleted by acks); this
mirror answers what to send next and the oldest timestamp still pending, which holds
the node's output watermark (ARCHITECTURE.md, "Low watermarks").
"""

from __future__ import annotations

from itertools import islice
from typing import Iterable, Sequence

from millwheel.record import MAX_TIMESTAMP
from millwheel.state.protocol import Production, StateStore


class Outbox:
    def __init__(self, store: StateStore, node: str, range_id: int) -> None:
        self._store = store
        self._node = node
        self._range_id = range_id
        self._entries: dict[tuple[str, str], Production] = {
            (p.consumer, p.record.record_id): p for p in store.read_outbox(node, range_id)
        }
        self._hold: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, productions: Iterable[Production]) -> None:
        entries = self._entries
        low = MAX_TIMESTAMP
        for p in productions:
            entries[p.consumer, p.record.record_id] = p
            if p.record.timestamp < low:
                low = p.record.timestamp
        if self._hold is not None and low < self._hold:  # the minimum only falls on add
            self._hold = low

    def pending(self, limit: int) -> list[Production]:
        """Up to ``limit`` entries, oldest checkpoint first."""
        return list(islice(self._entries.values(), max(limit, 1)))

    def ack(self, token: int, acked: Sequence[tuple[str, str]]) -> None:
        """Consumers checkpointed these entries: delete them, fenced by ``token``."""
        if not acked:
            return
        self._store.ack(self._node, self._range_id, token, acked)
        pop = self._entries.pop
        hold = self._hold
        for entry in acked:
            p = pop(entry, None)
            if p is not None and hold is not None and p.record.timestamp <= hold:
                hold = None  # the minimum may have left: scan again when asked
        self._hold = hold

    def hold(self) -> int:
        """The oldest pending timestamp (MAX_TIMESTAMP when empty). Kept as entries come
        and go; the outbox is scanned again only after the entry holding it was acked
        (the heartbeat asks for it every period, and the outbox may hold 50,000 entries)."""
        if self._hold is None:
            self._hold = min((p.record.timestamp for p in self._entries.values()), default=MAX_TIMESTAMP)
        return self._hold
