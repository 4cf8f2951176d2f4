"""kill -9 at random moments, the loop the crash tests of ``millwheel run`` share:
start a run, let it go on for a random while, kill it if it has not finished, again,
until one run finishes by itself or the attempts are used up.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from typing import Callable

Run = subprocess.Popen[bytes]


def kill_runner(proc: Run) -> bool:
    """kill -9 of the run itself; it always counts as a kill."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def kill_window(run_s: float, start_up_s: float = 0.6) -> tuple[float, float]:
    """Waits to draw kills from, for a run measured to take ``run_s`` seconds when nothing
    kills it: from ``start_up_s`` (a kill before the run has begun proves little) to 60% of
    the run, so the first kill lands before the run ends on a fast machine as on a slow one
    (fixed windows did not: a faster runtime finished 120,000 records before a 1.9 s wait)."""
    return start_up_s, max(start_up_s + 0.2, 0.6 * run_s)


def timed_run(start: Callable[[], Run], timeout_s: float = 180) -> float:
    """Seconds a failure-free run from ``start()`` takes; it must exit 0."""
    began = time.monotonic()
    proc = start()
    _, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err.decode() if err else ""
    return time.monotonic() - began


def kill_at_random_moments(start: Callable[[], Run], rng: random.Random, attempts: int,
                           within: tuple[float, float], kill: Callable[[Run], bool] = kill_runner
                           ) -> tuple[int, bool]:
    """Up to ``attempts`` runs from ``start()``, each waited for a time drawn uniformly
    from ``within`` (seconds) and then ended by ``kill(proc)``, which returns False when
    the run turned out to have finished by itself instead. A run that finishes must exit 0.
    Returns the number of kills and whether a run finished."""
    kills = 0
    for _attempt in range(attempts):
        proc = start()
        try:
            proc.wait(timeout=rng.uniform(*within))
        except subprocess.TimeoutExpired:
            if not kill(proc):
                return kills, True
            kills += 1
            continue
        assert proc.returncode == 0, proc.stderr.read().decode() if proc.stderr else ""
        return kills, True
    return kills, False
