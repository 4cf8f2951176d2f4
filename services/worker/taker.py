"""Taking key ranges off the heartbeat thread.

Building a range (:class:`~millwheel.runtime.range_worker.RangeWorker`) reads its
state from the store: its timers, its outbox, and every retained consumed record ID to
rebuild the deduplicator, and it constructs the user's code. That can take seconds (a
range with many retained IDs on a loaded machine, a constructor that is slow). Built on
the heartbeat thread, as before, it held up the heartbeats: past the controller's
``--heartbeat-timeout`` the worker was declared dead and every range moved, the slow
one included, to be slow again elsewhere.

The heartbeat thread now only asks (:meth:`Taker.want`): a few taker threads build the
ranges, so heartbeats go on and a slow range delays only the ranges queued behind it
on its thread. A build whose assignment changed meanwhile is discarded by the caller
(its writes would be fenced by its stale token anyway).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger("millwheel.worker")
Unit = tuple[str, int]
TAKER_THREADS = 4


class Taker:
    """A queue of ranges to build and the threads that build them, one range at a time
    each; a range is queued at most once until its build is done."""

    def __init__(self, build: Callable[[Unit, int], None], stopped: threading.Event,
                 threads: int = TAKER_THREADS) -> None:
        self._build = build
        self._stopped = stopped
        self._queue: queue.Queue[tuple[Unit, int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: set[Unit] = set()
        self._threads = [threading.Thread(target=self._run, name=f"taker-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def want(self, unit: Unit, token: int) -> bool:
        """Queue ``unit`` to be built under ``token``, unless it is queued or being
        built already (then the build checks the assignment it finds when done).
        Never waits."""
        with self._lock:
            if unit in self._pending:
                return False
            self._pending.add(unit)
        self._queue.put((unit, token))
        return True

    def pending(self) -> int:
        """Ranges queued or being built."""
        with self._lock:
            return len(self._pending)

    def stop(self, timeout_s: float = 2.0) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout_s)

    def _run(self) -> None:
        while not self._stopped.is_set():
            item = self._queue.get()
            if item is None:
                return
            unit, token = item
            try:
                self._build(unit, token)
            except Exception:  # the build records its own failures; this is a bug's last net
                log.exception("taking %s/%d failed", unit[0], unit[1])
            finally:
                with self._lock:
                    self._pending.discard(unit)
