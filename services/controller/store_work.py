"""The controller's store calls, made off its lock and off the threads that answer RPCs.

The controller decides under its lock (who owns a range, whether a report's token is
current) and writes afterwards, here. A store call can block for as long as a Redis
shard is away (a master failover, a SIGSTOPped node, ``wait_replicas`` with no replica)
or a SQLite file's writer lock is held: were it made under the lock, every heartbeat
would queue behind it and live workers would be declared dead (issue 21, item 4).

Calls are serialised per *key* (a range's token and assignment, a range's watermark
report, a node's watermark read, a worker's record): one runs at a time for a key, in
the order submitted, so a range's move and its later removal cannot overtake each other.
A task submitted with ``replace`` supersedes the same key's replaceable task that has not
started yet (a newer watermark report makes an older one pointless), so a key whose
shard is away holds one call in flight and at most one waiting, never a backlog. Keys run
on up to ``max_threads`` threads at once: calls blocked on one shard leave the others'
keys running.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable

log = logging.getLogger("millwheel.controller")

MAX_THREADS = 64  #: keys whose store calls run at once (a blocked shard holds only its own keys)


class Superseded(Exception):
    """The task never ran: a newer one for the same key took its place."""


_Task = tuple[Callable[[], Any], "Future[Any]", bool]


class StoreWork:
    def __init__(self, max_threads: int = MAX_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="store-work")
        self._lock = threading.Lock()
        self._queued: dict[Hashable, deque[_Task]] = {}  # per key, not started yet
        self._running: set[Hashable] = set()
        self._closed = False

    def submit(self, key: Hashable, fn: Callable[[], Any], replace: bool = False) -> Future[Any]:
        """Run ``fn()`` after the key's earlier tasks; its future holds the result or the
        exception (:class:`Superseded` if a later ``replace`` task took its place)."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(Superseded("the controller is stopping"))
                return fut
            queue = self._queued.setdefault(key, deque())
            if replace and queue and queue[-1][2]:
                _fn, old, _r = queue.pop()
                old.set_exception(Superseded(f"a newer store call for {key!r} took its place"))
            queue.append((fn, fut, replace))
            if key in self._running:
                return fut
            self._running.add(key)
        self._pool.submit(self._drain, key)
        return fut

    def busy(self, key: Hashable) -> bool:
        """Whether a task of ``key`` is running or waiting."""
        with self._lock:
            return key in self._running

    def idle(self) -> bool:
        """Whether no task of any key is running or waiting (tests wait for moves to land)."""
        with self._lock:
            return not self._running

    def _drain(self, key: Hashable) -> None:
        """Run the key's tasks one after another until none is left."""
        while True:
            with self._lock:
                queue = self._queued.get(key)
                if not queue:
                    self._queued.pop(key, None)
                    self._running.discard(key)
                    return
                fn, fut, _replace = queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # the caller (or the log) deals with it
                fut.set_exception(exc)

    def close(self) -> None:
        """Refuse new tasks; those waiting are dropped (the store fences whatever a later
        leader does instead), the running ones finish on their own."""
        with self._lock:
            self._closed = True
            for queue in self._queued.values():
                while queue:
                    _fn, fut, _r = queue.pop()
                    fut.set_exception(Superseded("the controller is stopping"))
        self._pool.shutdown(wait=False)
