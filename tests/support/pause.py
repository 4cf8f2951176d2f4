"""SIGSTOP a process of the embedded (SQLite) store outside its write transactions.

A process stopped inside a SQLite write holds the file's write lock (the WAL's
exclusive lock bytes, or the rollback journal's lock bytes) until it runs again, and
every other process on that file waits for it: the embedded store's limit (one machine,
one file), not the lease's or the sequencer's. So does one stopped while it holds the
service's writer hand-over lock (an ``flock`` on ``PATH.writers``, taken just before
SQLite's and let go just after: services/store_lock.py): seen once, a leader stopped
in that gap kept every standby from writing its lease claim. A test that pauses a
leader or a worker to make a zombie means "a process that stopped answering", so it
pauses it at a moment it holds neither lock, found in ``/proc/locks``; on Redis it
pauses at once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

#: WAL mode: the write, checkpoint, recover and read-mark bytes of the ``-shm`` file.
_WAL_LOCKS = range(120, 128)
#: Rollback journal mode: the PENDING, RESERVED and SHARED bytes of the database file.
_JOURNAL_LOCKS = 0x40000000


def holds_store_write_lock(pid: int) -> bool:
    """Whether ``pid`` holds an exclusive POSIX lock on SQLite's lock bytes, or an
    exclusive ``flock`` (the only one our processes take is the writer hand-over's)."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        fields = line.split()
        # "1: POSIX  ADVISORY  WRITE 1234 08:01:5678 120 120", "2: FLOCK  ADVISORY  WRITE 1234 ... 0 EOF"
        if len(fields) < 8 or fields[3] != "WRITE" or fields[4] != str(pid):
            continue
        if fields[1] == "FLOCK":
            return True
        if fields[1] != "POSIX":
            continue
        try:
            start = int(fields[6])
        except ValueError:
            continue
        if start in _WAL_LOCKS or start >= _JOURNAL_LOCKS:
            return True
    return False


def stop_outside_writes(pid: int, tries: int = 100) -> None:
    """SIGSTOP ``pid`` at a moment it holds no SQLite write lock (resumed and stopped
    again a little later while it does; after ``tries`` it stays stopped anyway)."""
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.02)  # the stop takes effect
        if not holds_store_write_lock(pid):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.03)
    os.kill(pid, signal.SIGSTOP)
