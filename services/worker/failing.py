"""Key ranges this worker cannot run now: marked failing, retried with backoff, logged rarely.

A range is failing when its code cannot be built ("build": user code raising in its
constructor, a store read failing while the range recovers), when a batch or timer
was processed but its checkpoint (or another store call of the range) keeps failing
("checkpoint": a store error that persists), or when this worker's ``--allow-code``
refuses its code ("refused"). That is the range's failure, not the worker's: its other
ranges go on. Such a range is

* tried again after a backoff (:data:`BASE_S` doubling to :data:`CAP_S`, with
  jitter): its take waits (services/worker/taker.py), and batches for it are refused at once,
  without touching the store, until the next attempt is due;
* reported to the controller with every heartbeat (``HeartbeatRequest.failing``),
  which shows it in ``millwheel errors``, ``DescribeComputation``, ``ClusterStatus``
  and the console;
* logged with its traceback once a minute per (computation, stage, exception type),
  the repeats counted (:class:`millwheel.runtime.failures.RateLimitedLog`), never once
  per attempt.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from millwheel.runtime.failures import RateLimitedLog
from millwheel.runtime.range_worker import last_frames

from ..generated import millwheel_pb2 as pb

log = logging.getLogger("millwheel.worker")
Unit = tuple[str, int]
BASE_S = 0.25
CAP_S = 10.0
MAX_MESSAGE_CHARS = 1000


@dataclass
class Failure:
    stage: str
    attempts: int
    since_us: int
    last_us: int
    exc_type: str
    message: str
    retry_at: float  # monotonic
    origin: str = ""  # which loop saw it ("pump", or "" for the range's batches and its take)


class RangeFailures:
    """The failing ranges of one worker (heartbeat, Deliver and pump threads share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failing: dict[Unit, Failure] = {}
        self._log = RateLimitedLog(log)

    def __contains__(self, unit: Unit) -> bool:
        return unit in self._failing

    def get(self, unit: Unit) -> Failure | None:
        return self._failing.get(unit)

    def failed(self, unit: Unit, stage: str, exc: BaseException, *, quiet: bool = False,
               origin: str = "") -> Failure:
        """One more failed attempt of ``unit`` at ``stage``: when the next is due, and
        the log (unless ``quiet``: the caller logs it its own way). ``origin``: see
        :meth:`succeeded`."""
        now_us, now = time.time_ns() // 1000, time.monotonic()
        message = str(exc)[:MAX_MESSAGE_CHARS]
        with self._lock:
            f = self._failing.get(unit)
            if f is None or f.stage != stage:
                f = self._failing[unit] = Failure(stage, 0, now_us, now_us, type(exc).__name__, message, now)
            f.attempts += 1
            f.last_us, f.exc_type, f.message, f.origin = now_us, type(exc).__name__, message, origin
            f.retry_at = now + min(CAP_S, BASE_S * 2 ** min(f.attempts - 1, 10)) * random.uniform(0.8, 1.2)
        if not quiet:
            details = "\n".join(f"  {frame}" for frame in last_frames(exc)) or "  (no traceback)"
            self._log.report(
                (unit[0], stage, f.exc_type),
                f"range {unit[0]}/{unit[1]} is failing ({stage}): {f.exc_type}: {message} "
                f"[attempt {f.attempts}; next in {f.retry_at - now:.1f} s]", details)
        return f

    def succeeded(self, unit: Unit, origin: str | None = None) -> None:
        """``unit`` ran: no longer failing. With ``origin``, only if its failure was seen
        there (a pump pass that went through says nothing of the range's batches)."""
        if unit not in self._failing:  # the common case: no lock
            return
        with self._lock:
            f = self._failing.get(unit)
            if f is None or (origin is not None and f.origin != origin):
                return
            del self._failing[unit]
        log.warning("range %s/%d runs again after %d failed attempt(s) (%s: %s)",
                    unit[0], unit[1], f.attempts, f.stage, f.exc_type)

    def due(self, unit: Unit) -> bool:
        """Whether ``unit`` may be tried now (it is not failing, or its backoff is over)."""
        f = self._failing.get(unit)
        return f is None or time.monotonic() >= f.retry_at

    def keep(self, units: Iterable[Unit]) -> None:
        """Forget ranges no longer assigned here."""
        wanted = set(units)
        with self._lock:
            for unit in [u for u in self._failing if u not in wanted]:
                del self._failing[unit]

    def reports(self) -> list[pb.RangeFailure]:
        now = time.monotonic()
        with self._lock:
            return [pb.RangeFailure(node=node, range_id=r, stage=f.stage, attempts=f.attempts,
                                    since=f.since_us, last=f.last_us, exception_type=f.exc_type,
                                    message=f.message, retry_in_s=max(0.0, f.retry_at - now))
                    for (node, r), f in sorted(self._failing.items())]
