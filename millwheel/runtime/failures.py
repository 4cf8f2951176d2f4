"""The error policy's bookkeeping: what a failed attempt and a given-up item write.

:mod:`millwheel.runtime.poison` decides *when* (which batch to isolate, which record
or timer to retry alone, when one has used up its attempts); this module holds *what*
each of those steps records, so the policy reads as control flow only:

* one more failed attempt of an item, counted durably in the store and logged,
  rate-limited (:func:`count_attempt`, :class:`RateLimitedLog`), with the error JSON
  kept beside the count (:func:`error_json`);
* the error an earlier attempt stored, read back (:func:`stored_error`);
* giving an item up in a transaction (:func:`give_up`): its consumed ID, its dead
  letter (or skip count), its error, its count deleted, all in one checkpoint;
* the dead letter's format: its record ID (:func:`dead_letter_id`) and the original
  record read back out of it (:func:`letter_record`).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

from millwheel.errors import UserCodeError
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record, Timer, derive_record_id, timer_cause
from millwheel.runtime.context import RangeTransaction
from millwheel.runtime.range_worker import RangeWorker
from millwheel.topology import ErrorPolicy

log = logging.getLogger("millwheel.errors")


def dead_letter_id(computation: str, item_id: str) -> str:
    """The dead letter's record ID: derived from the failed item, so a redo matches."""
    return derive_record_id(computation, "dead\x1f" + item_id, 0)


def error_json(
    *, item_id: str, key: str, exc_type: str, message: str, frames: Sequence[str] = (),
    time_us: int, **extra: Any,
) -> bytes:
    """The JSON kept with an item's failed attempt (and, with ``attempts`` and
    ``outcome``, with a given-up error)."""
    return json.dumps({
        "record_id": item_id, "key": key, "time": time_us, "exception_type": exc_type,
        "message": message, "traceback": list(frames), **extra,
    }).encode()


# -- logging -------------------------------------------------------------------------
@dataclass
class _Seen:
    last_full: float
    repeats: int = 0


class RateLimitedLog:
    """One full traceback per distinct error per ``period_s``; repeats are counted and
    the count is told with the next full report (a poison record retried every few ms
    must not flood the log)."""

    def __init__(self, logger: logging.Logger, period_s: float = 60.0) -> None:
        self.logger = logger
        self.period_s = period_s
        self._seen: dict[tuple[str, ...], _Seen] = {}

    def report(self, signature: tuple[str, ...], summary: str, details: str) -> bool:
        """Log ``summary`` and ``details`` unless this signature was logged within the
        period; returns whether it logged."""
        now = time.monotonic()
        seen = self._seen.get(signature)
        if seen is not None and now - seen.last_full < self.period_s:
            seen.repeats += 1
            return False
        repeats = seen.repeats if seen is not None else 0
        if len(self._seen) > 10_000:
            self._seen.clear()
        self._seen[signature] = _Seen(now)
        more = f" (and {repeats} more like it in the last {self.period_s:.0f} s)" if repeats else ""
        self.logger.error("%s%s\n%s", summary, more, details)
        return True


errors_log = RateLimitedLog(log)


def log_failure(rw: RangeWorker, err: UserCodeError, attempts: int, outcome: str) -> None:
    where = err.frames[-1].split(" in ", 1)[0] if err.frames else ""
    details = "\n".join(f"  {f}" for f in err.frames) or "  (no traceback)"
    errors_log.report(
        (rw.name, err.exc_type, where),
        f"{err} [attempt {attempts} of {rw.spec.options.max_attempts}, {outcome}]", details)


# -- attempts --------------------------------------------------------------------------
def count_attempt(rw: RangeWorker, err: UserCodeError, item_id: str | None, outcome: str) -> int:
    """One more failed attempt of ``item_id``, durably; an error that retrying cannot
    fix counts as all attempts at once (nothing stored)."""
    opts = rw.spec.options
    if item_id is None:
        log_failure(rw, err, 0, outcome)
        return 0
    if err.final:
        n = max(opts.max_attempts, rw.failing.get(item_id, 0))
    else:
        n = rw.store.bump_attempts(rw.name, rw.range_id, rw.token, item_id, error_json(
            item_id=item_id, key=err.key or "", exc_type=err.exc_type, message=err.exc_message,
            frames=err.frames, time_us=rw.clock.now_us()))
        rw.failing[item_id] = n
        rw.crash("after_attempt")
    if outcome != "failing":
        outcome = "retrying" if n < opts.max_attempts else (
            "dead_letter" if opts.on_error is ErrorPolicy.DEAD_LETTER else "skipped")
    log_failure(rw, err, n, outcome)
    return n


