"""The ``ctx`` user code sees, and the per-batch transaction it writes into.

A :class:`RangeTransaction` collects everything one batch of one key range does —
state writes, timer changes, productions, consumed IDs — and becomes exactly one
:class:`~millwheel.state.protocol.Checkpoint`. User code never touches the store.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from millwheel.errors import InvalidSpecError, ResourceLimitError
from millwheel.limits import MAX_STATE_BYTES, MAX_TIMER_TIME, MIN_TIMER_TIME
from millwheel.record import Record, TimeDomain, Timer, derive_record_id, well_formed
from millwheel.runtime import ttl
from millwheel.runtime.routing import Router, record_of
from millwheel.state.protocol import Checkpoint, Production


class RangeOwner(ttl.TTLWorker, Protocol):
    """What a transaction and ``ctx`` use of the worker of their key range.

    :class:`~millwheel.runtime.range_worker.RangeWorker` satisfies it. It is declared
    here, below the worker, so this module needs nothing of range_worker (which builds
    transactions and contexts, and so imports this one)."""

    @property
    def name(self) -> str: ...

    @property
    def range_id(self) -> int: ...

    @property
    def state_ttl_us(self) -> int | None: ...

    @property
    def outputs(self) -> frozenset[str]: ...

    def ids_generation(self, now_us: int) -> int: ...

    @property
    def router(self) -> Router: ...

    def get_state(self, key: str) -> bytes | None: ...

    def read_buffer(self, name: str) -> list[bytes]: ...

    def list_buffers(self) -> list[str]: ...


class RangeTransaction:
    def __init__(self, worker: RangeOwner) -> None:
        self.worker = worker
        self.state_writes: dict[str, bytes | None] = {}
        self.timer_ops: dict[tuple[str, str], Timer | None] = {}
        self.productions: list[Production] = []
        self.consumed_ids: list[str] = []
        self.records_in = 0
        self.records_out = 0
        # The error policy's part (millwheel.runtime.poison): see Checkpoint.
        self.resolved: list[str] = []
        self.counters: dict[str, int] = {}
        self.errors: list[bytes] = []
        self.given_up_timers: list[Timer] = []
        self.timers_run: list[Timer] = []
        self.expired = 0  # keys whose state its TTL deleted (millwheel.runtime.ttl)
        # Window buffers: chunks per buffer, joined into one append per buffer per
        # checkpoint (a row per batch, not per record); deletes apply after them.
        self.buffer_appends: dict[str, list[bytes]] = {}
        self.buffer_deletes: list[str] = []
        # A timer batch that holds every due timer (not cut short by its limit).
        self.all_due_fired = False

    def to_checkpoint(self, token: int, now_us: int, include_productions: bool) -> Checkpoint:
        w = self.worker
        return Checkpoint(
            computation=w.name,
            range_id=w.range_id,
            token=token,
            now_us=now_us,
            state_writes=self.state_writes,
            timer_sets=[t for t in self.timer_ops.values() if t is not None],
            timer_clears=[k for k, t in self.timer_ops.items() if t is None],
            productions=self.productions if include_productions else [],
            consumed_ids=self.consumed_ids,
            resolved=self.resolved,
            counters=self.counters,
            errors=self.errors,
            buffer_appends=[(n, b"".join(c)) for n, c in self.buffer_appends.items()],
            buffer_deletes=self.buffer_deletes,
            ids_generation=w.ids_generation(now_us),
        )


class KeyContext:
    """``ctx`` for one record or timer of one key."""

    def __init__(
        self, txn: RangeTransaction, key: str, cause: str, input_watermark: int, is_late: bool
    ) -> None:
        self._txn = txn
        self._key = key
        self._cause = cause
        self._input_watermark = input_watermark
        self._is_late = is_late
        self._produced = 0

    @property
    def key(self) -> str:
        return self._key

    @property
    def cause(self) -> str:
        """The record ID (or timer identity) productions are derived from right now."""
        return self._cause

    def _focus(self, record: Record) -> None:
        """Make ``record`` the one being processed (the batch hook's iteration).

        The count of records produced restarts only with a new cause, so what the hook
        produced before its loop (caused by the first record) keeps its IDs unique."""
        if record.record_id != self._cause:
            self._cause = record.record_id
            self._produced = 0
        self._is_late = record.timestamp < self._input_watermark

    @property
    def state(self) -> bytes | None:
        return self._txn.worker.get_state(self._key)

    def set_state(self, value: bytes | None) -> None:
        if value is not None and not isinstance(value, bytes):
            raise InvalidSpecError(
                f"computation {self._txn.worker.name!r} key {self._key!r}: state must be bytes "
                f"or None, got {type(value).__name__}"
            )
        if value is not None and len(value) > MAX_STATE_BYTES:  # refused here, not by a store or savepoint later
            raise ResourceLimitError(
                f"computation {self._txn.worker.name!r} key {self._key!r}: state of {len(value)} bytes, "
                f"over the limit of {MAX_STATE_BYTES} bytes one key's state may hold")
        worker = self._txn.worker
        worker.put_state(self._key, value)
        self._txn.state_writes[self._key] = value
        if worker.state_ttl_us is not None:
            ttl.after_write(self._txn, self._key, value, worker.state_ttl_us)

    def set_timer(
        self, tag: str, time: int, domain: TimeDomain = TimeDomain.EVENT, *, hold: bool = True
    ) -> None:
        if isinstance(time, bool) or not isinstance(time, int):
            raise InvalidSpecError(
                f"computation {self._txn.worker.name!r} key {self._key!r}: timer {tag!r} "
                f"time must be integer microseconds, got {type(time).__name__}"
            )
        if not MIN_TIMER_TIME <= time <= MAX_TIMER_TIME:  # the stores keep an int64
            raise InvalidSpecError(
                f"computation {self._txn.worker.name!r} key {self._key!r}: timer {tag!r} "
                f"time {time} is outside the int64 range the stores keep")
        ttl.check_user_tag(self._txn.worker.name, self._key, tag)
        timer = Timer(self._key, tag, time, TimeDomain(domain), hold)
        self._txn.worker.timers.set(timer)
        self._txn.timer_ops[(self._key, tag)] = timer

    def clear_timer(self, tag: str) -> None:
        ttl.check_user_tag(self._txn.worker.name, self._key, tag)
        self._txn.worker.timers.clear(self._key, tag)
        self._txn.timer_ops[(self._key, tag)] = None

    def produce(self, stream: str, key: str, value: bytes, timestamp: int) -> None:
        worker = self._txn.worker
        if stream not in worker.outputs:
            raise InvalidSpecError(
                f"computation {worker.name!r} produced to {stream!r}, which is not one of its "
                f"output streams {sorted(worker.outputs)}"
            )
        record = record_of(key, value, timestamp, derive_record_id(worker.name, self._cause, self._produced))
        if not well_formed(key, value, timestamp, record.record_id):  # else say what is wrong
            record.validate(f"computation {worker.name!r} production to {stream!r}")
        self._produced += 1
        self._txn.records_out += 1
        self._txn.productions.extend(worker.router.fan_out(stream, record))

    # -- the range's window buffers (millwheel.spark.stage) ---------------------------
    def append_buffer(self, name: str, chunk: bytes) -> None:
        """Append ``chunk`` to the range's buffer ``name`` in this checkpoint."""
        if not isinstance(chunk, bytes) or not isinstance(name, str):
            raise InvalidSpecError(
                f"computation {self._txn.worker.name!r}: a buffer name is a str and a chunk bytes")
        pending = self._txn.buffer_appends.get(name)
        if pending is None:
            self._txn.buffer_appends[name] = [chunk]
        else:
            pending.append(chunk)

    def read_buffer(self, name: str) -> list[bytes]:
        """The buffer's chunks: as checkpointed, then this transaction's appends."""
        return self._txn.worker.read_buffer(name) + self._txn.buffer_appends.get(name, [])

    def list_buffers(self) -> list[str]:
        return sorted(set(self._txn.worker.list_buffers()) | set(self._txn.buffer_appends))

    @property
    def all_due_timers_fired(self) -> bool:
        """In a timer batch: True if it holds every timer due now (none was left for a
        later batch by the batch limit), so nothing due now runs after it."""
        return self._txn.all_due_fired

    def delete_buffer(self, name: str) -> None:
        """Remove the buffer (its checkpointed chunks and this transaction's) at commit."""
        self._txn.buffer_appends.pop(name, None)
        self._txn.buffer_deletes.append(name)

    @property
    def input_watermark(self) -> int:
        return self._input_watermark

    @property
    def is_late(self) -> bool:
        return self._is_late

    @property
    def processing_time(self) -> int:
        return self._txn.worker.clock.now_us()


class KeyRecords:
    """One key's records of a batch, for the ``process_records(ctx, records)`` hook.

    The first iteration moves ``ctx`` to each record in turn, so ``ctx.is_late`` and
    the IDs of records produced while handling it are exactly those ``process_record``
    would have had: derived from that record's ID, hence the same whatever the batch.
    Later iterations leave ``ctx`` on the last record (IDs stay unique).
    """

    __slots__ = ("_ctx", "_records", "_iterated")

    def __init__(self, ctx: KeyContext, records: Sequence[Record]) -> None:
        self._ctx = ctx
        self._records = records
        self._iterated = False

    def __len__(self) -> int:
        return len(self._records)

    def timestamps(self) -> list[int]:
        """The records' timestamps, in order, without moving ``ctx`` to each record: for
        code that produces nothing per record (a built-in count needs only these)."""
        return [r.timestamp for r in self._records]

    def __iter__(self) -> Iterator[Record]:
        if self._iterated:
            yield from self._records
            return
        self._iterated = True
        focus = self._ctx._focus
        for record in self._records:
            focus(record)
            yield record
