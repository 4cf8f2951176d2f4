"""The processes ``millwheel up`` starts end when ``up`` ends, however it ends.

``up`` stops its children in order on SIGTERM, SIGINT, an error or a normal end. But a
supervisor or a CI job that kills ``up`` with SIGKILL gives it no chance to, and the
children run in sessions of their own (so a Ctrl-C in the terminal reaches ``up`` alone,
which then stops them in order): without this they would run on, nobody's, the
controller holding its port.

How (Linux): ``up`` starts each child with ``MILLWHEEL_PARENT_PID`` set to its own pid;
the child, first thing, asks the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``) and then checks that the parent is still the one named (it
may have died before the request), ending at once if not. A controller gets SIGTERM: it
stops as on Ctrl-C and hands its lease over at once, so the next ``up`` on the same store
leads without waiting for the lease to lapse. A worker gets SIGKILL: its controllers end
with ``up`` too, so a drain would only wait for them until its timeout (15 s), and a
killed worker is what exactly-once is built for (the next worker takes its ranges under
new tokens and resends what was checkpointed and not acked). The signal
comes when the *thread* that started the child ends: ``up`` starts every child from its
main thread. A worker's watchdog ends with its worker by itself (the pipe between them
closes). Elsewhere than Linux the request is skipped: children outlive a SIGKILL of
``up`` there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

ENV = "MILLWHEEL_PARENT_PID"
_PR_SET_PDEATHSIG = 1
log = logging.getLogger("millwheel.up")


def child_env() -> dict[str, str]:
    """The environment of a child that must end with this process."""
    return {**os.environ, ENV: str(os.getpid())}


def die_with_parent(sig: signal.Signals) -> None:
    """In a child of ``up``: get ``sig`` when ``up`` ends. Does nothing when not started by ``up``."""
    parent = os.environ.pop(ENV, None)  # not inherited further (a worker's watchdog)
    if not parent:
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            log.warning("cannot ask to end with millwheel up (prctl: %s)", os.strerror(ctypes.get_errno()))
    if os.getppid() != int(parent):  # up died before the request took effect
        os.kill(os.getpid(), sig)
