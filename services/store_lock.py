"""One writer at a time across the service's processes on one SQLite file, handed over
by the kernel instead of by SQLite's busy handler.

Every process of a deployment on ``sqlite:///PATH`` (controller and workers) writes
the same file, and SQLite admits one writer at a time. A writer that finds the lock
taken is left to SQLite's busy handler, which polls with sleeps of 1, 2, 5, 10, ...
ms: under steady load from two workers, much of a checkpoint's latency was such
sleeping while the lock had long been free again. Taking an ``flock`` on
``PATH.writers`` around each write transaction makes waiters block in the kernel and
wake the moment the holder is done. The store's transactions are unchanged (SQLite
still checks the sequencer token inside each one); this only decides who goes next.

A call of many transactions (``expire_ids``: a long record-ID cleanup) takes the lock
around each of its transactions, not around the whole call (the store's ``txn_guard``):
held for a whole cleanup it kept a controller's lease renewal waiting past the lease's
time to live on a loaded machine (issue 21, item 4).
"""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from millwheel.state.protocol import StateStore

WRITES = frozenset({
    "acquire", "checkpoint", "ack", "append_log", "trim_log", "report_watermark", "put_meta", "put_metas",
    "insert_meta", "claim_lease", "renew_lease", "release_lease",
})


class WriterLockedStore:
    """Delegates to ``store``; its write methods run under an exclusive ``flock``."""

    def __init__(self, store: StateStore, lock_path: str) -> None:
        self._store = store
        self._fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)  # the store's owner alone, as the store
        self._thread_lock = threading.Lock()  # flock is per process: threads take turns first
        self._wrapped: dict[str, Callable[..., Any]] = {}
        if hasattr(store, "txn_guard"):  # per transaction of a multi-transaction call
            store.txn_guard = self.exclusive

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """This process's turn as the file's writer."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in WRITES:
            return attr
        wrapped = self._wrapped.get(name)
        if wrapped is None:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                with self.exclusive():
                    return attr(*args, **kwargs)

            self._wrapped[name] = wrapped
        return wrapped

    def close(self) -> None:
        self._store.close()
        os.close(self._fd)


def open_service_store(url: str) -> StateStore:
    """``open_store(url)``, with cross-process writer hand-over for SQLite files."""
    from millwheel.state import open_store

    store = open_store(url)
    path = getattr(store, "path", None)
    if url.startswith("sqlite:///") and isinstance(path, str) and path != ":memory:":
        return WriterLockedStore(store, path + ".writers")
    return store
