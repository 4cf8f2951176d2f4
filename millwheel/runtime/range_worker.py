"""One key range of one computation: dedup, user code, checkpoint (MillWheel §6.1).

A :class:`RangeWorker` is created by whoever takes ownership of the range. Its first
act is to bump the range's sequencer token, so a previous owner still running (a
zombie) has every later write rejected; only then does it read timers, outbox and
record IDs. It keeps hot state in memory (valid because no one else may write the
range while its token is current) and turns each batch into one checkpoint.

Processing a batch, as numbered in ARCHITECTURE.md:

1. Dedup: drop records whose IDs the range already consumed (Bloom filter, confirmed
   in the store on a maybe-hit) and repeats inside the batch.
2. Run user code, serially per key, applying the late-data policy. Code with the
   optional ``process_records(ctx, records)`` hook gets each key's records of the
   batch in one call (its state decoded and encoded once per batch, not per record).
3. Checkpoint atomically: state, timers, strong productions, consumed IDs (fenced).
4. (runner) Ack the sender, who deletes the records from its outbox.
5. (runner) Send this range's outbox downstream; delete each entry once acked.
"""

from __future__ import annotations

import sys
import time
import traceback
from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterable, Sequence

from millwheel import late as late_counts
from millwheel.clock import Clock
from millwheel.computation import Computation
from millwheel.dedup import ID_BUCKETS, Deduplicator
from millwheel.errors import UserCodeError
from millwheel.input_tag import untag
from millwheel.record import MAX_TIMESTAMP, Record, Timer, derive_record_id, event_time, timer_cause
from millwheel.runtime import ttl
from millwheel.runtime.context import KeyContext, KeyRecords, RangeTransaction
from millwheel.runtime.outbox import Outbox
from millwheel.runtime.routing import KEY_ERROR_PREFIX, Router
from millwheel.sensors import Sensors
from millwheel.state.protocol import StateStore
from millwheel.timers import TimerQueue
from millwheel.topology import ComputationSpec, ErrorPolicy, LatePolicy

CrashHook = Callable[[str], None]
Watch = Callable[[Sequence[str]], AbstractContextManager[None]]
MAX_TIMERS_PER_BATCH = 10_000
TRACEBACK_FRAMES = 5  # the last frames of a user-code traceback kept with its error
HELD_REASON_CHARS = 300  # WatermarkReport.held's bound


def _shown(text: str, limit: int = 60) -> str:
    """A key, tag or name quoted, cut to ``limit`` characters (a reason stays one short line)."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def no_crash(point: str) -> None:
    """The crash hook of a real run: crash points are no-ops."""


def records_hook(code: Computation) -> Callable[[KeyContext, KeyRecords], None] | None:
    """``code.process_records`` if it has the per-key batch hook, else None.

    A subclass that overrides ``process_record`` below the class that defines
    ``process_records`` meant its per-record code to run: it gets the per-record path.
    """
    hook = getattr(code, "process_records", None)
    if hook is None:
        return None
    for klass in type(code).__mro__:
        if "process_records" in vars(klass):
            return hook  # type: ignore[no-any-return]
        if "process_record" in vars(klass):
            return None
    return hook  # type: ignore[no-any-return]


def last_frames(exc: BaseException, n: int = TRACEBACK_FRAMES) -> tuple[str, ...]:
    """The last ``n`` frames of ``exc``'s traceback as ``file:line in function: code``."""
    return tuple(
        f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
        for f in traceback.extract_tb(exc.__traceback__)[-n:]
    )


#: Generations of consumed IDs within one retention (see RangeWorker.ids_generation).
ID_GENERATIONS = 16


