"""Copies the SQLite store's write-ahead log into the database on a thread of its own.

Why: in WAL mode a commit appends every page it changed to the log and, with
``synchronous=NORMAL``, syncs nothing. When the log reaches ``wal_autocheckpoint``
pages (64 MB here), the committing connection copies the log's pages into the
database and fsyncs both files inside that commit. On this machine's shared disk that
took 120-260 ms, during which the runner stood still. Small commits (a paced runner
commits a step of a few dozen records every 1-3 ms) rewrite the same hot pages and
fill 64 MB in ~1.3 s, so these stalls were the p95 of record latency
(docs/bench.md, "Speed round 2: latency").

Here a thread with its own connection runs ``PRAGMA wal_checkpoint(PASSIVE)`` soon
after commits: PASSIVE neither waits for nor blocks the writer, and the fsyncs happen
outside the GIL. The writer's autocheckpoint stays as the bound on the log's size:
when it triggers, the log has been copied and synced up to a few commits ago, so the
commit that triggers it copies and syncs little, and the log restarts after it.

Durability is unchanged: a checkpoint only moves committed pages into the database
file, SQLite recovers an interrupted one (a kill -9 included), and a commit is as
durable as before (the log is synced before the database is written, as always).
"""

from __future__ import annotations

import sqlite3
import threading

INTERVAL_S = 0.05  # at most one pass per 50 ms: each pass syncs the log and the database


class Checkpointer:
    """A daemon thread copying the log of the SQLite file at ``path`` while commits
    :meth:`poke` it; :meth:`close` stops it (a pass under way is finished first)."""

    def __init__(self, path: str, interval_s: float = INTERVAL_S) -> None:
        self.path = path
        self.interval_s = interval_s
        self.passes = 0  # checkpoint passes run (a sensor for tests)
        self.errors = 0  # passes that failed (the writer's autocheckpoint still bounds the log)
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="millwheel-sqlite-checkpointer", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """A commit appended to the log: copy it soon."""
        self._wanted.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wanted.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=0)
        except sqlite3.Error:
            self.errors += 1
            return
        try:
            while True:
                self._wanted.wait()
                if self._stop.is_set():
                    return
                self._wanted.clear()
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.passes += 1
                except sqlite3.Error:
                    self.errors += 1  # e.g. the file is being replaced; the next commit retries
                if self._stop.wait(self.interval_s):
                    return
        finally:
            db.close()
