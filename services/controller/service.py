"""The controller process: registry, range assignment, watermark authority, queries.

Users register computations and injectors, inject records, subscribe to sink streams
and query watermarks and state; workers heartbeat, report per-range watermarks
(applied to the store only under the range's current token) and get back every
range's owner and token, the registry and the input watermarks they need.

Watermarks are kept durably per range in the store; the controller serves the
minimum per node and never lets a served value go backwards.

**How it is built.** :class:`Controller` is the process: one
:class:`~services.controller.plane.ControlPlane` (what the parts share, and the one lock
over it: its docstring says what the lock guards and who takes it) and one part per
concern, each constructed with the plane and the few other parts it needs:

=================  ==================================  ===================================
part               module                              RPCs
=================  ==================================  ===================================
``leadership``     ha.py (election: leader.py)          (forwarding, redirects, takeover)
``registration``   registration.py                      Register*, UnregisterComputation
``queries``        queries.py                           ListComputations, Describe...,
                                                        GetWatermark, GetState, ListKeys,
                                                        ClusterStatus, Subscribe
``injection``      inject.py (replay.py)                Inject, ReplayDeadLetters
``writers``        writers.py                           InjectRoutes, WriterWatermark
``updates``        update.py                            UpdateComputation
``rescaling``      rescale.py                           RescaleComputation
``heartbeats``     heartbeat_rpc.py                     Heartbeat (the Cluster service)
``savepoints``     savepoint.py (drain.py)              CreateSavepoint, RestoreSavepoint
=================  ==================================  ===================================

:class:`ControllerServicer` is the gRPC table: one line per RPC, delegating to its
part; ``@leader_only`` marks the writes a standby forwards to the leader. Adding an RPC
is: the proto, a handler method on the part it belongs to, one line here.

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
import time
from typing import Any, Iterator, cast

import grpc

from millwheel.clock import SystemClock
from millwheel.connectors.spec import SourcePaths
from millwheel.importing import AllowList
from millwheel.savepoint.format import DEFAULT_MAX_RESTORE_BYTES
from millwheel.state.lease import LeadershipLostError
from millwheel.state.protocol import StateStore
from millwheel.state.url_display import redact

from ..generated import millwheel_pb2 as pb
from ..inject_limits import InjectLimits
from ..metrics import PrometheusSensors
from ..rpc.admission import AdmissionLimits
from ..rpc.health import HealthMonitor
from ..rpc.status import rpc, rpc_stream
from ..store_lock import open_service_store
from .cluster_port import advertised_host, start_servers
from .ha import Leadership, leader_only
from .heartbeat_rpc import Heartbeats
from .inject import INJECT_BATCH, Injection, InjectSettings, WorkerLinks
from .leader import Elector, LeaderStore, lease_store_url
from .plane import ControlPlane, Timeouts
from .queries import Queries
from .registration import Registration
from .rescale import Rescaling
from .retention import RetentionThread
from .savepoint import Savepoints
from .update import Updates
from .writers import WRITER_EXPIRY_S, Writers

log = logging.getLogger("millwheel.controller")
Ctx = grpc.ServicerContext

DEFAULT_MAX_VALUE_BYTES = 1024 * 1024
#: How often the reaper hands every node's watermark to the sensors (a pass over the
#: registry under the lock: at 1,000 computations, ten times a second it was 15% of the
#: controller's GIL samples while registering; issue 34 item 9)
PUBLISH_S = 1.0


class Controller:
    """The controller process: the plane and its parts, the reaper and log retention."""

    def __init__(
        self, store: StateStore, *, heartbeat_timeout_s: float = 3.0,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES, sensors: PrometheusSensors | None = None,
        inject_timeout_s: float = 15.0, inject_wait_s: float = 10.0, inject_batch: int = INJECT_BATCH,
        limits: InjectLimits | None = None, allow_code: AllowList | None = None,
        lease_ttl_s: float = 2.0, takeover_grace_s: float = 10.0, lease_store: StateStore | None = None,
        writer_expiry_s: float = WRITER_EXPIRY_S, max_restore_bytes: int = DEFAULT_MAX_RESTORE_BYTES,
        source_paths: SourcePaths | None = None,
    ) -> None:
        """Nothing runs until :meth:`start`: it leads if it wins the store's lease, else
        stands by (services/controller/ha.py). ``lease_store``: the same store opened
        apart, used for the lease alone, so renewals never queue behind data-plane calls
        on the main store's connections (its pool, a SQLite connection's lock)."""
        self._lease_store = lease_store
        elector = Elector(lease_store or store, "", lease_ttl_s)
        # Every write the controller makes carries the leader epoch (services/controller/leader.py).
        self.plane = plane = ControlPlane(
            store=cast(StateStore, LeaderStore(store, elector)), elector=elector, clock=SystemClock(),
            allow_code=allow_code or AllowList(), sensors=sensors,
            timeouts=Timeouts(heartbeat_s=heartbeat_timeout_s, takeover_grace_s=takeover_grace_s))
        self.rescaling = Rescaling(plane)
        self.leadership = Leadership(plane, finish_interrupted=self.rescaling.finish_interrupted)
        self.links = WorkerLinks(plane)
        self.injection = Injection(plane, self.leadership, self.links, InjectSettings(
            limits=limits or InjectLimits(max_value_bytes=max_value_bytes), batch=inject_batch,
            timeout_s=inject_timeout_s, wait_s=inject_wait_s))
        self.writers = Writers(plane, self.injection, writer_expiry_s)
        self.registration = Registration(plane, source_paths)
        self.queries = Queries(plane, self.leadership, self.writers.least)
        self.updates = Updates(plane)
        self.heartbeats = Heartbeats(plane, self.leadership)
        self.savepoints = Savepoints(plane, self.leadership, hand_over=self.injection.hand_over,
                                     max_restore_bytes=max_restore_bytes)
        self.servicer = ControllerServicer(self)
        self.retention = RetentionThread(plane, plane.clock)  # the leader trims the stream logs
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)

    health_monitor: HealthMonitor | None = None
    cluster_port = 0  # where Cluster (heartbeats) is served apart from clients, once serving

    def start(self, address: str) -> None:
        """Elect (leading at once if the lease is free) and run. ``address``: where the
        other controllers and the workers reach this one (its --advertise)."""
        self.plane.elector.start(address)
        self._reaper.start()
        self.retention.start()

    def close(self) -> None:
        """Stop; a leader hands the lease over at once (a standby takes over)."""
        self.plane.stop.set()
        self.retention.stop()  # saves its marks while still leading
        self.plane.elector.stop(release=True)
        self.plane.work.close()
        if self._lease_store is not None:
            self._lease_store.close()
        self.leadership.close()
        if self.health_monitor is not None:
            self.health_monitor.stop()

    def _reap_loop(self) -> None:
        p = self.plane
        published = 0.0
        while not p.stop.wait(0.1):
            try:
                self.leadership.cancel_stale_forwards()
                if not p.leading():
                    self.leadership.standby_pass()
                else:
                    with p.lock:  # decisions only: the store calls they need run on store-work threads
                        a = p.assigner
                        if a.reap() or a.due:
                            a.rebalance()
                        a.forget_dead()
                p.wms.refresh(p.registry.nodes())
                if time.monotonic() - published >= PUBLISH_S:  # O(nodes): not at every pass
                    published = time.monotonic()
                    with p.lock:
                        p.publish_watermarks()
            except LeadershipLostError as exc:
                log.warning("reaper: %s", exc)
            except Exception:
                log.exception("reaper pass failed")


class ControllerServicer:
    """The Controller and Cluster gRPC services: one line per RPC, to the part that
    handles it. ``@rpc`` turns a MillWheelError into its status; ``@leader_only`` runs
    the call on the leader (a standby forwards it, by the method's name)."""

    def __init__(self, controller: Controller) -> None:
        self.leadership = controller.leadership  # for @leader_only
        self.registration = controller.registration
        self.queries = controller.queries
        self.injection = controller.injection
        self.writers = controller.writers
        self.updates = controller.updates
        self.rescaling = controller.rescaling
        self.heartbeats = controller.heartbeats
        self.savepoints = controller.savepoints

    # -- registry
    @rpc
    @leader_only
    def RegisterComputation(self, request: Any, context: Ctx) -> pb.RegisterComputationResponse:
        return self.registration.register_computation(request, context)

    @rpc
    @leader_only
    def RegisterTopology(self, request: Any, context: Ctx) -> pb.RegisterTopologyResponse:
        return self.registration.register_topology(request, context)

    @rpc
    @leader_only
    def RegisterInjector(self, request: Any, context: Ctx) -> pb.RegisterInjectorResponse:
        return self.registration.register_injector(request, context)

    @rpc
    @leader_only
    def UnregisterComputation(self, request: Any, context: Ctx) -> pb.UnregisterComputationResponse:
        return self.registration.unregister_computation(request, context)

    @rpc
    @leader_only
    def UpdateComputation(self, request: Any, context: Ctx) -> pb.UpdateComputationResponse:
        return self.updates.update(request, context)

    @rpc
    @leader_only
    def RescaleComputation(self, request: Any, context: Ctx) -> pb.RescaleComputationResponse:
        return self.rescaling.rescale(request, context)

    # -- reads (any controller answers)
    @rpc
    def ListComputations(self, request: Any, context: Ctx) -> pb.ListComputationsResponse:
        return self.queries.list_computations(request, context)

    @rpc
    def DescribeComputation(self, request: Any, context: Ctx) -> pb.ComputationInfo:
        return self.queries.describe_computation(request, context)

    @rpc
    def GetWatermark(self, request: Any, context: Ctx) -> pb.GetWatermarkResponse:
        return self.queries.get_watermark(request, context)

    @rpc
    def GetState(self, request: Any, context: Ctx) -> pb.GetStateResponse:
        return self.queries.get_state(request, context)

    @rpc
    def ListKeys(self, request: Any, context: Ctx) -> pb.ListKeysResponse:
        return self.queries.list_keys(request, context)

    @rpc
    def ClusterStatus(self, request: Any, context: Ctx) -> pb.ClusterStatusResponse:
        return self.queries.cluster_status(request, context)

    @rpc_stream
    def Subscribe(self, request: Any, context: Ctx) -> Iterator[pb.SubscribeResponse]:
        return self.queries.subscribe(request, context)

    # -- records in
    def Inject(self, request_iterator: Iterator[Any], context: Ctx) -> pb.InjectResponse:
        return self.injection.inject(request_iterator, context)  # aborts with its own status

    @rpc
    @leader_only
    def InjectRoutes(self, request: Any, context: Ctx) -> pb.InjectRoutesResponse:
        return self.writers.routes(request, context)

    @rpc
    @leader_only
    def WriterWatermark(self, request: Any, context: Ctx) -> pb.WriterWatermarkResponse:
        return self.writers.watermark(request, context)

    @rpc
    @leader_only
    def ReplayDeadLetters(self, request: Any, context: Ctx) -> pb.ReplayDeadLettersResponse:
        return self.injection.replay_dead_letters(request, context)

    # -- savepoints (the leader's; a standby redirects)
    @rpc_stream
    def CreateSavepoint(self, request: Any, context: Ctx) -> Iterator[pb.CreateSavepointResponse]:
        return self.savepoints.create(request, context)

    @rpc
    def RestoreSavepoint(self, request_iterator: Iterator[Any], context: Ctx) -> pb.RestoreSavepointResponse:
        return self.savepoints.restore(request_iterator, context)

    # -- the Cluster service (workers)
    @rpc
    def Heartbeat(self, request: Any, context: Ctx) -> pb.HeartbeatResponse:
        return self.heartbeats.heartbeat(request, context)


def serve(
    store_url: str, host: str = "127.0.0.1", port: int = 7070, metrics_port: int | None = 0,
    heartbeat_timeout_s: float = 3.0, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    inject_wait_s: float = 10.0, inject_batch: int = INJECT_BATCH, limits: InjectLimits | None = None,
    allow_code: str | None = None, advertise: str | None = None, lease_ttl_s: float = 2.0,
    takeover_grace_s: float = 10.0, cluster_port: int = 0, admission: AdmissionLimits | None = None,
    writer_expiry_s: float = WRITER_EXPIRY_S, max_restore_bytes: int = DEFAULT_MAX_RESTORE_BYTES,
    source_paths: SourcePaths | None = None,
) -> tuple[grpc.Server, int, int, Controller]:
    """Start a controller; returns (server, port, metrics port or 0, the Controller). It leads
    or stands by (services/controller/ha.py); ``advertise`` is the host the others
    reach it at (default ``host``, the machine's name when ``host`` is 0.0.0.0).
    Heartbeats have a listener of their own, ``cluster_port``, and client calls are
    admitted under ``admission`` (services/controller/cluster_port.py)."""
    store = open_service_store(store_url)
    lease_store = open_service_store(lease_store_url(store_url, lease_ttl_s))  # its own connection
    sensors = PrometheusSensors("controller")
    service = Controller(store, heartbeat_timeout_s=heartbeat_timeout_s,
                         max_value_bytes=max_value_bytes, sensors=sensors,
                         inject_wait_s=inject_wait_s, inject_batch=inject_batch, limits=limits,
                         allow_code=AllowList.parse(allow_code), lease_ttl_s=lease_ttl_s,
                         takeover_grace_s=takeover_grace_s, lease_store=lease_store,
                         writer_expiry_s=writer_expiry_s, max_restore_bytes=max_restore_bytes,
                         source_paths=source_paths)
    advertise = advertised_host(host, advertise)
    server, bound, cluster_bound, health = start_servers(
        service.servicer, {"Controller": service.servicer}, host, port, cluster_port, advertise,
        admission or AdmissionLimits(), sensors.admission_refused)
    service.health_monitor = HealthMonitor(health, store, problem=service.leadership.readiness_problem)
    service.cluster_port = cluster_bound
    service.start(f"{advertise}:{bound}")
    mport = sensors.serve(host, metrics_port) if metrics_port is not None else 0
    log.info("controller listening on %s:%d, cluster port %d (store %s, metrics %s)", host, bound,
             cluster_bound, redact(store_url), f"port {mport}" if metrics_port is not None else "off")
    return server, bound, mport, service
