"""Batches that overran their deadline, recorded durably, and how a range isolates them.

When user code overruns ``options.max_batch_seconds`` the worker's watchdog kills the
worker and records, in the store's metadata under ``overrun/<computation>/<range>``,
the IDs of the batch's records: ``{record_id: {"overruns": n, "alone": bool}}``,
``alone`` when the batch was that one record. The batch's sender still holds the
records (they were never acked) and resends them to whoever owns the range next.

That owner (:class:`~services.worker.units.OwnedRange` loads the entry when it takes
the range) processes a batch containing such records in order, in segments: each
suspect record alone (its own batch, its own deadline), the records between them
together. A record that already overran alone is not run again: it goes to the
computation's error policy (:func:`hand_to_policy`, through
:func:`millwheel.runtime.poison.record_failure`) counted out with a
:class:`~millwheel.errors.DeadlineExceeded` cause, so it is dead-lettered (or skipped)
without running, in one checkpoint with its consumed ID. Under ``on_error: fail`` it
is refused with that cause instead (the batch is answered FAILED, visibly).

Timers the same way (:func:`fire_timers`), named by their cause
(``timer\x1fKEY\x1fTAG\x1fTIME``): while a range has a timer that overran in company,
its due timers fire one at a time; a timer that overran alone is given up by the error
policy without running, with its DeadlineExceeded cause.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable

from millwheel.errors import DeadlineExceeded
from millwheel.record import Record
from millwheel.runtime import poison
from millwheel.runtime.poison import Commit
from millwheel.runtime.range_worker import MAX_TIMERS_PER_BATCH, RangeWorker, Watch
from millwheel.state.protocol import StateStore
from millwheel.topology import ErrorPolicy

log = logging.getLogger("millwheel.worker")
TIMER = "timer\x1f"

PREFIX = "overrun/"
Overruns = dict[str, dict[str, Any]]


def _key(computation: str, range_id: int) -> str:
    return f"{PREFIX}{computation}/{range_id}"


def load(store: StateStore, computation: str, range_id: int) -> Overruns:
    raw = store.get_meta(_key(computation, range_id))
    return json.loads(raw) if raw else {}


def record(store: StateStore, computation: str, range_id: int, ids: Iterable[str], alone: bool) -> Overruns:
    """Count one more overrun for each of ``ids`` (the range's only writer of this key
    is the watchdog of its current owner, and that owner is dead by now)."""
    entry = load(store, computation, range_id)
    for rid in ids:
        seen = entry.setdefault(rid, {"overruns": 0, "alone": False})
        seen["overruns"] += 1
        seen["alone"] = bool(seen["alone"] or alone)
    store.put_meta(_key(computation, range_id), json.dumps(entry).encode())
    return entry


def plan(records: list[Record], overruns: Overruns) -> tuple[list[list[Record]], list[Record]]:
    """(segments to process in order, records that overran alone and are not run)."""
    segments: list[list[Record]] = []
    current: list[Record] = []
    refused: list[Record] = []
    for r in records:
        seen = overruns.get(r.record_id)
        if seen is None:
            current.append(r)
            continue
        if current:
            segments.append(current)
            current = []
        if seen["alone"]:
            refused.append(r)
        else:
            segments.append([r])
    if current:
        segments.append(current)
    return segments, refused


def exceeded(computation: str, range_id: int, record: Record, overruns: Overruns) -> DeadlineExceeded:
    """The cause for a record that overran its deadline alone. The seam to the error
    policy: today the batch is answered FAILED with this cause (and retried)."""
    n = overruns.get(record.record_id, {}).get("overruns", 1)
    return DeadlineExceeded(
        f"computation {computation!r} range {range_id}: record {record.record_id} (key "
        f"{record.key!r}) overran max_batch_seconds alone ({n} overrun(s) in all); "
        f"its worker was killed and it is not run again")


def hand_to_policy(rw: RangeWorker, refused: list[Record], overruns: Overruns) -> list[Record]:
    """Records that overran alone, counted out durably under the error policy (at
    ``max_attempts``, with their DeadlineExceeded cause): the policy then gives them up
    without running. Returns those it could not take (``on_error: fail``)."""
    if rw.spec.options.on_error is ErrorPolicy.FAIL:
        return refused
    consumed = rw.dedup.seen([r.record_id for r in refused]) if rw.dedup is not None else set()
    for r in refused:
        if r.record_id in consumed or rw.failing.get(r.record_id, 0) >= rw.give_up_at:
            continue  # given up before (a resend), or already counted out
        rw.failing[r.record_id] = poison.record_failure(
            rw.store, rw.name, rw.range_id, rw.token, r.record_id, key=r.key,
            exc_type="DeadlineExceeded", message=str(exceeded(rw.name, rw.range_id, r, overruns)),
            at_least=rw.spec.options.max_attempts)
    return []


def fire_timers(rw: RangeWorker, seen: Overruns, watch: Watch, input_wm: int, commit: Commit) -> bool:
    """Due timers under the error policy and ``watch``, isolating timers that overran
    before; True if any fired or was given up."""
    if not seen:
        return poison.fire_timers(rw, input_wm, commit, watch=watch)
    refused = {c for c, v in seen.items() if c.startswith(TIMER) and v["alone"]}
    suspects = {c for c, v in seen.items() if c.startswith(TIMER) and not v["alone"]}
    for cause in refused:  # the cause the error policy gives them up with
        if cause not in rw.failing:
            key = cause[len(TIMER):].rsplit("\x1f", 2)[0]
            rw.failing[cause] = poison.record_failure(
                rw.store, rw.name, rw.range_id, rw.token, cause, key=key, exc_type="DeadlineExceeded",
                message=f"computation {rw.name!r} range {rw.range_id}: timer {cause[len(TIMER):]!r} "
                        f"overran max_batch_seconds alone; its worker was killed")
    fired = poison.fire_timers(rw, input_wm, commit, watch=watch, given_up=refused.__contains__,
                               limit=1 if suspects else MAX_TIMERS_PER_BATCH)
    for cause in suspects:  # fired (alone, within the deadline) or cleared: done with
        key, tag, when = cause[len(TIMER):].rsplit("\x1f", 2)
        pending = rw.timers.get(key, tag)
        if pending is None or str(pending.time) != when:
            seen.pop(cause, None)
    return fired