class RangeWorker:
    def __init__(
        self,
        spec: ComputationSpec,
        range_id: int,
        store: StateStore,
        code: Computation,
        router: Router,
        clock: Clock,
        sensors: Sensors,
        crash: CrashHook = no_crash,
        max_cached_keys: int = 200_000,
        token: int | None = None,
    ) -> None:
        self.spec = spec
        self.state_ttl_us = spec.options.state_ttl_us
        self.name = spec.name
        self.range_id = range_id
        self.outputs = frozenset(spec.all_outputs())
        self.store = store
        self.code = code
        self.router = router
        self.clock = clock
        self.sensors = sensors
        self.crash = crash
        self.max_cached_keys = max_cached_keys
        bind_sensors = getattr(code, "bind_sensors", None)  # e.g. a Spark stage reports jobs
        if bind_sensors is not None:
            bind_sensors(sensors, spec.name)
        # Fence the previous owner before reading anything it may still be writing.
        # A controller that assigns ranges acquires the token itself and passes it in.
        self.token = store.acquire(self.name, range_id) if token is None else token
        self.timers = TimerQueue(store.read_timers(self.name, range_id))
        self.outbox = Outbox(store, self.name, range_id)
        self.dedup = Deduplicator(
            store, self.name, range_id, spec.options.record_id_retention_us // ID_BUCKETS, clock.now_us,
        ) if spec.options.exactly_once else None
        self._records_hook = records_hook(code)
        self._cache: dict[str, bytes | None] = {}
        self._last_expiry = clock.now_us()
        # Items (record IDs, timer identities) with failed attempts not yet resolved,
        # and their counts: an item at max_attempts is given up without running.
        self.failing = {i: n for i, (n, _e) in store.read_errors(self.name, range_id).attempts.items()}
        opts = spec.options
        # Under on_error "fail" nothing is given up: a fixed code must get to run it.
        self.give_up_at = sys.maxsize if opts.on_error is ErrorPolicy.FAIL else opts.max_attempts
        self.fail_until = 0.0  # on_error "fail": no timer firing before this (monotonic)

    def rollback(self) -> None:
        """Forget everything not checkpointed: after user code raised, the state cache and
        timer queue may hold half a batch. The store has the truth (and the attempt
        counts, which another process, e.g. a watchdog, may have bumped)."""
        self._cache.clear()
        self.timers = TimerQueue(self.store.read_timers(self.name, self.range_id))
        self.failing = {
            i: n for i, (n, _e) in self.store.read_errors(self.name, self.range_id).attempts.items()
        }

    # -- state cache ---------------------------------------------------------
    def get_state(self, key: str) -> bytes | None:
        if key not in self._cache:
            self._cache[key] = self.store.read_state(self.name, [key], self.range_id).get(key)
        return self._cache[key]

    def read_buffer(self, name: str) -> list[bytes]:
        return self.store.read_buffer(self.name, self.range_id, name)

    def list_buffers(self) -> list[str]:
        return self.store.list_buffers(self.name, self.range_id)

    def put_state(self, key: str, value: bytes | None) -> None:
        self._cache[key] = value

    def _prefetch(self, keys: Iterable[str]) -> None:
        missing = {k for k in keys if k not in self._cache}
        if missing:
            found = self.store.read_state(self.name, missing, self.range_id)
            for key in missing:
                self._cache[key] = found.get(key)

    # -- steps 1 and 2 -------------------------------------------------------
    def process_records(self, records: Sequence[Record], input_watermark: int,
                        input: str = "") -> RangeTransaction:
        """Steps 1-2 for a batch; nothing is durable until :meth:`commit`. ``input``: the
        stream the records arrived on ("" if not known), what late records are counted
        under (:mod:`millwheel.late`)."""
        txn = RangeTransaction(self)
        fresh, fresh_ids = self._dedup(records)  # 1
        self.crash("after_dedup")
        self.sensors.records_in(self.name, len(fresh))
        hook = self._records_hook
        if hook is None:
            self._prefetch(r.key for r in fresh)
        options = self.spec.options
        late: dict[str, int] | None = None  # action -> count: made for the first late record
        if self.dedup is not None:  # at-least-once remembers no IDs
            txn.consumed_ids = fresh_ids
        txn.records_in = len(fresh)
        by_key: dict[str, list[Record]] = {}
        failing = self.failing
        max_attempts = self.give_up_at
        for record in fresh:  # 2
            if record.key.startswith(KEY_ERROR_PREFIX) or (
                failing and failing.get(record.record_id, 0) >= max_attempts
            ):
                raise self._failed_without_running(record)
            is_late = record.timestamp < input_watermark
            if is_late:
                if late is None:
                    late = {}
                if record.timestamp + options.allowed_lateness_us < input_watermark:
                    if options.late_policy is LatePolicy.DROP:
                        late["dropped"] = late.get("dropped", 0) + 1
                        continue
                    if options.late_policy is LatePolicy.ROUTE:
                        late["routed"] = late.get("routed", 0) + 1
                        self._route_late(txn, record)
                        continue
                late["processed"] = late.get("processed", 0) + 1
            if hook is not None:  # grouped per key, each key's records in arrival order
                same_key = by_key.get(record.key)
                if same_key is None:
                    by_key[record.key] = [record]
                else:
                    same_key.append(record)
                continue
            ctx = KeyContext(txn, record.key, record.record_id, input_watermark, is_late)
            try:
                self.code.process_record(ctx, record)
            except Exception as exc:
                raise self._user_error(record.key, record.record_id, exc) from exc
        if hook is not None:
            self._prefetch(by_key)
            for key, records_of_key in by_key.items():
                first = records_of_key[0]
                ctx = KeyContext(txn, key, first.record_id, input_watermark,
                                 first.timestamp < input_watermark)
                try:
                    hook(ctx, KeyRecords(ctx, records_of_key))
                except Exception as exc:
                    raise self._user_error(key, ctx.cause, exc) from exc
        if late is not None:
            self._count_late(txn, late, input)
        self.crash("after_user_code")
        return txn

    def _count_late(self, txn: RangeTransaction, late: dict[str, int], input: str) -> None:
        """The batch's late records as durable counters of the range, per input and action
        (``late_dropped``, the total dropped, as before), and to the sensors."""
        counters = txn.counters
        for action, n in late.items():
            name = late_counts.counter(action, input)
            counters[name] = counters.get(name, 0) + n
            self.sensors.late_records(self.name, n, late_counts.SENSOR_ACTION[action], input)
        if "dropped" in late:
            counters["late_dropped"] = counters.get("late_dropped", 0) + late["dropped"]

    def _user_error(self, key: str, record_id: str, exc: Exception) -> UserCodeError:
        return UserCodeError(
            f"computation {self.name!r} failed on key {key!r} record "
            f"{record_id}: {exc.__class__.__name__}: {exc}",
            key=key, item_id=record_id, exc_type=exc.__class__.__name__, exc_message=str(exc),
            frames=last_frames(exc),
        )

    def _failed_without_running(self, record: Record) -> UserCodeError:
        """The error of a record the policy gives up on without running user code: its
        key could not be extracted, or it used up its attempts (counted by an earlier
        run, or by a watchdog that killed a run of it)."""
        problem = self.router.key_error(self.name, record)
        if problem is not None:
            key, exc_type, message = problem
            return UserCodeError(
                f"computation {self.name!r} cannot key record {record.record_id}: {exc_type}: {message}",
                key=key, item_id=record.record_id, exc_type=exc_type, exc_message=message, final=True,
            )
        return UserCodeError(
            f"computation {self.name!r} record {record.record_id} of key {record.key!r} used up "
            f"its {self.failing.get(record.record_id, 0)} attempts",
            key=record.key, item_id=record.record_id, exc_type="AttemptsExhausted",
            exc_message="failed in earlier runs (see its last error)", final=True,
        )

    def _dedup(self, records: Sequence[Record]) -> tuple[list[Record], list[str]]:
        """The records not consumed before nor repeated in the batch, and their IDs."""
        ids = [r.record_id for r in records]
        if self.dedup is None:
            return list(records), ids
        seen = self.dedup.seen(ids)
        if not seen and len(set(ids)) == len(ids):  # the usual case: all new
            return list(records), ids
        fresh: list[Record] = []
        fresh_ids: list[str] = []
        batch_ids: set[str] = set()
        for record in records:
            if record.record_id in seen or record.record_id in batch_ids:
                continue
            batch_ids.add(record.record_id)
            fresh.append(record)
            fresh_ids.append(record.record_id)
        self.sensors.duplicates_dropped(self.name, len(records) - len(fresh))
        return fresh, fresh_ids

    def _route_late(self, txn: RangeTransaction, record: Record) -> None:
        stream = self.spec.options.late_stream
        assert stream is not None  # Options.validate guarantees it
        late = Record(
            record.key, untag(record.value)[1], record.timestamp,  # as produced (millwheel.input_tag)
            derive_record_id(self.name, "late\x1f" + record.record_id, 0),
        )
        txn.productions.extend(self.router.fan_out(stream, late))
        txn.records_out += 1

    def fire_timers(
        self, input_watermark: int, limit: int = MAX_TIMERS_PER_BATCH,
        given_up: Callable[[str], bool] | None = None, watch: Watch | None = None,
    ) -> RangeTransaction | None:
        """Step 2 for due timers: event time below the input watermark, processing time
        at or before the clock; in timestamp order, all in one transaction.

        Code with a ``process_timer_batch(items)`` hook gets every due timer of the
        range at once as ``(ctx, timer)`` pairs (a Spark stage runs one job for them).
        Timers whose identity ``given_up`` accepts (or that used up their attempts) are
        cleared without running, listed in ``txn.given_up_timers`` for the error policy
        (a timer that overran its deadline alone is one of them). ``watch(causes)`` wraps
        the user code (the service's deadline, services/worker/watchdog.py).
        """
        txn = RangeTransaction(self)
        now = self.clock.now_us()
        due: list[Timer] = []
        failing, max_attempts = self.failing, self.give_up_at
        while len(due) < limit:
            timer = self.timers.pop_due_event(input_watermark) or self.timers.pop_due_processing(now)
            if timer is None:
                txn.all_due_fired = True
                break
            txn.timer_ops[(timer.key, timer.tag)] = None
            if timer.tag == ttl.TTL_TAG:  # the runtime's own: the key's state expires
                ttl.expire(txn, timer.key)
                continue
            if failing or given_up is not None:
                cause = timer_cause(timer)
                if failing.get(cause, 0) >= max_attempts or (given_up is not None and given_up(cause)):
                    txn.given_up_timers.append(timer)
                    continue
            due.append(timer)
        if not due:
            return txn if txn.given_up_timers or txn.expired else None
        txn.timers_run = due
        self._prefetch(t.key for t in due)
        items = [
            (KeyContext(txn, t.key, timer_cause(t), input_watermark, False), t) for t in due
        ]
        batch_hook = getattr(self.code, "process_timer_batch", None)
        current = due[0] if len(due) == 1 else None  # the timer to blame, when known
        try:
            with watch([timer_cause(t) for t in due]) if watch is not None else nullcontext():
                if batch_hook is not None:
                    batch_hook(items)
                else:
                    for ctx, timer in items:
                        current = timer
                        self.code.process_timer(ctx, timer)
        except Exception as exc:
            blame = current or due[0]
            raise UserCodeError(
                f"computation {self.name!r} failed firing {len(due)} timer(s) of range "
                f"{self.range_id} ({'timer' if current else 'first'}: {blame.tag!r} at "
                f"{blame.time} of key {blame.key!r}): {exc.__class__.__name__}: {exc}",
                key=blame.key, item_id=timer_cause(current) if current else None,
                exc_type=exc.__class__.__name__, exc_message=str(exc), frames=last_frames(exc),
            ) from exc
        self.crash("after_user_code")
        return txn

    # -- step 3 --------------------------------------------------------------
    def commit(self, txn: RangeTransaction, include_productions: bool = True) -> None:
        """Step 3: one atomic, fenced checkpoint; then the in-memory side follows."""
        started = time.perf_counter()
        cp = txn.to_checkpoint(self.token, self.clock.now_us(), include_productions)
        if not cp.is_empty():
            self.store.checkpoint(cp)
        self.sensors.checkpoint(self.name, time.perf_counter() - started, txn.records_in)
        self.sensors.records_out(self.name, txn.records_out)
        if self.dedup is not None:
            self.dedup.remember(txn.consumed_ids, cp.now_us if cp.ids_generation is None else cp.ids_generation)
        if include_productions:
            self.outbox.add(txn.productions)
        if len(self._cache) > self.max_cached_keys:
            self._cache.clear()  # durable already; reloaded lazily
        self.crash("after_checkpoint")

    # -- steps 4 and 5 (called by the runner) ----------------------------------
    def hold(self) -> int:
        """Oldest pending work: unacked productions and holding event-time timers."""
        return min(self.outbox.hold(), self.timers.hold())

    def held_reason(self) -> str:
        """What :meth:`hold` is, for people (``millwheel watermark --why``): the earliest
        timer holding the watermark, else the oldest production not yet acked; "" when
        nothing is pending. From the timer heap's top and the outbox's oldest entry: no
        store read. At most :data:`HELD_REASON_CHARS` characters."""
        timer, out = self.timers.holding(), self.outbox.hold()
        if timer is not None and timer.time <= out:
            text = (f"timer at {event_time(timer.time)} for key {_shown(timer.key)} "
                    f"(tag {_shown(timer.tag)}) not yet fired")
        elif out < MAX_TIMESTAMP:
            p = self.outbox.oldest()
            if p is None:  # parked: its consumer keeps refusing (millwheel/runtime/outbox.py)
                text = f"productions at {event_time(out)} not yet acked (parked: their consumer refuses them)"
            else:
                text = (f"production at {event_time(out)} for key {_shown(p.record.key)} on stream "
                        f"{_shown(p.stream)} not yet acked by {_shown(p.consumer)}")
        else:
            return ""
        return text[:HELD_REASON_CHARS]

    def ids_generation(self, now_us: int) -> int:
        """The generation a checkpoint at ``now_us`` remembers its consumed IDs under:
        the start of a span of 1/:data:`ID_GENERATIONS` of the retention. The store
        forgets a whole generation at once (a range delete), so an ID is kept between
        the retention and 1/16 more; lookups probe ~17 live generations."""
        width = max(1, self.spec.options.record_id_retention_us // ID_GENERATIONS)
        return now_us - now_us % width

    def expire_record_ids(self, every_us: int = 60_000_000) -> int:
        """Forget consumed IDs older than the retention window, at most once per ``every_us``."""
        now = self.clock.now_us()
        if self.dedup is None or now - self._last_expiry < every_us:
            return 0
        self._last_expiry = now
        older_than = now - self.spec.options.record_id_retention_us
        removed = self.store.expire_ids(self.name, self.range_id, self.token, older_than)
        if removed:
            self.dedup.forget_expired(older_than)
        return removed
