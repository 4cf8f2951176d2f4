"""The leader's stream-log retention: a thread of the controller that applies
:mod:`millwheel.runtime.retention` to every logged stream of the registry.

Only the leading controller trims (its trim calls carry the leader check of
:class:`services.controller.leader.LeaderStore`, and its marks are saved under its
epoch); a standby's thread idles. A new leader starts from the marks the previous
one saved. The controller's lock is held only to read which topology is current, never
across a store call, so a pass never delays heartbeats or registrations; each store
call is one small batch (millwheel.runtime.retention.BATCH_ROWS entries). The streams'
policies are worked out once per topology, off the lock: at 1,000 computations, worked
out under the lock at every pass (once a second) they held it, and the GIL, for about
a second each time (issue 34 item 9: the leader's lease renewals starved).
"""

from __future__ import annotations

import logging
import threading

from millwheel.clock import Clock
from millwheel.errors import MillWheelError
from millwheel.runtime.retention import LogTrimmer, Retention, retention_of
from millwheel.state.lease import LeadershipLostError
from millwheel.topology import Topology

from .plane import ControlPlane

log = logging.getLogger("millwheel.controller")

PASS_INTERVAL_S = 1.0  #: between passes over every logged stream
BUSY_INTERVAL_S = 0.05  #: between passes while a pass left work over (a backlog to measure or trim)


class RetentionThread:
    """Trims the stream logs while this controller leads. ``host``: the plane, read at
    each pass (a change of leadership replaces the registry)."""

    def __init__(self, host: ControlPlane, clock: Clock, interval_s: float = PASS_INTERVAL_S) -> None:
        self.host = host
        self.clock = clock
        self.interval_s = interval_s
        self.trimmer: LogTrimmer | None = None
        self._epoch: int | None = None
        self._policies: tuple[Topology, dict[str, Retention]] | None = None  # per topology
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="log-retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the pass under way, saving the marks while still leading."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _loop(self) -> None:
        delay = self.interval_s
        while not self._stop.wait(delay):
            delay = BUSY_INTERVAL_S if self._pass() else self.interval_s
        self._save()

    def _pass(self) -> bool:
        host = self.host
        if not host.leading():
            self.trimmer = None
            return False
        epoch = host.elector.epoch
        if self.trimmer is None or epoch != self._epoch:  # (newly) elected: the saved marks
            self.trimmer, self._epoch = LogTrimmer(host.store, self.clock), epoch
        with host.lock:
            topology = host.registry.topology
        cached = self._policies
        if cached is None or cached[0] is not topology:  # a topology is never changed, only replaced
            cached = self._policies = (topology, retention_of(topology))
        policies = cached[1]
        try:
            return self.trimmer.run(policies, self._stop.is_set)
        except LeadershipLostError as exc:
            log.info("log retention stops: %s", exc)
            self.trimmer = None
        except MillWheelError as exc:  # the store is down, say: the next pass retries
            log.warning("log retention pass failed: %s", exc)
        return False

    def _save(self) -> None:
        if self.trimmer is not None and self.host.leading():
            try:
                self.trimmer.save(force=True)
            except MillWheelError as exc:
                log.info("log retention marks not saved at shutdown: %s", exc)