def stored_error(rw: RangeWorker, item_id: str, key: str) -> UserCodeError:
    """The error recorded with an item's last attempt (e.g. by
    :func:`millwheel.runtime.poison.record_failure`)."""
    entry = rw.store.read_errors(rw.name, rw.range_id).attempts.get(item_id)
    info: dict[str, Any] = {}
    if entry is not None:
        try:
            info = json.loads(entry[1])
        except ValueError:
            info = {}
    return UserCodeError(
        f"computation {rw.name!r} item {item_id!r} used up its attempts",
        key=str(info.get("key", key)), item_id=item_id,
        exc_type=str(info.get("exception_type", "AttemptsExhausted")),
        exc_message=str(info.get("message", "failed in earlier runs")),
        frames=tuple(str(f) for f in info.get("traceback", ())), final=True,
    )


# -- giving up -------------------------------------------------------------------------
def give_up(rw: RangeWorker, txn: RangeTransaction, err: UserCodeError, attempts: int, *,
            record: Record | None = None, timer: Timer | None = None) -> None:
    """Add to ``txn`` everything giving an item up means, so it is one atomic step:
    its consumed ID, its dead letter (or skip count), its error, its count deleted."""
    opts = rw.spec.options
    if err.exc_type == "AttemptsExhausted" and err.item_id is not None:
        err = stored_error(rw, err.item_id, err.key or "")
    item_id = record.record_id if record is not None else timer_cause(timer) if timer is not None else ""
    key = err.key if err.key is not None else record.key if record is not None else ""
    now = rw.clock.now_us()
    dead = opts.on_error is ErrorPolicy.DEAD_LETTER
    outcome = "dead_letter" if dead else "skipped"
    if record is not None and rw.dedup is not None:
        txn.consumed_ids.append(record.record_id)
        txn.records_in += 1
    txn.resolved.append(item_id)
    txn.errors.append(error_json(
        item_id=item_id, key=key, exc_type=err.exc_type, message=err.exc_message, frames=err.frames,
        time_us=now, attempts=attempts, outcome=outcome, range_id=rw.range_id))
    counter = "dead_lettered" if dead else "skipped"
    txn.counters[counter] = txn.counters.get(counter, 0) + 1
    if not dead:
        return
    letter: dict[str, Any] = {
        "computation": rw.name, "record_id": item_id, "key": key, "attempts": attempts,
        "exception_type": err.exc_type, "message": err.exc_message, "traceback": list(err.frames),
        "range_id": rw.range_id, "time": now,
    }
    if record is not None:
        letter["timestamp"] = record.timestamp
        letter.update(value_fields(record.value))
        if rw.router.key_error(rw.name, record) is not None:
            letter["stage"] = "key_extraction"
        ts = record.timestamp
    else:
        assert timer is not None
        letter["timer"] = {"tag": timer.tag, "time": timer.time, "domain": timer.domain.value}
        ts = min(max(timer.time, MIN_TIMESTAMP), MAX_TIMESTAMP)
    dl = Record(key, json.dumps(letter).encode(), ts, dead_letter_id(rw.name, item_id))
    txn.productions.extend(rw.router.fan_out(rw.spec.dead_letter_stream, dl))
    txn.records_out += 1


def value_fields(value: bytes) -> dict[str, str]:
    """A record value in JSON: ``value`` as text if UTF-8, else ``value_base64``."""
    try:
        return {"value": value.decode("utf-8")}
    except UnicodeDecodeError:
        return {"value_base64": base64.b64encode(value).decode("ascii")}


def letter_record(letter: dict[str, Any]) -> Record | None:
    """The original record of a dead letter (None for a timer's or a key-extraction
    failure's: those cannot be handed back to the computation as they were)."""
    if "timer" in letter or letter.get("stage") == "key_extraction":
        return None
    if "value_base64" in letter:
        value = base64.b64decode(letter["value_base64"])
    else:
        value = str(letter.get("value", "")).encode("utf-8")
    return Record(str(letter["key"]), value, int(letter["timestamp"]), str(letter["record_id"]))
