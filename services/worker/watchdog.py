"""The watchdog: a small process beside each worker that enforces the deadline on user
code and speaks for the worker's liveness while it is busy.

Why a process: a thread cannot interrupt user code that holds the interpreter (one C
call such as ``3999999**999999`` holds the GIL for as long as it runs), and while it
runs no other thread of the worker runs either, heartbeats included. The watchdog
runs in its own interpreter, reads the worker's progress block
(:mod:`services.worker.progress`) and acts:

* **busy, not dead**: while the worker's own heartbeats are late and it is inside a
  batch within its deadline and not stopped (``/proc/PID/stat`` state ``T``), the
  watchdog sends liveness-only heartbeats (``HeartbeatRequest.liveness_only``) for it.
  A stopped, dead or idle-but-silent worker gets none: silence still means dead.
* **deadline**: when a batch overruns ``options.max_batch_seconds`` (time the worker
  spent stopped does not count), the watchdog records the batch's record IDs in the
  store (:mod:`services.worker.overruns`) and SIGKILLs the worker (see :meth:`_Loop.overrun`
  for the order). The ranges move (or the restarted worker takes them back), senders
  resend the unacked batch, and the new owner isolates the recorded records.
* **the worker died**: the watchdog holds the read end of a pipe whose write end only
  the worker has; end-of-file means the worker is gone, and the watchdog exits.

The worker stays the main process (the PID supervisors and tests see); the watchdog
is its child, started with :func:`start`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..rpc import security
from ..store_lock import open_service_store
from . import overruns

log = logging.getLogger("millwheel.watchdog")
SECURITY_ENV = "MILLWHEEL_WATCHDOG_SECURITY"  # the worker's Security, as JSON
STORE_ENV = "MILLWHEEL_WATCHDOG_STORE"  # the worker's store URL
RECORD_FIRST_S = 1.0  # how long recording an overrun may delay the kill


@dataclass
class Watchdog:
    """The worker's handle on its watchdog process."""

    proc: subprocess.Popen[bytes]
    pipe_w: int

    def stop(self) -> None:
        os.close(self.pipe_w)  # end-of-file: the watchdog exits
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start(progress_fd: int, *, controller: str, store_url: str, worker_id: str, address: str,
          metrics_address: str, heartbeat_s: float) -> Watchdog:
    """Start the watchdog of this process (the worker)."""
    pipe_r, pipe_w = os.pipe()
    config = {"pid": os.getpid(), "progress_fd": progress_fd, "pipe_fd": pipe_r,
              "controller": controller, "worker_id": worker_id,
              "address": address, "metrics_address": metrics_address, "heartbeat_s": heartbeat_s}
    # The worker's TLS and cluster secret and the store URL (a Redis password) travel in
    # the environment (readable by the same user only), not on the command line that
    # `ps` shows everyone.
    env = dict(os.environ, **{SECURITY_ENV: json.dumps(dataclasses.asdict(security.process())),
                              STORE_ENV: store_url})
    proc = subprocess.Popen([sys.executable, "-m", f"{__package__}.watchdog", json.dumps(config)],
                            pass_fds=(progress_fd, pipe_r), stdin=subprocess.DEVNULL, env=env)
    os.close(pipe_r)
    return Watchdog(proc, pipe_w)


