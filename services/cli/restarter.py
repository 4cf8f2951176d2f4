"""``millwheel up`` restarts its workers when they die.

A worker may die on purpose: its watchdog kills it when user code overruns its
deadline (:mod:`services.worker.watchdog`), and the replacement learns from the store which
records to isolate. Like a process supervisor (``deploy/supervisor``'s
``autorestart``, a Kubernetes pod's restart policy), ``millwheel up`` starts a new
worker in its place, after a backoff that doubles while workers keep dying quickly
(1 s up to 30 s) and resets once one has run for a minute.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Callable

Proc = subprocess.Popen[bytes]


class Restarter:
    def __init__(self, procs: list[Proc], first: int, spawn: Callable[[], Proc],
                 base_s: float = 1.0, cap_s: float = 30.0, stable_s: float = 60.0,
                 last: int | None = None, what: str = "worker") -> None:
        self.procs = procs  # procs[first:last] are the ones watched; replaced in place
        self.first = first
        self.last = last
        self.what = what
        self.spawn = spawn
        self.base_s, self.cap_s, self.stable_s = base_s, cap_s, stable_s
        self.delay_s = base_s
        self.started = {i: time.monotonic() for i in self._watched()}
        self.due: dict[int, float] = {}

    def check(self) -> None:
        """Called periodically: schedule a restart for each dead worker, do the due ones."""
        now = time.monotonic()
        for i in self._watched():
            p = self.procs[i]
            if i not in self.due and p.poll() is not None:
                if now - self.started[i] >= self.stable_s:
                    self.delay_s = self.base_s
                print(f"millwheel up: {self.what} pid {p.pid} exited with {p.returncode}; restarting "
                      f"it in {self.delay_s:.0f} s", file=sys.stderr, flush=True)
                self.due[i] = now + self.delay_s
                self.delay_s = min(self.cap_s, self.delay_s * 2)
            if i in self.due and now >= self.due[i]:
                del self.due[i]
                self.procs[i] = self.spawn()
                self.started[i] = now

    def _watched(self) -> range:
        return range(self.first, len(self.procs) if self.last is None else self.last)
