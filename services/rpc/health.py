"""Honest gRPC health: SERVING only while the process can do its work.

Listening is not enough: a worker that cannot reach its store cannot checkpoint, and
one that cannot reach its controller will lose its ranges. A :class:`HealthMonitor`
pings the store every ``interval_s`` (a cheap metadata read, with a time limit: a
hung store counts as unreachable) and, for a worker, asks how long its heartbeats
have been failing (a controller: whether a leader is known, so it can serve or
forward a request); it sets the health of the whole server ("" and every millwheel
service) to NOT_SERVING while either check fails and back to SERVING once both pass.
It never touches a key range or a batch.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable

from grpc_health.v1 import health, health_pb2

from millwheel.state.protocol import StateStore

log = logging.getLogger("millwheel.health")
PING_KEY = "health/ping"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthMonitor:
    def __init__(self, servicer: health.HealthServicer, store: StateStore, *,
                 controller_failing_s: Callable[[], float] | None = None,
                 problem: Callable[[], str] | None = None, interval_s: float = 1.0, store_timeout_s: float = 3.0,
                 controller_grace_s: float = 10.0) -> None:
        self.servicer = servicer
        self.store = store
        self.controller_failing_s = controller_failing_s
        self.problem_check = problem  # a process's own readiness condition: '' when fine
        self.interval_s = interval_s
        self.store_timeout_s = store_timeout_s
        self.controller_grace_s = controller_grace_s
        # Every name start_server registered ("" = the whole server, the millwheel
        # services); the servicer keeps them in this dict.
        self.names = [n for n in getattr(servicer, "_server_status", {"": SERVING})
                      if n == "" or n.startswith("millwheel.")]
        self.serving = True
        self.problem = ""
        self._pinger = ThreadPoolExecutor(1, thread_name_prefix="health-ping")
        self._ping: Future[Any] | None = None
        self._ping_started = 0.0
        self._ping_result = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._pinger.shutdown(wait=False)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a monitor must outlive its checks
                log.exception("health check failed")

    def _store_problem(self) -> str:
        """'' if the last ping succeeded, else what is wrong; one ping at a time."""
        now = time.monotonic()
        if self._ping is None:
            self._ping, self._ping_started = self._pinger.submit(self.store.get_meta, PING_KEY), now
            wait([self._ping], timeout=min(0.5, self.store_timeout_s))
        if not self._ping.done():
            waited = now - self._ping_started
            if waited > self.store_timeout_s:
                return f"store ping unanswered for {waited:.1f} s"
            return self._ping_result  # no news yet: as before
        ping, self._ping = self._ping, None
        exc = ping.exception()
        self._ping_result = "" if exc is None else f"store unreachable: {exc.__class__.__name__}: {exc}"
        return self._ping_result

    def check(self) -> bool:
        problem = self._store_problem()
        if not problem and self.controller_failing_s is not None:
            failing = self.controller_failing_s()
            if failing > self.controller_grace_s:
                problem = f"heartbeats to the controller failing for {failing:.0f} s"
        if not problem and self.problem_check is not None:
            problem = self.problem_check()
        serving = not problem
        if serving != self.serving or problem != self.problem:
            if serving:
                log.warning("healthy again: SERVING")
            else:
                log.warning("NOT_SERVING: %s", problem)
            for name in self.names:
                self.servicer.set(name, SERVING if serving else NOT_SERVING)
        self.serving, self.problem = serving, problem
        return serving
