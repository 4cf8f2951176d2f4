"""The controller process: registry, range assignment, watermark authority, queries.

Users register computations and injectors, inject records, subscribe to sink streams
and query watermarks and state; workers heartbeat, report per-range watermarks
(applied to the store only under the range's current token) and get back every
range's owner and token, the registry and the input watermarks they need.

Watermarks are kept durably per range in the store; the controller serves the
minimum per node and never lets a served value go backwards.

Parts live in modules of their own: the Inject path in :mod:`services.controller.inject`
(a mixin of :class:`ControllerService`), range assignment in
:mod:`services.controller.assign`, the registry in :mod:`services.controller.registry`
(changed in place by :mod:`services.controller.update`; savepoints in
:mod:`services.controller.savepoint`),
failing user code in :mod:`services.controller.errors`, the replay of dead letters in
:mod:`services.controller.replay`.

The controller's lock is never held across a store call on the paths of heartbeats,
range moves and the reaper: it decides under the lock and makes its store calls on
store-work threads (:mod:`services.controller.store_work`), fenced by tokens as
always; watermarks are answered from the copy kept by
:mod:`services.controller.watermarks`. A Redis shard that is away (a failover, a
stopped master) delays the ranges whose keys live on it, not the heartbeats of every
worker (issue 21, item 4).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

import grpc

from millwheel.clock import SystemClock
from millwheel.errors import InvalidSpecError
from millwheel.importing import AllowList
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.state.lease import LeadershipLostError
from millwheel.state.protocol import StateStore
from millwheel.state.url_display import redact
from millwheel.topology import CodeRef, ComputationSpec, Options

from ..generated import millwheel_pb2 as pb
from ..metrics import PrometheusSensors
from ..rpc import convert
from ..rpc.admission import AdmissionLimits
from ..rpc.health import HealthMonitor
from ..rpc.server import check
from ..rpc.status import PreconditionError, rpc
from ..rpc.worker_link import PeerLink
from ..store_lock import open_service_store
from .assign import Assigner
from .cluster_port import advertised_host, start_servers
from .errors import error_info
from .failing import FailingRanges
from .ha import Replicated, leader_only
from .heartbeat import OwnerTables, TopologyJson
from .heartbeat_rpc import Heartbeats
from .inject import INJECT_BATCH, Injecting
from .leader import Elector, LeaderStore, lease_store_url
from .limits import InjectLimits
from .queries import Queries
from .registry import Registry
from .replay import Replayer
from .rescale import Rescaling
from .rescale_journal import check_not_copying
from .retention import RetentionThread
from .savepoint import Savepoints
from .store_work import StoreWork
from .update import Updating
from .watermarks import Watermarks

log = logging.getLogger("millwheel.controller")
Ctx = grpc.ServicerContext

DEFAULT_MAX_VALUE_BYTES = 1024 * 1024
REBALANCE_CHUNK = 256  # range moves (two store writes each) per hold of the lock after a registration


class ControllerService(Queries, Replicated, Injecting, Updating, Rescaling, Heartbeats, Savepoints):
    def __init__(
        self, store: StateStore, *, heartbeat_timeout_s: float = 3.0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES, sensors: PrometheusSensors | None = None,
        inject_timeout_s: float = 15.0, inject_wait_s: float = 10.0, inject_batch: int = INJECT_BATCH,
        limits: InjectLimits | None = None, allow_code: AllowList | None = None,
        lease_ttl_s: float = 2.0, takeover_grace_s: float = 10.0, lease_store: StateStore | None = None,
    ) -> None:
        """Nothing runs until :meth:`start`: it leads if it wins the store's lease, else
        stands by (services/controller/ha.py). ``lease_store``: the same store opened
        apart, used for the lease alone, so renewals never queue behind data-plane calls
        on the main store's connections (its pool, a SQLite connection's lock)."""
        self.limits = limits or InjectLimits(max_value_bytes=max_value_bytes)
        self.inject_batch = inject_batch
        self.inject_timeout_s = inject_timeout_s
        self.inject_wait_s = inject_wait_s
        self.clock = SystemClock()
        self.sensors = sensors
        self.max_value_bytes = max_value_bytes
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.takeover_grace_s = takeover_grace_s
        self.allow_code = allow_code or AllowList()
        self.lock = threading.RLock()
        self._lease_store = lease_store
        self.elector = Elector(lease_store or store, "", lease_ttl_s, self._on_elected, self._on_deposed)
        # Every write the controller makes carries the leader epoch (services/controller/leader.py).
        self.store = cast(StateStore, LeaderStore(store, self.elector))
        self.work = StoreWork()  # store calls decided under the lock, made outside it
        self.wms = Watermarks(self.store, self.work, self.lock)
        self.registry = Registry(self.store, self.allow_code)
        self.assigner = Assigner(self.store, heartbeat_timeout_s, check_tokens=False)  # a view until elected
        self._pending: dict[tuple[str, int], int] = {}  # outbox entries per range, as last reported
        self._sinks_down: dict[str, dict[str, float]] = {}  # worker -> its failing sinks -> seconds
        self._sink_positions: dict[str, dict[str, int]] = {}  # worker -> its sinks -> committed log position
        self.failing = FailingRanges()  # ranges their owners cannot run, as last reported
        self.topology_json = TopologyJson()  # heartbeats' registry JSON, once per version
        self.owner_tables = OwnerTables()  # heartbeats' owners table (services/controller/heartbeat.py)
        self._links: dict[str, PeerLink] = {}
        self._leader_channels = {}
        self._forwards = {}
        self._forwards_lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        self.replayer = Replayer(self)
        self.retention = RetentionThread(self, self.clock)  # the leader trims the stream logs

    health_monitor: HealthMonitor | None = None
    cluster_port = 0  # where Cluster (heartbeats) is served apart from clients, once serving

    def start(self, address: str) -> None:
        """Elect (leading at once if the lease is free) and run. ``address``: where the
        other controllers and the workers reach this one (its --advertise)."""
        self.elector.start(address)
        self._reaper.start()
        self.retention.start()

    def close(self) -> None:
        """Stop; a leader hands the lease over at once (a standby takes over)."""
        self._stop.set()
        self.retention.stop()  # saves its marks while still leading
        self.elector.stop(release=True)
        self.work.close()
        if self._lease_store is not None:
            self._lease_store.close()
        for ch in self._leader_channels.values():
            ch.close()
        if self.health_monitor is not None:
            self.health_monitor.stop()

    # -- internals -------------------------------------------------------------------
    def _reap_loop(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.cancel_stale_forwards()
                if not self.leading():
                    self._standby_pass()
                else:
                    with self.lock:  # decisions only: the store calls they need run on store-work threads
                        a = self.assigner
                        if a.reap() or a.due:
                            a.rebalance()
                        a.forget_dead()
                self.wms.refresh(self.registry.nodes())
                with self.lock:
                    self._publish_watermarks()
            except LeadershipLostError as exc:
                log.warning("reaper: %s", exc)
            except Exception:
                log.exception("reaper pass failed")

    def _registry_changed(self) -> None:
        self.assigner.sync_units(self.registry.nodes())
        self.assigner.rebalance()

    def _after_registration(self) -> None:
        """After a registry change made outside the controller's lock: its JSON for the
        heartbeats serialized here, on the registering thread; then the units, under the lock."""
        registry = self.registry
        self.topology_json.prime(registry.version, registry.topology)
        nodes = registry.nodes()
        known = set(self.assigner.units)
        tokens = {(n, r): self.store.current_token(n, r)  # read before taking the lock
                  for n, count in nodes.items() for r in range(count) if (n, r) not in known}
        with self.lock:
            self.assigner.sync_units(registry.nodes(), tokens)
        while True:  # moves in chunks: heartbeats get the lock in between
            with self.lock:
                if self.assigner.rebalance(limit=REBALANCE_CHUNK) < REBALANCE_CHUNK:
                    return

    def watermarks(self) -> tuple[dict[str, int], dict[str, int]]:
        """(output watermark of every node, input watermark of every computation), from
        the controller's copy (services/controller/watermarks.py): no store call."""
        nodes = self.registry.nodes()
        out = {node: self.wms.node(node, count) for node, count in nodes.items()}
        topo = self.registry.topology
        inputs = {
            c.name: min((out.get(u, MIN_TIMESTAMP) for u in topo.upstream(c.name)),
                        default=MIN_TIMESTAMP)
            for c in topo.computations
        }
        return out, inputs

    def _publish_watermarks(self) -> None:
        if self.sensors is None:
            return
        self.sensors.controller_role(self.leading(), self.elector.leader_epoch)
        out, _ = self.watermarks()
        now = self.clock.now_us()
        self.sensors.keep_nodes(set(out))  # no series for what is no longer registered
        for node, wm in out.items():
            self.sensors.watermark(node, wm, now - wm if wm > MIN_TIMESTAMP else 0)

    def _node_wm_proto(self, node: str, out: dict[str, int], inputs: dict[str, int]) -> pb.NodeWatermark:
        wm = out[node]
        now = self.clock.now_us()
        lag = 0 if wm <= MIN_TIMESTAMP or wm >= MAX_TIMESTAMP else max(0, now - wm)
        return pb.NodeWatermark(node=node, low_watermark=wm,
                                input_low_watermark=inputs.get(node, out[node]), lag_us=lag)

    def _ranges(self, node: str | None = None) -> list[pb.RangeInfo]:
        out = []
        wms: dict[str, dict[int, int]] = {}
        for (n, r), owner in sorted(self.assigner.units.items()):
            if node is not None and n != node:
                continue
            if n not in wms:
                wms[n] = self.wms.of(n)
            w = self.assigner.workers.get(owner.worker_id or "")
            out.append(pb.RangeInfo(
                node=n, range_id=r, worker_id=owner.worker_id or "",
                worker_address=w.address if w else "", token=owner.token,
                watermark=wms[n].get(r, MIN_TIMESTAMP), pending=self._pending.get((n, r), 0),
                failure=self.failing.of((n, r), owner)))
        return out

    def _info(self, name: str, wms: tuple[dict[str, int], dict[str, int]] | None = None) -> pb.ComputationInfo:
        inj = self.registry.injector(name[len("injector:"):]) if name.startswith("injector:") else None
        # An injector pulling a source is described as a one-range node whose dead letters
        # are the entries that were not records (`millwheel errors injector:NAME`).
        spec = self.registry.computation(name) if inj is None else ComputationSpec(
            name, (), (inj.stream,), CodeRef("source"),
            Options(key_ranges=1, dead_letter_stream=inj.dead_letter_stream))
        out, inputs = wms or self.watermarks()  # once for a whole list
        return pb.ComputationInfo(spec=convert.spec_to_proto(spec), low_watermark=out[name],
                                  input_low_watermark=inputs.get(name, out[name]), ranges=self._ranges(name),
                                  version=self.registry.version_of(name),
                                  has_previous=name in self.registry.previous,
                                  **error_info(self.store, spec, self.failing.of_node(name, self.assigner.units)))

    # -- registry --------------------------------------------------------------------
    @rpc
    @leader_only
    def RegisterComputation(self, request: Any, context: Ctx) -> pb.RegisterComputationResponse:
        check(request)
        if not request.HasField("spec"):
            raise InvalidSpecError("RegisterComputation: 'spec' is required")
        spec = convert.spec_from_proto(request.spec)
        with self.registry.changing:  # validated and stored without the controller's lock
            self.registry.register_computation(spec, tuple(request.log_streams))
            self._after_registration()
        log.info("registered computation %r", spec.name)
        with self.lock:
            return pb.RegisterComputationResponse(computation=self._info(spec.name))

    @rpc
    @leader_only
    def RegisterTopology(self, request: Any, context: Ctx) -> pb.RegisterTopologyResponse:
        """All of it or nothing: validated whole, stored in one write."""
        check(request)
        comps = [convert.spec_from_proto(s) for s in request.computations]
        injectors = convert.injectors_from_proto(request.injectors)
        sinks = convert.sinks_from_proto(request.sinks)
        with self.registry.changing:  # validated and stored without the controller's lock
            new_comps, new_injs = self.registry.register_topology(comps, injectors, request.log_streams, sinks)
            if new_comps or new_injs or sinks:
                self._after_registration()
        log.info("registered %s", [*(c.name for c in new_comps), *(i.name for i in new_injs)] or "nothing new")
        with self.lock:
            wms = self.watermarks()
            return pb.RegisterTopologyResponse(
                computations=[self._info(c.name, wms) for c in comps],
                injectors=[convert.injector_to_proto(i) for i in injectors],
                registered=[*(c.name for c in new_comps), *(i.name for i in new_injs)])

    @rpc
    @leader_only
    def RegisterInjector(self, request: Any, context: Ctx) -> pb.RegisterInjectorResponse:
        check(request)
        spec = convert.injectors_from_proto([request.spec])[0]
        with self.registry.changing:
            if self.registry.register_injector(spec):
                self._after_registration()
                log.info("registered injector %r -> stream %r", spec.name, spec.stream)
        return pb.RegisterInjectorResponse(injector=convert.injector_to_proto(spec))

    @rpc
    @leader_only
    def UnregisterComputation(self, request: Any, context: Ctx) -> pb.UnregisterComputationResponse:
        check(request)
        with self.registry.changing:
            check_not_copying(self.assigner, request.name, "unregistration")
            self.registry.unregister_computation(request.name)
            self._after_registration()
        return pb.UnregisterComputationResponse()

    @rpc
    def ListComputations(self, request: Any, context: Ctx) -> pb.ListComputationsResponse:
        check(request)
        with self.lock:
            topo = self.registry.topology
            wms = self.watermarks()
            return pb.ListComputationsResponse(
                computations=[self._info(c.name, wms) for c in topo.computations],
                injectors=[convert.injector_to_proto(i) for i in topo.injectors])

    @rpc
    def DescribeComputation(self, request: Any, context: Ctx) -> pb.ComputationInfo:
        check(request)
        with self.lock:
            return self._info(request.name)

    # -- queries are in services/controller/queries.py; Inject in services/controller/inject.py
    @rpc
    @leader_only
    def ReplayDeadLetters(self, request: Any, context: Ctx) -> pb.ReplayDeadLettersResponse:
        check(request)
        if self.assigner.stopped or self.assigner.draining:  # its records would come after the end
            raise PreconditionError("ReplayDeadLetters: this service is stopped with a savepoint or draining "
                                    "(savepoint create --drain) and takes no more records")
        return self.replayer.replay(request.computation, context)


