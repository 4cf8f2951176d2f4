"""The worker process: owns key ranges and moves records between them.

Three loops share the owned ranges (each range's lock serialises them):

* heartbeat (every ``heartbeat_s``), here: report each owned range's low watermark with
  its token; receive every range's owner and token, the registry and input watermarks;
  drop ranges that moved and queue new ones, which taker threads build
  (:mod:`services.worker.taker`: a :class:`~millwheel.runtime.range_worker.RangeWorker`
  with the controller's token), so a slow build never delays a heartbeat;
* pump, in :mod:`services.worker.send` (:class:`~services.worker.send.Sender`): fire
  due timers, and send each range's outbox in slices: sink streams go to the stream
  log, consumer ranges owned here are processed in place, others go to their owner
  over a :class:`~services.rpc.worker_link.PeerLink`; entries are deleted
  (``outbox.ack``) only once the consumer has checkpointed them;
* the Deliver servicer, in :mod:`services.worker.receive`
  (:class:`~services.worker.receive.DeliverServicer`,
  :class:`~services.worker.receive.Receiver`): order injection messages, dedup, run
  user code and checkpoint a received batch, then ack it (the exactly-once sequence
  of ``millwheel.runtime.range_worker``).

The receiver and the sender are parts of the process, each handed what it uses: the
state the parts share (:class:`~services.worker.shared.Shared`: the owned ranges, the
cluster as last heard), the links to other workers
(:class:`~services.worker.delivery.PeerLinks`), and plain callables where it calls
back: the sender is handed the receiver's ``process``, ``commit`` and ``rebuild``; both
are handed this module's ``_fenced``, and the receiver its ``_drop`` and
``_new_range_worker``. Neither module imports the other.

A :class:`~millwheel.errors.FencedError` anywhere means the range moved: drop it.
SIGTERM drains: the controller moves every range away, then the process exits.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import grpc

from millwheel.clock import SystemClock
from millwheel.connectors.spec import SourcePaths
from millwheel.errors import FencedError, MissingDependencyError, PermissionDeniedError
from millwheel.importing import AllowList, CodeReloadError
from millwheel.nodes import injector_node, is_injector, is_sink, sink_node
from millwheel.operators import build_computation
from millwheel.record import MIN_TIMESTAMP
from millwheel.runtime.crash import crash_hook_from_env
from millwheel.runtime.failures import error_json
from millwheel.runtime.local_runner import relax_young_gc
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router
from millwheel.state.protocol import Checkpoint
from millwheel.topology import Topology

from ..generated import millwheel_pb2 as pb
from ..generated import millwheel_pb2_grpc as pb_grpc
from ..inject_limits import InjectLimits
from ..metrics import PrometheusSensors
from ..rpc import topology_delta
from ..rpc.admission import AdmissionLimits
from ..rpc.cluster_routes import ClusterRoutes
from ..rpc.controller_link import ControllerLink, fails_over, leader_hint
from ..rpc.health import HealthMonitor
from ..rpc.server import start_server
from ..store_lock import open_service_store
from . import watchdog
from .code import UserCode
from .connectors import Connectors
from .delivery import PeerLinks
from .failing import RangeFailures
from .ingest import IngestServicer, start_ingest
from .parking import UnitOf
from .progress import NoProgress, ProgressBlock
from .receive import DeliverServicer, Receiver
from .reports import REFRESH_RANGES_PER_S, REPORT_REFRESH_S, report_due
from .send import Sender
from .shared import Shared
from .taker import Taker
from .units import OwnedRange, merged_owners, share_cache

log = logging.getLogger("millwheel.worker")
Unit = tuple[str, int]


class WorkerProcess:
    """A worker process: the heartbeat and range ownership here, receiving and sending
    in its parts ``receiver`` and ``sender`` (see the module docstring)."""

    def __init__(
        self, controller: str, store_url: str, *, host: str = "127.0.0.1", port: int = 0,
        metrics_port: int | None = 0, worker_id: str | None = None, advertise: str | None = None,
        batch_size: int = 5000,
        max_inflight: int = 8, max_slices: int = 4, max_injector_outbox: int = 50_000,
        heartbeat_s: float = 0.1, delivery_timeout_s: float = 5.0, weak_wait_s: float = 1.0,
        min_heartbeat_s: float = 0.025, allow_code: str | None = None, use_watchdog: bool = True,
        inject_limits: InjectLimits | None = None, ingest_port: int = 0,
        ingest_admission: AdmissionLimits | None = None, source_paths: SourcePaths | None = None,
    ) -> None:
        # As in local mode: a worker allocates a few objects per record and keeps many
        # alive (outbox mirrors, caches); CPython's young collections every 700
        # allocations traversed them again and again.
        relax_young_gc()
        self.allow_code = AllowList.parse(allow_code)
        # The version of each computation whose user modules are loaded here (code.py):
        # a new version's ranges are built from the modules as their files are now.
        self.code = UserCode(self.allow_code)
        self.code_versions: dict[str, int] = {}  # computation -> its version, as last heard
        # One controller or several (comma-separated): heartbeats fail over between them.
        self.controller_link = ControllerLink(controller)
        self.cluster_routes = ClusterRoutes()  # each controller's cluster port, as it named it
        self.store = open_service_store(store_url)
        self.sensors = PrometheusSensors("worker")
        self.clock = SystemClock()
        self.crash = crash_hook_from_env()
        self.batch_size = batch_size
        self.max_injector_outbox = max_injector_outbox
        self.min_heartbeat_s = min(min_heartbeat_s, heartbeat_s)
        self.heartbeat_s = heartbeat_s
        # The owned ranges and the cluster as last heard, shared with the parts (shared.py).
        self.shared = Shared()
        self.failures = RangeFailures()  # ranges it cannot build or checkpoint (services/worker/failing.py)
        self._assigned: dict[Unit, int] = {}  # ranges assigned here -> token, as last heard
        self._mine: dict[Unit, int] = {}  # the same, from the owners table (heartbeat thread)
        self._known_assignments = (0, 0)  # (epoch, version) of the owners table held
        self._topology_deltas = True  # False: the last delta did not apply, the whole registry next
        self.peers = PeerLinks(max_inflight, self.sensors)  # links to other workers (delivery.py)
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self._fenced_unreported: list[tuple[str, int, int]] = []
        self._refused_at: dict[tuple[str, str], float] = {}  # (computation, reason) -> last logged
        self.refused: set[str] = set()  # computations our --allow-code refuses (told the controller)
        # User code runs under a deadline kept by a watchdog process (services/worker/watchdog.py).
        self.progress = ProgressBlock() if use_watchdog else NoProgress()
        watched = isinstance(self.progress, ProgressBlock)  # a watchdog is started below
        self.receiver = Receiver(
            self.shared, self.peers, self.store, self.failures, clock=self.clock, crash=self.crash,
            progress=self.progress, watched=watched, batch_size=batch_size,
            max_injector_outbox=max_injector_outbox, weak_wait_s=weak_wait_s,
            fenced=self._fenced, drop=self._drop, new_range_worker=self._new_range_worker)
        self.sender = Sender(
            self.shared, self.peers, self.store, self.failures, sensors=self.sensors, crash=self.crash,
            progress=self.progress, watched=watched, stopped=self.stopped, batch_size=batch_size,
            max_slices=max_slices, max_injector_outbox=max_injector_outbox,
            delivery_timeout_s=delivery_timeout_s, process=self.receiver.process,
            commit=self.receiver.commit, rebuild=self.receiver.rebuild, fenced=self._fenced)
        self.server, self.port, self.health = start_server(
            f"{host}:{port}", {"Worker": DeliverServicer(self.receiver, self.shared)})
        # Writers (parallel ingestion) on a listener of its own, its threads under client
        # admission: however many streams a client opens, the Worker service's threads
        # (records between workers, the controller's hand-overs) stay free.
        self.ingest_server, self.ingest_port, self.ingest_admission = start_ingest(
            host, ingest_port, IngestServicer(self.receiver, self.shared, inject_limits or InjectLimits()),
            ingest_admission or AdmissionLimits())
        if advertise is None:
            advertise = socket.getfqdn() if host in ("0.0.0.0", "::", "") else host
        self.address = f"{advertise}:{self.port}"
        self.ingest_address = f"{advertise}:{self.ingest_port}"
        self.worker_id = self.shared.worker_id = worker_id or f"{self.address}/{os.getpid()}"
        self.metrics_port = self.sensors.serve(host, metrics_port) if metrics_port is not None else 0
        self.metrics_address = f"{advertise}:{self.metrics_port}" if self.metrics_port else ""
        self.watchdog = watchdog.start(
            self.progress.fd, controller=",".join(self.controller_link.addresses), store_url=store_url,
            worker_id=self.worker_id,
            address=self.address, metrics_address=self.metrics_address, heartbeat_s=heartbeat_s,
        ) if isinstance(self.progress, ProgressBlock) else None
        self._hb_failing_since: float | None = None
        # (node, range, token) -> (watermark, pending, when) last reported to _reported_to
        self._reported: dict[tuple[str, int, int], tuple[int, int, float]] = {}
        self._reported_to: str | None = None
        self.taker = Taker(self._take, self.stopped)
        self.health_monitor = HealthMonitor(self.health, self.store, controller_failing_s=lambda: (
            0.0 if self._hb_failing_since is None else time.monotonic() - self._hb_failing_since))
        self._threads = [
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self.sender.pump_loop, name="pump", daemon=True),
        ]
        self.connectors = Connectors(  # pulled sources and sinks (services/worker/connectors.py)
            self.shared, self.store, self.sensors, self.stopped, batch_size=self.batch_size,
            max_injector_outbox=self.max_injector_outbox, fenced=self._fenced, report_fenced=self._report_fenced,
            failures=self.failures, source_paths=source_paths or SourcePaths())
        for t in self._threads:
            t.start()
        log.info("worker %s listening on %s (metrics %s)", self.worker_id, self.address,
                 self.metrics_address or "off")

    # -- lifecycle ---------------------------------------------------------------------
    def drain_and_stop(self, timeout_s: float = 15.0) -> None:
        """Graceful shutdown: ask the controller to move every range away, wait until
        none is left (or the timeout), then stop. Every checkpoint is already durable."""
        log.info("worker %s draining", self.worker_id)
        self.draining.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (self.shared.units or not self._drain_seen):
            time.sleep(0.05)
        self.stop()

    _drain_seen = False

    def stop(self) -> None:
        self.stopped.set()
        self.ingest_server.stop(grace=1.0).wait(2.0)
        self.ingest_admission.close()
        self.server.stop(grace=1.0).wait(2.0)
        for t in [*self._threads, *self.connectors.threads]:
            t.join(timeout=2.0)
        self.taker.stop()
        self.peers.close()
        self.controller_link.close()
        self.health_monitor.stop()
        if self.watchdog is not None:
            self.watchdog.stop()
        self.store.close()
        log.info("worker %s stopped", self.worker_id)

    # -- heartbeat ---------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        """Heartbeat every ``heartbeat_s``, or sooner (at most every ``min_heartbeat_s``)
        when a watermark may have moved: an input watermark came in, an outbox drained,
        timers fired or an injector advanced. A watermark then crosses a stage in about
        a round trip to the controller rather than a heartbeat period.

        A heartbeat that fails with UNAVAILABLE or DEADLINE_EXCEEDED moves to the next
        controller (the leader a standby names, else the next address; see
        :mod:`services.rpc.controller_link`) for the next heartbeat; the owned ranges are
        worked on meanwhile, as while no controller answers at all."""
        last_error = 0.0
        while not self.stopped.is_set():
            self.shared.hb_wake.wait(self.heartbeat_s)
            self.shared.hb_wake.clear()
            started = time.monotonic()
            try:
                self._heartbeat_once()
                self.progress.heartbeat_ok()
                self._hb_failing_since = None
            except grpc.RpcError as exc:
                self._hb_failing_since = self._hb_failing_since or time.monotonic()
                if leader_hint(exc) is not None:  # a standby naming the leader: the link goes there
                    log.info("heartbeat went to a standby: %s", exc.details())
                elif time.monotonic() - last_error > 5.0:
                    last_error = time.monotonic()
                    log.warning("heartbeat to controller failed: %s: %s; working on with "
                                "current ranges", exc.code().name, exc.details())
            except Exception:
                log.exception("heartbeat failed")
            self.stopped.wait(max(0.0, self.min_heartbeat_s - (time.monotonic() - started)))

    def _heartbeat_once(self) -> None:
        reports = []
        draining = self.draining.is_set()
        now = time.monotonic()
        if self.controller_link.current != self._reported_to:  # it hears every range afresh
            self._reported, self._reported_to = {}, self.controller_link.current
        sent: dict[tuple[str, int, int], tuple[int, int, float]] = {}
        refresh = max(REPORT_REFRESH_S, len(self.shared.units) / REFRESH_RANGES_PER_S)
        for owned in list(self.shared.units.values()):
            wm = owned.report_nowait(self.shared.input_wms.get(owned.node, MIN_TIMESTAMP))  # never waits
            if owned.dropped or wm is None:
                continue
            pending = len(owned.outbox) if owned.outbox is not None else 0
            unit = (owned.node, owned.range_id, owned.token)
            if not report_due(self._reported.get(unit), wm, pending, now, refresh):
                continue
            sent[unit] = (wm, pending, now)
            reports.append(pb.WatermarkReport(node=owned.node, range_id=owned.range_id,
                                              token=owned.token, watermark=wm, pending=pending,
                                              held=owned.held if wm < owned.input_wm else ""))
        for node, range_id, token, wm in self.connectors.watermarks():  # connector sinks
            unit = (node, range_id, token)
            if report_due(self._reported.get(unit), wm, 0, now, refresh):
                sent[unit] = (wm, 0, now)
                reports.append(pb.WatermarkReport(node=node, range_id=range_id, token=token, watermark=wm))
        fenced, self._fenced_unreported = self._fenced_unreported, []
        reports += [pb.WatermarkReport(node=n, range_id=r, token=t, watermark=MIN_TIMESTAMP)
                    for n, r, t in fenced]
        link = self.controller_link
        address = link.current
        target = self.cluster_routes.target(address)  # its cluster port, once it named it
        try:
            resp = link.stub(pb_grpc.ClusterStub, target).Heartbeat(pb.HeartbeatRequest(
                worker_id=self.worker_id, address=self.address, metrics_address=self.metrics_address,
                ingest_address=self.ingest_address, draining=draining,
                known_topology_version=self.shared.version, topology_deltas=self._topology_deltas, reports=reports,
                refused=sorted(self.refused), failing=self.failures.reports(), incremental=True,
                known_assignments_epoch=self._known_assignments[0],
                known_assignments_version=self._known_assignments[1],
                sinks_down=self.connectors.down(),
                sink_positions=self.connectors.positions()), timeout=link.deadline_s)
        except grpc.RpcError as exc:
            self._fenced_unreported = fenced + self._fenced_unreported  # report them next time
            self.cluster_routes.failed(address, target)
            if fails_over(exc):
                link.failover_from(address, exc)
            raise
        link.succeeded(address)
        self.cluster_routes.answered(address, target, resp.cluster_address)
        live = {(o.node, o.range_id, o.token) for o in self.shared.units.values()}
        self._reported = {u: v for u, v in self._reported.items() if u in live}
        self._reported.update(sent)
        if draining:
            self._drain_seen = True
        self._apply(resp)

    def _apply(self, resp: pb.HeartbeatResponse) -> None:
        if resp.topology_json or resp.topology_delta_json:  # whole, or the changes to what it holds
            topology = topology_delta.received(self.shared.topology, self.shared.version, resp)
            self._topology_deltas = topology is not None
            if topology is not None:
                self.code_versions = dict(resp.computation_versions)  # before the topology the builds read
                self._set_topology(topology, resp.topology_version)
        shared = self.shared
        owners = merged_owners(shared.owners, resp)  # None: unchanged (services/worker/units.py)
        if owners is not None:
            shared.owners = owners
            self._mine = {u: o.token for u, o in owners.items() if o.worker_id == self.worker_id}
        self._known_assignments = (resp.assignments_epoch, resp.assignments_version)
        for node, wm in resp.input_watermarks.items():
            if wm > shared.input_wms.get(node, MIN_TIMESTAMP):
                shared.input_wms[node] = wm
                if any(u[0] == node for u in shared.units):
                    shared.hb_wake.set()  # report what the new input watermark lets through
        fenced = {(f.node, f.range_id, f.token) for f in resp.fenced}
        mine = self._mine
        with shared.units_lock:  # a take finishing now sees either the old or the new assignment
            self._assigned = mine
        for unit, owned in list(shared.units.items()):
            if mine.get(unit) != owned.token or (unit[0], unit[1], owned.token) in fenced:
                self._drop(owned, "moved to another worker")
        self.failures.keep(mine)
        self.connectors.keep(mine, fenced)
        for unit, token in sorted(mine.items()):  # a range failing to build waits for its retry
            if unit not in shared.units and not is_sink(unit[0]) \
                    and (unit[0], unit[1], token) not in shared.fenced_tokens and self.failures.due(unit):
                self.taker.want(unit, token)  # built on a taker thread (services/worker/taker.py)
        self.sensors.owned_ranges(len(shared.units))
        share_cache(shared.units)  # the worker's state-cache budget over its ranges (units.py)
        shared.wake.set()

    def _set_topology(self, topology: Topology, version: int) -> None:
        shared = self.shared
        shared.topology = topology
        shared.version = version
        self.refused.clear()  # a computation may have been registered again with other code
        self.code.keep({c.name for c in topology.computations})
        shared.router = Router(topology, self.allow_code)
        old, shared.unit_of = shared.unit_of, UnitOf(topology)
        self.sensors.keep_nodes({c.name for c in topology.computations}
                                | {injector_node(i.name) for i in topology.injectors}
                                | {sink_node(s.name) for s in topology.sinks})
        for owned in list(shared.units.values()):
            if owned.worker is not None:
                owned.worker.router = shared.router
            if owned.consumers.parked_under is None:  # the pump re-sorts what it parked or backs off
                owned.consumers.parked_under = old
        log.info("registry version %d: %d computations, %d injectors", version,
                 len(topology.computations), len(topology.injectors))

    def _new_range_worker(self, node: str, range_id: int, token: int) -> RangeWorker:
        spec = self.shared.topology.computation(node)
        version = self.code_versions.get(node, 1)
        for exc in self.code.prepare(spec, version):  # a new version: its modules loaded again (code.py)
            self._reload_failed(spec.name, range_id, token, version, exc)
        computation = build_computation(spec, self.allow_code)
        self.code.built(spec)
        return RangeWorker(spec, range_id, self.store, computation, self.shared.router,
                           self.clock, self.sensors, self.crash, token=token)

    def _reload_failed(self, node: str, range_id: int, token: int, version: int, exc: CodeReloadError) -> None:
        """A module of ``node`` did not load again: the range runs the code loaded before.
        Written to the computation's recent errors (outcome ``reload_failed``), in a
        checkpoint of the range being built under its token, so ``millwheel errors``,
        ``status``, DescribeComputation and the console show it; a store failure here
        only leaves it to the log."""
        now = self.clock.now_us()
        message = (f"{exc} (on worker {self.worker_id}); version {version} of computation {node!r} runs the "
                   "code loaded before: fix the module and run 'millwheel update --reload' again")
        try:
            self.store.checkpoint(Checkpoint(
                computation=node, range_id=range_id, token=token, now_us=now,
                errors=[error_json(item_id="", key="", exc_type=exc.exc_type, message=message, time_us=now,
                                   attempts=0, outcome="reload_failed", range_id=range_id)]))
        except Exception as store_exc:  # noqa: BLE001 - fenced or a store error: the log has it
            log.warning("computation %r: reload failure not recorded: %s", node, store_exc)

    def _take(self, unit: Unit, token: int) -> None:
        """Build the range and own it (on a taker thread: services/worker/taker.py). A
        range that cannot be built stays untaken here, failing (services/worker/failing.py);
        the other ranges go on. The token is the one assigned when the build starts; a
        build whose assignment changed meanwhile is discarded."""
        node, range_id = unit
        shared = self.shared
        token = self._assigned.get(unit, token)
        if unit in shared.units or unit not in self._assigned or self.stopped.is_set() \
                or (node, range_id, token) in shared.fenced_tokens:
            return
        try:
            if is_injector(node):
                owned = OwnedRange(node, range_id, token, self.store)
            elif is_sink(node):
                return  # run by self.connectors (keep)
            elif any(c.name == node for c in shared.topology.computations):
                rw = self._new_range_worker(node, range_id, token)
                owned = OwnedRange(node, range_id, token, self.store, worker=rw)
            else:
                return
        except (PermissionDeniedError, MissingDependencyError) as exc:
            # Refused when our --allow-code is narrower than the controller's, or for a Spark
            # stage where pyspark is not installed: another worker may take it.
            self._refused(node, str(exc) if isinstance(exc, MissingDependencyError) else
                          f"{exc} (this worker's --allow-code: {self.allow_code.describe()})")
            self.failures.failed(unit, "refused", exc, quiet=True)
            return
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - its code or its store: the range's
            self.failures.failed(unit, "build", exc)  # failure (sys.exit() in a constructor too)
            return
        with shared.units_lock:
            if self._assigned.get(unit) != token or (node, range_id, token) in shared.fenced_tokens:
                log.info("not taking %s/%d (token %d): its assignment changed while it was built",
                         node, range_id, token)
                return
            if owned.worker is not None:
                owned.worker.router = shared.router  # the topology may have changed during the build
            shared.units[unit] = owned
        self.failures.succeeded(unit)
        shared.hb_wake.set()  # report the new range's watermark soon
        shared.wake.set()
        log.info("took %s/%d (token %d)", node, range_id, token)

    def _refused(self, node: str, reason: str) -> None:
        """Log a computation this worker may not run once per (computation, reason) a
        minute: the heartbeat retries the take every period."""
        self.refused.add(node)  # reported with the next heartbeat: the controller moves its ranges
        now = time.monotonic()
        last = self._refused_at.get((node, reason))
        if last is None or now - last >= 60.0:
            self._refused_at[(node, reason)] = now
            log.warning("not taking ranges of computation %r: %s", node, reason)

    def _drop(self, owned: OwnedRange, reason: str) -> None:
        owned.dropped = True  # without the lock: a batch may hold it (its writes are fenced)
        with self.shared.units_lock:
            if self.shared.units.get((owned.node, owned.range_id)) is owned:
                del self.shared.units[(owned.node, owned.range_id)]
        log.info("dropped %s/%d (token %d): %s", owned.node, owned.range_id, owned.token, reason)

    def _report_fenced(self, entry: tuple[str, int, int]) -> None:
        """A range fenced under ``entry``'s token, told to the controller with the next heartbeat."""
        self._fenced_unreported.append(entry)

    def _fenced(self, owned: OwnedRange, exc: FencedError) -> None:
        self.sensors.fenced(owned.node, owned.range_id)
        entry = (owned.node, owned.range_id, owned.token)
        if entry not in self.shared.fenced_tokens:
            self.shared.fenced_tokens.add(entry)
            self._fenced_unreported.append(entry)
        self._drop(owned, str(exc))
