"""The local runner's writes of one step, applied as one transaction at its end.

Inside :meth:`GroupedStore.deferring` (the runner's step) the writes the synchronous
runner makes one transaction each (injector checkpoint, range checkpoints, acks,
stream-log appends, watermark reports) are held, in order, and applied at the end of
the step (or before any read of the store) in one transaction of the store's
``write_group``, all or none of them.

Why it is safe: the writes are applied in the order the synchronous runner made them,
each still fenced by its own token; if one fails, the whole group is rolled back
and the error raised to the runner. So the store always
holds a prefix of the synchronous runner's sequence of transactions, at a coarser
grain: what a kill -9 of that runner at some earlier point leaves, from which a
restarted runner recovers (ARCHITECTURE.md). A crash mid-step loses the step's writes,
as a crash before its first write would.

Why it is faster (docs/bench.md, "Speed round 2"): one commit per step instead of one
per write, and an outbox entry written by a checkpoint and acked later in the same
group is neither inserted nor deleted: the group's result is the same (the row never
outlives the transaction), the b-tree work is not. In local mode every production is
delivered and acked within the step that made it, so the outbox costs nothing unless a
step ends before its entries are acked. Only a store with ``write_group`` (SQLite; one
Redis node, millwheel/state/redis_group.py) is deferred: elsewhere (Redis Cluster)
writes are applied at once, as before. Because of that cancellation a group must be
applied whole or not at all, not merely stop at its first failing write: the producer's
checkpoint without its dropped entry must never be stored without the consumer's.

A held checkpoint costs its range nothing until the flush, so the checkpoint time the
range reports to its Sensors is that of handing it over; the store's time is the step's.

What the runner reads must include what it wrote: every read first applies the held
writes, except :meth:`GroupedStore.contains_ids` (the dedup confirmation on a Bloom
maybe-hit), which answers from the held checkpoints' IDs plus the store.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, Callable, ContextManager, Iterator, Sequence

from millwheel.record import Record
from millwheel.state.protocol import Checkpoint, StateStore

_Ack = tuple[str, int, int, Sequence[tuple[str, str]]]  # producer, range, token, entries


def held_ids(items: Sequence[object], computation: str, range_id: int, ids: Sequence[str],
             found: set[str]) -> None:
    """Add to ``found`` the IDs among ``ids`` that checkpoints of range ``range_id`` of
    ``computation`` in ``items`` (held or in flight, not yet in the store) consume."""
    if not items:
        return
    wanted = set(ids)
    for item in items:
        if type(item) is Checkpoint and item.computation == computation and item.range_id == range_id:
            found.update(wanted.intersection(item.consumed_ids))


class GroupedStore:
    """A :class:`~millwheel.state.protocol.StateStore` whose writes are held while
    :meth:`deferring` is open and applied together by :meth:`flush`. Every other method
    flushes, then calls the wrapped store."""

    def __init__(self, store: StateStore) -> None:
        self.inner = store
        self.url = store.url
        group: Callable[[], ContextManager[None]] | None = getattr(store, "write_group", None)
        self._group = group
        self._deferring = False
        # Held writes in order: a Checkpoint, an ack, or any other write (a callable).
        self._held: list[Checkpoint | _Ack | Callable[[], object]] = []
        self.cancelled = 0  # outbox entries neither inserted nor deleted (a sensor for tests)

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Hold writes inside the block (if the store can group them). On an exception
        the held writes are applied first (a simulated crash then leaves what a crash
        at that point of the synchronous runner leaves), and the exception propagates."""
        outer = self._deferring
        self._deferring = self._group is not None
        try:
            yield
        except BaseException:
            self._deferring = outer
            try:
                self.flush()
            except BaseException:  # noqa: BLE001 - the first exception is the one to see
                pass
            raise
        self._deferring = outer

    def submit(self, job: Callable[[], object]) -> None:
        """Apply the write ``job`` after those held before it (at once if not deferring)."""
        if self._deferring:
            self._held.append(job)
        else:
            self.flush()
            job()

    def end_step(self) -> None:
        """The runner's step ends: apply its writes (a writer process only hands them over)."""
        self.flush()

    def flush(self) -> None:
        """Apply every held write in one transaction; if one fails, none is applied
        and its error is raised."""
        if not self._held:
            return
        held, self._held = self._held, []
        self._apply(self._cancel_acked(held))

    def _apply(self, items: list[Checkpoint | _Ack | Callable[[], object]]) -> None:
        """``items`` (acked outbox entries already cancelled) in one transaction of the
        store's write group, here."""
        assert self._group is not None
        with self._group():
            for job in self._as_calls(items):
                job()

    def _as_calls(self, held: list[Checkpoint | _Ack | Callable[[], object]]) -> list[Callable[[], object]]:
        """The held writes as calls on the wrapped store."""
        inner = self.inner
        return [partial(inner.checkpoint, item) if type(item) is Checkpoint
                else partial(inner.ack, *item) if type(item) is tuple
                else item for item in held]  # type: ignore[misc]

    def _cancel_acked(
        self, held: list[Checkpoint | _Ack | Callable[[], object]]
    ) -> list[Checkpoint | _Ack | Callable[[], object]]:
        """The held writes minus outbox entries both written and acked here."""
        # (producer, range) -> {(consumer, record ID): index of the checkpoint writing it}
        written: dict[tuple[str, int], dict[tuple[str, str], int]] = {}
        for i, item in enumerate(held):
            if type(item) is Checkpoint and item.productions:
                entries = written.setdefault((item.computation, item.range_id), {})
                entries.update(dict.fromkeys([(p.consumer, p.record.record_id) for p in item.productions], i))
        drop: dict[int, set[tuple[str, str]]] = {}
        acks: dict[int, _Ack] = {}
        for i, item in enumerate(held):
            if type(item) is tuple and written:
                producer, range_id, token, acked = item
                mine = written.get((producer, range_id))
                if not mine:
                    continue
                kept = []
                for entry in acked:
                    j = mine.get(entry)
                    if j is not None and j < i:
                        drop.setdefault(j, set()).add(entry)
                    else:
                        kept.append(entry)
                if len(kept) < len(acked):
                    acks[i] = (producer, range_id, token, kept)
        out: list[Checkpoint | _Ack | Callable[[], object]] = []
        for i, item in enumerate(held):
            if type(item) is Checkpoint:
                gone = drop.get(i)
                if gone:
                    self.cancelled += len(gone)
                    kept_p = [] if len(gone) == len(item.productions) else [
                        p for p in item.productions if (p.consumer, p.record.record_id) not in gone]
                    item = replace(item, productions=kept_p)
                out.append(item)
            elif type(item) is tuple:  # an ack; with no entries left it still checks the fence
                out.append(acks.get(i, item))
            else:
                out.append(item)
        return out

    # -- the held writes -----------------------------------------------------------
    def checkpoint(self, cp: Checkpoint) -> None:
        if self._deferring:
            self._held.append(cp)
        else:
            self.flush()
            self.inner.checkpoint(cp)

    def ack(self, producer: str, range_id: int, token: int, acked: Sequence[tuple[str, str]]) -> None:
        if self._deferring:
            self._held.append((producer, range_id, token, acked))
        else:
            self.flush()
            self.inner.ack(producer, range_id, token, acked)

    def append_log(self, stream: str, records: Sequence[Record]) -> int:
        """The number of records new to the log; 0 when held (not known yet)."""
        if not self._deferring:
            self.flush()
            return self.inner.append_log(stream, records)
        self._held.append(partial(self.inner.append_log, stream, records))
        return 0

    # -- reads ---------------------------------------------------------------------
    def contains_ids(self, computation: str, range_id: int, ids: Sequence[str]) -> set[str]:
        """Consumed IDs among ``ids``: the store's plus those of held checkpoints."""
        found = self.inner.contains_ids(computation, range_id, ids)
        held_ids(self._held, computation, range_id, ids, found)
        return found

    def close(self) -> None:
        self.flush()
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.flush()
            return attr(*args, **kwargs)

        return call
