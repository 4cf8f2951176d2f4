"""Crash points for recovery tests.

The runtime calls ``crash(point)`` at the seams of the exactly-once sequence:
``after_inject``, ``after_dedup``, ``after_user_code``, ``after_checkpoint``,
``after_ack``, ``after_watermark``, and while a failing record is isolated
(:mod:`millwheel.runtime.poison`) ``after_attempt``, ``after_isolated_commit``,
``after_give_up``. In a real run the hook does nothing. Tests use
:class:`CrashSchedule` (raise at the Nth visit, in process) or set
``MILLWHEEL_CRASH_AT=POINT:N`` so the process SIGKILLs itself at the Nth visit of
POINT: a genuine kill -9 at an exact place. ``MILLWHEEL_HOLD_AT=POINT:SECONDS``
(:func:`hold_hook_from_env`) makes every visit of POINT sleep SECONDS instead: a step
that is quick on a fast machine lasts long enough for a test to watch it under way.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

from millwheel.runtime.range_worker import CrashHook, no_crash

POINTS = (
    "after_inject", "after_dedup", "after_user_code", "after_checkpoint", "after_ack",
    "after_watermark",
)
#: Visited only while a failing record is isolated (millwheel.runtime.poison).
ISOLATION_POINTS = ("after_attempt", "after_isolated_commit", "after_give_up")


class SimulatedCrash(BaseException):
    """Raised by a crash schedule; BaseException so user-code handlers do not eat it."""


class CrashSchedule:
    """Crash (raise :class:`SimulatedCrash`) at the ``n``-th visit of ``point``."""

    def __init__(self, point: str, n: int) -> None:
        if point not in POINTS + ISOLATION_POINTS:
            raise ValueError(f"unknown crash point {point!r}; known: {POINTS + ISOLATION_POINTS}")
        self.point = point
        self.n = n
        self.visits: Counter[str] = Counter()
        self.fired = False

    def __call__(self, point: str) -> None:
        self.visits[point] += 1
        if not self.fired and point == self.point and self.visits[point] == self.n:
            self.fired = True
            raise SimulatedCrash(f"{point} #{self.n}")


def crash_hook_from_env() -> CrashHook:
    spec = os.environ.get("MILLWHEEL_CRASH_AT")
    if not spec:
        return no_crash
    point, _, n_s = spec.partition(":")
    n = int(n_s or "1")
    visits: Counter[str] = Counter()

    def hook(at: str) -> None:
        visits[at] += 1
        if at == point and visits[at] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def hold_hook_from_env() -> CrashHook:
    """``MILLWHEEL_HOLD_AT=POINT:SECONDS``: sleep SECONDS (default 1) at every visit of
    POINT; nothing otherwise (a real run never sets it)."""
    spec = os.environ.get("MILLWHEEL_HOLD_AT")
    if not spec:
        return no_crash
    point, _, s = spec.partition(":")
    seconds = float(s or "1")

    def hook(at: str) -> None:
        if at == point:
            time.sleep(seconds)

    return hook