def serve(
    store_url: str, host: str = "127.0.0.1", port: int = 7070, metrics_port: int | None = 0,
    heartbeat_timeout_s: float = 3.0, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    inject_wait_s: float = 10.0, inject_batch: int = INJECT_BATCH, limits: InjectLimits | None = None,
    allow_code: str | None = None, advertise: str | None = None, lease_ttl_s: float = 2.0,
    takeover_grace_s: float = 10.0, cluster_port: int = 0, admission: AdmissionLimits | None = None,
) -> tuple[grpc.Server, int, int, ControllerService]:
    """Start a controller; returns (server, port, metrics port or 0, service). It leads
    or stands by (services/controller/ha.py); ``advertise`` is the host the others
    reach it at (default ``host``, the machine's name when ``host`` is 0.0.0.0).
    Heartbeats have a listener of their own, ``cluster_port``, and client calls are
    admitted under ``admission`` (services/controller/cluster_port.py)."""
    store = open_service_store(store_url)
    lease_store = open_service_store(lease_store_url(store_url, lease_ttl_s))  # its own connection
    sensors = PrometheusSensors("controller")
    service = ControllerService(store, heartbeat_timeout_s=heartbeat_timeout_s,
                                max_value_bytes=max_value_bytes, sensors=sensors,
                                inject_wait_s=inject_wait_s, inject_batch=inject_batch, limits=limits,
                                allow_code=AllowList.parse(allow_code), lease_ttl_s=lease_ttl_s,
                                takeover_grace_s=takeover_grace_s, lease_store=lease_store)
    advertise = advertised_host(host, advertise)
    server, bound, cluster_bound, health = start_servers(
        service, {"Controller": service}, host, port, cluster_port, advertise, admission or AdmissionLimits(),
        sensors.admission_refused)
    service.health_monitor = HealthMonitor(health, store, problem=service.readiness_problem)
    service.cluster_port = cluster_bound
    service.start(f"{advertise}:{bound}")
    mport = sensors.serve(host, metrics_port) if metrics_port is not None else 0
    log.info("controller listening on %s:%d, cluster port %d (store %s, metrics %s)", host, bound,
             cluster_bound, redact(store_url), f"port {mport}" if metrics_port is not None else "off")
    return server, bound, mport, service