def _state(pid: int) -> str | None:
    """The process state letter from /proc (R, S, T, Z...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:][:1].decode()


class _Loop:
    def __init__(self, cfg: dict[str, Any]) -> None:
        # Everything a liveness heartbeat needs is imported here, at start: not when the
        # worker is first busy (a 5 MB step of RSS in the middle of a soak, and an
        # import taking time exactly when the worker's liveness depends on it).
        from ..generated import millwheel_pb2, millwheel_pb2_grpc
        from ..rpc.cluster_routes import ClusterRoutes
        from ..rpc.controller_link import ControllerLink, fails_over
        from .progress import ProgressBlock

        self._pb, self._pb_grpc, self._fails_over = millwheel_pb2, millwheel_pb2_grpc, fails_over

        self.cfg = cfg
        self.pid = int(cfg["pid"])
        self.block = ProgressBlock(int(cfg["progress_fd"]))
        self.pipe = int(cfg["pipe_fd"])
        hb = float(cfg["heartbeat_s"])
        self.interval = min(0.5, max(0.05, hb))
        self.late_s = max(0.5, 3 * hb)  # the worker's own heartbeats count as late after this
        security.configure(security.Security(**json.loads(os.environ.pop(SECURITY_ENV, "{}"))))
        self.link = ControllerLink(cfg["controller"])  # the worker's controllers, in its order
        self.routes = ClusterRoutes()  # their cluster ports, as they name them
        self.paused = 0.0  # seconds the worker spent stopped, in all
        self.paused_at: dict[tuple[int, int], float] = {}  # batch -> self.paused when first seen
        self.last_sent = 0.0

    def run(self) -> None:
        # One liveness heartbeat at start (it only moves a live worker's last-seen time):
        # the gRPC channel and its core's threads and buffers are set up now, a one-time
        # ~5 MB of RSS, rather than the first time the worker is busy, which a 30-minute
        # soak saw as a step in the middle of the run (and which costs time exactly when
        # the worker's liveness depends on it).
        self.liveness()
        stopped_since: float | None = None
        while True:
            ready, _, _ = select.select([self.pipe], [], [], self.interval)
            if ready and not os.read(self.pipe, 64):
                return  # the worker is gone
            state = _state(self.pid)
            if state is None or state in "ZX":
                return
            now = time.monotonic()
            if state in "Tt":  # stopped: its time does not count, and it gets no liveness
                stopped_since = stopped_since or now
                continue
            if stopped_since is not None:
                self.paused += now - stopped_since
                stopped_since = None
            self.check(now)

    def check(self, now: float) -> None:
        running = self.block.running()
        seen = {(r.slot, r.seq) for r in running}
        self.paused_at = {k: v for k, v in self.paused_at.items() if k in seen}
        over = []
        for r in running:
            if r.start <= 0.0 or r.deadline_s <= 0.0:  # never written so: not acted on
                log.warning("ignored slot %d of the progress block: start %r, deadline %r",
                            r.slot, r.start, r.deadline_s)
                continue
            paused = self.paused - self.paused_at.setdefault((r.slot, r.seq), self.paused)
            if now - r.start - paused > r.deadline_s:
                over.append(r)
        if over:
            self.overrun(over)
            return
        if running and now - self.block.last_heartbeat() > self.late_s and \
                now - self.last_sent >= self.interval:
            self.last_sent = now
            self.liveness()

    def overrun(self, over: list[Any]) -> None:
        """Record the overdue batches in the store, then kill the worker. The record
        goes first, so the range's next owner sees it when the batch is resent; but
        the stuck worker may hold the store's writer lock (a thread of it waiting for
        the interpreter inside a write), so after ``RECORD_FIRST_S`` it is killed
        anyway and the record completes once the lock is free."""
        batches = [(r, self.block.record_ids(r)) for r in over]
        # Which batch holds the interpreter is known only when one alone is overdue.
        alone = len(batches) == 1 and batches[0][0].n_ids == 1

        def record() -> None:
            store = open_service_store(os.environ[STORE_ENV])
            try:
                for r, ids in batches:
                    if ids:
                        overruns.record(store, r.computation, r.range_id, ids, alone)
            finally:
                store.close()

        recording = threading.Thread(target=record, name="record-overrun")
        recording.start()
        recording.join(RECORD_FIRST_S)
        os.kill(self.pid, signal.SIGKILL)
        for r, _ in batches:
            log.error("worker %s: a batch of %d record(s) or timer(s) of %s/%d has run %.1f s, over its "
                      "deadline of %.1f s: killed the worker", self.cfg["worker_id"], r.n_ids,
                      r.computation, r.range_id, time.monotonic() - r.start, r.deadline_s)
        recording.join(60.0)
        raise SystemExit(0)

    def liveness(self) -> None:
        """One liveness-only heartbeat; a controller that fails it (away, stopped, or a
        standby) leaves the next one to the next controller, as the worker's own do."""
        pb, pb_grpc, fails_over = self._pb, self._pb_grpc, self._fails_over
        address = self.link.current
        target = self.routes.target(address)  # its cluster port, once it named it
        try:
            resp = self.link.stub(pb_grpc.ClusterStub, target).Heartbeat(pb.HeartbeatRequest(
                worker_id=self.cfg["worker_id"], address=self.cfg["address"],
                metrics_address=self.cfg["metrics_address"], liveness_only=True), timeout=1.0)
            self.link.succeeded(address)
            self.routes.answered(address, target, resp.cluster_address)
        except Exception as exc:  # noqa: BLE001 - the controller may be away; try again later
            log.debug("liveness heartbeat to %s failed: %s", target, exc)
            self.routes.failed(address, target)
            if fails_over(exc):
                self.link.failover_from(address, exc)  # type: ignore[arg-type]


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the worker; we follow it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a draining worker still needs us
    _Loop(json.loads(argv[0])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
