"""The error policy: what happens when user code raises on a record or a timer.

A record (or timer) whose code raises must not block its key range for good, nor
take its batch's good records down with it (MillWheel §6; Beam's dead-letter
pattern). Per computation (``options.on_error``, ``max_attempts``):

* ``dead_letter`` (default) / ``skip``: the batch is **isolated**: the range's
  in-memory state is rebuilt from the store (:meth:`RangeWorker.rollback`), the
  failing record is set aside and the rest of the batch is processed and
  checkpointed at once. The failing record is retried alone until it succeeds or
  has failed ``max_attempts`` times; then it is given up: in one atomic checkpoint
  with its consumed ID it is written to the dead-letter stream (``dead_letter``) or
  only counted (``skip``). Attempts are counted durably per item in the store
  (:meth:`StateStore.bump_attempts`), so a crash loop counts too.
* ``fail``: the batch fails as a whole and is retried by its sender, with every
  attempt counted and visible (``DescribeComputation``, ``millwheel errors``).

Timers are treated the same way, one at a time, identified by their identity
(:func:`millwheel.record.timer_cause`).

The dead letter's record ID is derived from the failed item's ID, so redoing the
give-up after a crash reproduces it and the stream log keeps one copy.

This module is the policy's control flow (isolating a batch, retrying an item alone,
deciding when it is given up); what each step records (the attempt counts, the error
JSON, the rate-limited log, the dead letter and its format) is
:mod:`millwheel.runtime.failures`.

**The seam for work that failed without raising** (a watchdog that killed a worker
stuck in one batch): call :func:`record_failure` for each item of the killed batch.
The next owner of the range (or this one, after :meth:`RangeWorker.rollback`) sees
the counts; an item at ``max_attempts`` is given up without running, with the
cause given there, exactly as if its code had raised that many times.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from millwheel.errors import UserCodeError
from millwheel.record import Record, timer_cause
from millwheel.runtime import failures
from millwheel.runtime.context import RangeTransaction
from millwheel.runtime.range_worker import MAX_TIMERS_PER_BATCH, RangeWorker, Watch
from millwheel.state.protocol import StateStore
from millwheel.topology import ErrorPolicy

Commit = Callable[[RangeTransaction], None]

FAIL_BACKOFF_CAP_S = 2.0


def record_failure(
    store: StateStore, computation: str, range_id: int, token: int, item_id: str, *,
    key: str, exc_type: str, message: str, frames: Sequence[str] = (), time_us: int | None = None,
    at_least: int = 1,
) -> int:
    """Count one failed attempt of ``item_id`` (a record ID, or a timer's identity from
    :func:`millwheel.record.timer_cause`) without its code having raised, e.g. the
    batch was killed for overrunning its deadline. Fenced by the range's ``token``;
    returns the count. At ``max_attempts`` the range gives the item up without running
    it, with this ``exc_type`` and ``message`` as its error. ``at_least`` (say the
    computation's ``max_attempts``, for an item that overran alone) counts on until
    the count is at least that."""
    now = time.time_ns() // 1000 if time_us is None else time_us
    error = failures.error_json(item_id=item_id, key=key, exc_type=exc_type, message=message,
                                frames=frames, time_us=now)
    n = store.bump_attempts(computation, range_id, token, item_id, error)
    while n < min(at_least, 1000):
        n = store.bump_attempts(computation, range_id, token, item_id, error)
    return n


# -- the policy ------------------------------------------------------------------------
def process_batch(rw: RangeWorker, records: Sequence[Record], input_watermark: int, commit: Commit,
                  input: str = "") -> None:
    """Steps 1-3 for a batch under the computation's error policy. On return every
    record is consumed (processed, dead-lettered or skipped) and checkpointed; under
    ``fail`` a failing batch raises :class:`UserCodeError` with nothing checkpointed.
    ``input``: the stream the records arrived on, what late ones are counted under
    ("" if not known; :mod:`millwheel.late`)."""
    try:
        txn = rw.process_records(records, input_watermark, input)
    except UserCodeError as err:
        rw.rollback()
        if rw.spec.options.on_error is ErrorPolicy.FAIL:
            failures.count_attempt(rw, err, err.item_id, outcome="failing")
            raise
        _Isolation(rw, records, input_watermark, commit, input).run(err)
        return
    _commit(rw, txn, records, commit)


def fire_timers(rw: RangeWorker, input_watermark: int, commit: Commit, *,
                watch: Watch | None = None, given_up: Callable[[str], bool] | None = None,
                limit: int = MAX_TIMERS_PER_BATCH) -> bool:
    """Fire the range's due timers under the error policy; True if any fired (or was
    given up). Under ``fail`` a failing timer raises, and is tried again after a backoff.
    ``watch`` wraps user code (the service's deadline); timers ``given_up`` accepts (e.g.
    one that overran its deadline alone) are given up without running; ``limit`` caps
    the timers fired together."""
    opts = rw.spec.options
    if opts.on_error is ErrorPolicy.FAIL and time.monotonic() < rw.fail_until:
        return False
    try:
        txn = rw.fire_timers(input_watermark, limit, given_up, watch)
    except UserCodeError as err:
        rw.rollback()
        if opts.on_error is ErrorPolicy.FAIL:
            n = failures.count_attempt(rw, err, err.item_id, outcome="failing")
            rw.fail_until = time.monotonic() + min(FAIL_BACKOFF_CAP_S, 0.05 * 2 ** min(n, 10))
            raise
        _isolate_timers(rw, input_watermark, commit, err, watch, given_up)
        return True
    if txn is None:
        return False
    _finish_timers(rw, txn, {})
    commit(txn)
    _after_commit(rw, txn)
    return True


def _commit(rw: RangeWorker, txn: RangeTransaction, records: Sequence[Record], commit: Commit) -> None:
    """Commit a successful run; items that had failed before and now passed lose their count."""
    if rw.failing:
        txn.resolved += [r.record_id for r in records if r.record_id in rw.failing]
    commit(txn)
    _after_commit(rw, txn)


def _after_commit(rw: RangeWorker, txn: RangeTransaction) -> None:
    for item in txn.resolved:
        rw.failing.pop(item, None)


class _Isolation:
    """A failed batch, processed again without the records that fail (see module doc)."""

    def __init__(self, rw: RangeWorker, records: Sequence[Record], input_watermark: int,
                 commit: Commit, input: str = "") -> None:
        self.rw = rw
        self.records = records
        self.wm = input_watermark
        self.input = input  # every run of (part of) the batch counts its late records under it
        self.commit = commit
        self.by_id = {r.record_id: r for r in records}
        self.max = rw.spec.options.max_attempts

    def run(self, err: UserCodeError) -> None:
        excluded: dict[str, None] = {}
        give_up: list[tuple[Record, UserCodeError, int]] = []
        retry: list[Record] = []
        failed: UserCodeError | None = err
        while failed is not None:
            item = failed.item_id
            if item is None or item not in self.by_id or item in excluded:
                break  # cannot tell which record failed: each one alone, below
            n = failures.count_attempt(self.rw, failed, item, outcome="")
            excluded[item] = None
            if n >= self.max:
                give_up.append((self.by_id[item], failed, n))
            else:
                retry.append(self.by_id[item])
            rest = [r for r in self.records if r.record_id not in excluded]
            try:
                txn = self.rw.process_records(rest, self.wm, self.input)
            except UserCodeError as again:
                self.rw.rollback()
                failed = again
                continue
            for record, e, n in give_up:
                failures.give_up(self.rw, txn, e, n, record=record)
            _commit(self.rw, txn, rest, self.commit)
            self.rw.crash("after_isolated_commit")
            for record in retry:
                self._alone(record)
            return
        # The failing record is unknown: every record not yet set aside, one at a time.
        if give_up:
            txn = RangeTransaction(self.rw)
            for record, e, n in give_up:
                failures.give_up(self.rw, txn, e, n, record=record)
            self.commit(txn)
            _after_commit(self.rw, txn)
            self.rw.crash("after_give_up")
        for record in self.records:
            if record.record_id not in excluded or any(record is r for r in retry):
                self._alone(record)

    def _alone(self, record: Record) -> None:
        """Run one record until it succeeds or is given up (bounded by max_attempts)."""
        rw = self.rw
        while True:
            try:
                txn = rw.process_records([record], self.wm, self.input)
            except UserCodeError as err:
                rw.rollback()
                n = failures.count_attempt(rw, err, record.record_id, outcome="")
                if n < self.max:
                    continue
                txn = RangeTransaction(rw)
                failures.give_up(rw, txn, err, n, record=record)
                self.commit(txn)
                _after_commit(rw, txn)
                rw.crash("after_give_up")
                return
            _commit(rw, txn, [record], self.commit)
            return


def _isolate_timers(rw: RangeWorker, input_watermark: int, commit: Commit, err: UserCodeError,
                    watch: Watch | None = None, given_up: Callable[[str], bool] | None = None) -> None:
    """Fire due timers one at a time; a timer failing ``max_attempts`` times is given up."""
    given: dict[str, tuple[UserCodeError, int]] = {}
    failed: UserCodeError | None = err
    for _ in range(10_000):  # bounded: each round fires a timer or counts an attempt
        if failed is not None and failed.item_id is not None:
            n = failures.count_attempt(rw, failed, failed.item_id, outcome="")
            if n >= rw.spec.options.max_attempts:
                given[failed.item_id] = (failed, n)
        failed = None
        try:
            txn = rw.fire_timers(input_watermark, 1, lambda c: c in given or (  # noqa: B023
                given_up is not None and given_up(c)), watch)
        except UserCodeError as again:
            rw.rollback()
            failed = again
            continue
        if txn is None:
            return
        _finish_timers(rw, txn, given)
        commit(txn)
        _after_commit(rw, txn)
        if txn.given_up_timers:
            rw.crash("after_give_up")


def _finish_timers(rw: RangeWorker, txn: RangeTransaction, given: dict[str, tuple[UserCodeError, int]]) -> None:
    """Give up the timers ``fire_timers`` set aside; clear the counts of those that ran."""
    for timer in txn.given_up_timers:
        cause = timer_cause(timer)
        err, n = given.get(cause) or (failures.stored_error(rw, cause, timer.key), rw.failing.get(cause, 0))
        failures.give_up(rw, txn, err, n, timer=timer)
    if rw.failing:
        txn.resolved += [c for c in map(timer_cause, txn.timers_run) if c in rw.failing]
