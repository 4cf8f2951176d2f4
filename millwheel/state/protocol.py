"""The state store contract every backend implements (SQLite, Redis).

Three ideas carry exactly-once (ARCHITECTURE.md, "Exactly-once delivery" and
"Ownership and zombie writers"):

* **One atomic checkpoint** (:meth:`StateStore.checkpoint`): state writes, timer
  changes, strong productions and the consumed record IDs of a whole batch are
  applied together or not at all.
* **Sequencer tokens**: every write for a key range carries the token its writer
  got from :meth:`StateStore.acquire`; the store applies it only if that token is
  still current, in the same atomic step. Acquiring bumps the token, so the former
  owner (a zombie) has every later write rejected with :class:`FencedError`.
* **Outboxes**: checkpointed productions stay in the producer's outbox until the
  consumer has checkpointed them and the producer :meth:`StateStore.ack`s them.

A backend is chosen by URL in :func:`millwheel.state.open_store`; the contract suite
in ``tests/contract`` runs unchanged against every backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Protocol, Sequence

from millwheel.record import Record, Timer
from millwheel.state.lease import Lease


@dataclass(frozen=True, slots=True)
class Production:
    """A record in a producer's outbox, addressed to one consumer.

    ``consumer`` is a computation name, or ``log:STREAM`` for the durable stream log
    (the sink of streams no computation consumes). ``record.key`` is already the
    consumer's key (its key extractor was applied when the record was produced).
    """

    consumer: str
    stream: str
    record: Record


@dataclass
class Checkpoint:
    """Everything one batch of one key range changed, applied atomically.

    ``state_writes`` maps key -> new bytes, or None to delete the key's state.
    ``timer_clears`` are ``(key, tag)`` pairs. ``consumed_ids`` are the record IDs of
    the batch's input, remembered for deduplication with ``now_us`` as their time.

    The error policy (:mod:`millwheel.runtime.poison`) adds, in the same atomic step:
    ``resolved`` item IDs (records or timers) whose attempt counts are deleted (they
    were finally processed, dead-lettered or skipped), ``counters`` to add to the
    range's error counts (``dead_lettered``, ``skipped``, ``late_dropped``) and
    ``errors`` (JSON, one per given-up item) pushed on the range's recent-error list,
    which keeps the newest :data:`RECENT_ERRORS`.

    Window buffers (:mod:`millwheel.spark.stage`): ``buffer_appends`` are
    ``(name, chunk)`` pairs appended, in order, to the range's append-only buffer
    ``name`` (one row or list entry each: the cost does not depend on what the buffer
    already holds); ``buffer_deletes`` names buffers removed whole, after the appends.
    """

    computation: str
    range_id: int
    token: int
    now_us: int
    state_writes: dict[str, bytes | None] = field(default_factory=dict)
    timer_sets: list[Timer] = field(default_factory=list)
    timer_clears: list[tuple[str, str]] = field(default_factory=list)
    productions: list[Production] = field(default_factory=list)
    consumed_ids: list[str] = field(default_factory=list)
    resolved: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    errors: list[bytes] = field(default_factory=list)
    buffer_appends: list[tuple[str, bytes]] = field(default_factory=list)
    buffer_deletes: list[str] = field(default_factory=list)
    #: The generation ``consumed_ids`` are remembered under: IDs are forgotten a whole
    #: generation at a time, once its newest is past the expiry bound, so a store
    #: deletes key ranges, not one ID at a time. The range worker gives the start of
    #: a span of 1/16 of the retention; None = ``now_us`` (every time its own).
    ids_generation: int | None = None

    def is_empty(self) -> bool:
        return not (
            self.state_writes
            or self.timer_sets
            or self.timer_clears
            or self.productions
            or self.consumed_ids
            or self.resolved
            or self.counters
            or self.errors
            or self.buffer_appends
            or self.buffer_deletes
        )


#: How many given-up errors a range keeps (newest first) for ``DescribeComputation``.
RECENT_ERRORS = 20
#: Consumed record IDs read per round trip by ``iter_ids`` (and added to a Bloom filter
#: per step by a rebuild): ~1 MB of Python objects at a time, whatever the retention.
ID_PAGE = 10_000


@dataclass(frozen=True)
class ErrorReport:
    """What a range's store holds about failing user code (see :class:`Checkpoint`).

    ``attempts`` maps each item (record ID or timer identity) still being retried to
    its attempt count and the JSON of its last error; ``counters`` are the durable
    counts; ``recent`` the JSON of the last given-up errors, newest first."""

    attempts: dict[str, tuple[int, bytes]]
    counters: dict[str, int]
    recent: list[bytes]


class StateStore(Protocol):
    """Durable, token-fenced storage of one millwheel deployment."""

    url: str

    # -- ownership ---------------------------------------------------------------
    def acquire(self, computation: str, range_id: int, epoch: int | None = None) -> int:
        """Atomically bump and return the range's sequencer token (first is 1).

        ``epoch``: the calling controller's leader epoch; the bump is applied only
        while it is current (else :class:`~millwheel.state.lease.LeadershipLostError`)."""
        ...

    def current_token(self, computation: str, range_id: int) -> int:
        """The range's current token; 0 if it was never acquired."""
        ...

    # -- the checkpoint ----------------------------------------------------------
    def checkpoint(self, cp: Checkpoint) -> None:
        """Apply ``cp`` atomically if ``cp.token`` is current, else raise FencedError."""
        ...

    def ack(
        self, producer: str, range_id: int, token: int, acked: Sequence[tuple[str, str]]
    ) -> None:
        """Delete ``(consumer, record_id)`` entries from the producer's outbox (fenced)."""
        ...

    # -- reads for recovery ------------------------------------------------------
    def read_state(
        self, computation: str, keys: Iterable[str], range_id: int | None = None
    ) -> dict[str, bytes]:
        """State of those keys that have any.

        ``range_id``, when the caller knows it (a range worker reading its own keys),
        lets a backend that stores state per key range (Redis) read one place only.
        """
        ...

    def read_timers(self, computation: str, range_id: int) -> list[Timer]: ...

    def read_key_timers(
        self, computation: str, key: str, range_id: int | None = None
    ) -> list[Timer]:
        """The key's timers, earliest first (``range_id`` as in :meth:`read_state`)."""
        ...

    def read_outbox(self, producer: str, range_id: int) -> list[Production]:
        """Pending productions in the order they were checkpointed."""
        ...

    def contains_ids(self, computation: str, range_id: int, ids: Sequence[str]) -> set[str]:
        """The subset of ``ids`` already consumed by the range (confirms Bloom hits)."""
        ...

    def iter_ids(self, computation: str, range_id: int) -> Iterator[str]:
        """Every retained consumed record ID of the range (to rebuild a Bloom filter),
        read from the store :data:`ID_PAGE` at a time as the iterator is consumed, so a
        range's IDs are never all in memory at once. Only the range's owner changes its
        IDs, and it does not while it iterates them."""
        ...

    def iter_id_generations(self, computation: str, range_id: int) -> Iterator[tuple[int | None, list[str]]]:
        """:meth:`iter_ids` a page at a time, each page with the generation its IDs were
        remembered under (``None`` for IDs stored before generations existed), so a
        rebuilt Bloom filter can be split by generation as a live one is."""
        ...

    def id_generations(self, computation: str, range_id: int) -> list[int]:
        """The range's live generations of consumed IDs, oldest first: what
        :meth:`expire_ids` has not forgotten yet."""
        ...

    def expire_ids(self, computation: str, range_id: int, token: int, older_than_us: int) -> int:
        """Forget the consumed IDs of every generation (``Checkpoint.ids_generation``)
        whose newest ID was remembered before ``older_than_us``; returns how many. An ID
        is so kept at least the retention after its last consumption, and at most one
        generation's span longer."""
        ...

    def list_keys(self, computation: str, after: str | None, limit: int) -> list[str]:
        """Keys with state, sorted, strictly after ``after``: a page of at most ``limit``."""
        ...

    # -- append-only window buffers (written by Checkpoint.buffer_appends) -------------
    def read_buffer(self, computation: str, range_id: int, name: str) -> list[bytes]:
        """The chunks appended to the range's buffer ``name``, in append order ([] if
        it has none). Chunks are opaque bytes; the store never parses them."""
        ...

    def list_buffers(self, computation: str, range_id: int) -> list[str]:
        """Names of the range's buffers that hold anything, sorted."""
        ...

    # -- failing user code (the error policy) ----------------------------------------
    def bump_attempts(
        self, computation: str, range_id: int, token: int, item_id: str, error: bytes
    ) -> int:
        """Count one more failed attempt of ``item_id`` (a record ID or timer identity)
        and keep ``error`` as its last error, fenced by ``token``; returns the new
        count. Durable before it returns, so attempts lost to a crash still count."""
        ...

    def read_errors(self, computation: str, range_id: int) -> ErrorReport:
        """Attempt counts, error counters and recent errors of the range."""
        ...

    # -- the durable stream log (sinks, Subscribe, backfill) ---------------------
    def append_log(self, stream: str, records: Sequence[Record]) -> int:
        """Append records not yet in the stream's log (by record ID); returns how many."""
        ...

    def read_log(self, stream: str, after_seq: int, limit: int) -> list[tuple[int, Record]]:
        """Log entries with sequence number > ``after_seq``, in order."""
        ...

    def log_end(self, stream: str, after_seq: int = 0, upto_seq: int | None = None) -> tuple[int, int]:
        """``(last, count)``: the sequence number of the stream's last entry, or of its
        last up to ``upto_seq`` (``after_seq`` if none follows it), and how many entries
        follow ``after_seq`` up to that one. A reader that must stop at what is there
        now (a dead-letter replay, whose own output lands in the log it reads) fixes its
        end with this before it reads."""
        ...

    # -- log retention (millwheel.runtime.retention) ---------------------------------
    def log_stats(self, stream: str, after_seq: int, limit: int) -> tuple[int, int, int]:
        """``(entries, bytes, last sequence number)`` of the first ``limit`` log entries
        after ``after_seq``; ``(0, 0, after_seq)`` if there are none. What retention
        measures, a small batch at a time. An entry's bytes are its size as the backend
        stores it: its key, value and record ID plus a small framing overhead."""
        ...

    def trim_log(self, stream: str, through_seq: int, max_rows: int) -> int:
        """Remove the oldest log entries with sequence number <= ``through_seq``, at most
        ``max_rows`` of them, in one atomic step that also raises :meth:`log_start` to
        the last one removed; returns how many. A removed entry's record ID is
        forgotten with it: the same record appended again is a new entry."""
        ...

    def log_start(self, stream: str) -> int:
        """The sequence number through which retention removed the stream's log (0 if
        nothing was removed): a read after a lower one would miss records, a read after
        it misses none. It never goes back."""
        ...

    # -- watermarks --------------------------------------------------------------
    def report_watermark(self, node: str, range_id: int, token: int, watermark: int) -> int:
        """Store the range's low watermark (fenced, never backwards); returns the stored value."""
        ...

    def read_watermarks(self, node: str) -> dict[int, int]: ...

    # -- small metadata (the service's registry) ---------------------------------
    def put_meta(self, name: str, value: bytes | None, epoch: int | None = None) -> None:
        """Set (None: delete) one metadata entry; with ``epoch``, only while that leader
        epoch is current (checked in the same atomic write). ``lease/`` names are reserved."""
        ...

    def put_metas(self, entries: Mapping[str, bytes | None], epoch: int | None = None) -> None:
        """Set (None: delete) several metadata entries in ONE atomic write: all of them
        or, on any error, none; with ``epoch``, only while that leader epoch is current,
        checked in that same atomic step (as :meth:`put_meta`). ``lease/`` names are
        reserved (the whole call is refused, nothing written). No entries: nothing is
        written, but a stale ``epoch`` is still refused. What lets a large record (the
        controller's registry) be kept as many entries and a change write only those it
        changes, still as one write (services/controller/registry.py)."""
        ...

    def insert_meta(self, name: str, value: bytes) -> bool:
        """Write one metadata entry only if ``name`` holds none, in one atomic step:
        True if this call wrote it, False if an entry was there (left unchanged), so of
        any number of concurrent inserts of one name exactly one wins. An entry already
        holding exactly ``value`` counts as this call's: a call retried after its reply
        was lost still answers True (callers make ``value`` unique to the call, such as
        a fresh token's hash). ``lease/`` names are reserved."""
        ...

    def get_meta(self, name: str) -> bytes | None: ...

    def list_meta(self, prefix: str) -> dict[str, bytes]: ...

    # -- the controller lease (millwheel.state.lease) -------------------------------
    def claim_lease(self, holder: str, ttl_ms: int) -> int | None:
        """Take the lease if free or run out (a new epoch), or extend it if ``holder``
        has it (same epoch); returns the epoch, or None if another controller holds it."""
        ...

    def renew_lease(self, holder: str, epoch: int, ttl_ms: int) -> bool:
        """Extend the lease for ``(holder, epoch)``; False if it changed hands."""
        ...

    def release_lease(self, holder: str, epoch: int) -> None:
        """End the lease now if ``(holder, epoch)`` has it (a clean shutdown: a standby
        takes over without waiting for it to run out). The epoch stays."""
        ...

    def read_lease(self) -> Lease | None:
        """The lease as stored, None if no controller ever held it."""
        ...

    def close(self) -> None: ...
