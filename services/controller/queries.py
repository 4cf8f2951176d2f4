"""The controller's read-only RPCs: watermarks, state, keys, cluster status, Subscribe.

Every controller answers these itself, leader or standby (a standby from the registry
and assignment it re-reads from the store; services/controller/ha.py), except
ClusterStatus, which a standby forwards to the leader: only the leader hears the
workers' heartbeats, so only it knows which are alive.

:class:`Queries` is a mixin of :class:`services.controller.service.ControllerService`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator, TypeVar

import grpc

from millwheel.clock import SystemClock
from millwheel.errors import InvalidSpecError, NotFoundError
from millwheel.keys import key_range
from millwheel.limits import MAX_NAME_CHARS
from millwheel.runtime.retention import read_retained
from millwheel.state.protocol import StateStore
from millwheel.state.url_display import redact
from millwheel.topology import ComputationSpec, injector_node

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from ..rpc.server import check
from ..rpc.status import UnavailableError, rpc, rpc_stream
from .assign import Assigner
from .leader import Elector
from .registry import Registry
from .rescale_journal import read_keyed
from .watermarks import Watermarks

log = logging.getLogger("millwheel.controller")
T = TypeVar("T")
STANDBY_READ_S = 10.0  # how long a standby's GetWatermark waits for the store's values
Ctx = grpc.ServicerContext


class Queries:
    """GetWatermark, GetState, ListKeys, ClusterStatus, Subscribe (a mixin of ControllerService)."""

    # Set by ControllerService.__init__ (services/controller/service.py) or defined by its other parts.
    store: StateStore
    registry: Registry
    assigner: Assigner
    lock: threading.RLock
    wms: Watermarks
    elector: Elector
    clock: SystemClock
    _stop: threading.Event
    address: str
    leading: Callable[[], bool]
    forward: Callable[[str, Any, Ctx], Any]
    watermarks: Callable[[], tuple[dict[str, int], dict[str, int]]]
    _node_wm_proto: Callable[[str, dict[str, int], dict[str, int]], pb.NodeWatermark]
    _ranges: Callable[..., list[pb.RangeInfo]]
    fresh_view: Callable[[], bool]

    def _looked_up(self, lookup: Callable[[], T]) -> T:
        """``lookup()``; if it finds no such name on a standby, once more after re-reading
        the store's view (a user who registered through the leader and reads through a
        standby must not get NOT_FOUND for what exists)."""
        try:
            return lookup()
        except NotFoundError:
            if not self.fresh_view():
                raise
            return lookup()

    # -- queries ---------------------------------------------------------------------
    @rpc
    def GetWatermark(self, request: Any, context: Ctx) -> pb.GetWatermarkResponse:
        check(request)

        def answer() -> pb.GetWatermarkResponse:
            if not self.leading():  # a standby's copy may lag what the leader served: the store's now
                self.wms.refresh_now(self.registry.nodes(), STANDBY_READ_S)
            with self.lock:
                out, inputs = self.watermarks()
                if request.computation:
                    node = request.computation
                    if node not in out and injector_node(node) in out and node not in inputs:
                        node = injector_node(node)
                    if node not in out:
                        raise NotFoundError(
                            f"no computation or injector named {request.computation[:MAX_NAME_CHARS]!r} "
                            f"(known: {', '.join(sorted(out)) or 'none registered'})")
                    nodes = [node]
                else:
                    nodes = sorted(out)
                return pb.GetWatermarkResponse(
                    watermarks=[self._node_wm_proto(n, out, inputs) for n in nodes])
        return self._looked_up(answer)

    @rpc
    def GetState(self, request: Any, context: Ctx) -> pb.GetStateResponse:
        check(request)
        spec = self._looked_up(lambda: self._computation(request.computation))
        if not request.key:
            raise InvalidSpecError(f"GetState of {spec.name!r}: key must not be empty")
        state, timers = read_keyed(self.store, spec.name, lambda node: (
            self.store.read_state(node, [request.key]).get(request.key),
            self.store.read_key_timers(node, request.key)))
        return pb.GetStateResponse(
            exists=state is not None or bool(timers), state=state or b"",
            timers=[convert.timer_to_proto(t) for t in timers],
            range_id=key_range(request.key, spec.options.key_ranges))

    @rpc
    def ListKeys(self, request: Any, context: Ctx) -> pb.ListKeysResponse:
        check(request)
        spec = self._looked_up(lambda: self._computation(request.computation))
        size = request.page_size or 100
        if not 1 <= size <= 10_000:
            raise InvalidSpecError(f"ListKeys: page_size must be 1..10000, got {size}")
        keys = read_keyed(self.store, spec.name,
                          lambda node: self.store.list_keys(node, request.page_token or None, size + 1))
        more = len(keys) > size
        keys = keys[:size]
        return pb.ListKeysResponse(keys=keys, next_page_token=keys[-1] if more else "")

    def _computation(self, name: str) -> ComputationSpec:
        with self.lock:
            return self.registry.computation(name)

    def _logged(self, stream: str) -> None:
        """NotFoundError unless ``stream`` is open to Subscribe (logged by the topology)."""
        with self.lock:
            topology = self.registry.topology
        if stream not in topology.logged_streams():
            raise NotFoundError(convert.unlogged_stream_message(topology, stream))

    @rpc
    def ClusterStatus(self, request: Any, context: Ctx) -> pb.ClusterStatusResponse:
        check(request)
        if not self.leading() and self.elector.leader_address not in (None, self.address):
            try:
                return self.forward("ClusterStatus", request, context)
            except UnavailableError as exc:  # the leader cannot be reached: the store's view
                log.info("ClusterStatus from the store's view: %s", exc)
        with self.lock:
            out, inputs = self.watermarks()
            owned = Counter(o.worker_id for o in self.assigner.units.values())  # one pass, not one per worker
            workers = [
                pb.WorkerInfo(worker_id=w.worker_id, address=w.address,
                              metrics_address=w.metrics_address, alive=w.alive,
                              draining=w.draining, last_heartbeat_age_s=w.heartbeat_age_s(),
                              ranges=owned[w.worker_id])
                for w in sorted(self.assigner.workers.values(), key=lambda w: w.worker_id)
            ]
            return pb.ClusterStatusResponse(
                workers=workers, ranges=self._ranges(),
                watermarks=[self._node_wm_proto(n, out, inputs) for n in sorted(out)],
                store_url=redact(self.store.url),  # never the password
                leader=self.elector.leader_address or "", leader_epoch=self.elector.leader_epoch,
                answered_by=self.address, versions=version_protos(self.registry))

    @rpc_stream
    def Subscribe(self, request: Any, context: Ctx) -> Iterator[pb.SubscribeResponse]:
        check(request)
        self._looked_up(lambda: self._logged(request.stream))
        pos = request.after_seq
        while context.is_active() and not self._stop.is_set():
            # Never a silent gap: a position retention removed is OUT_OF_RANGE naming the
            # oldest available one, unless from_oldest (millwheel/runtime/retention.py).
            pos, entries = read_retained(self.store, request.stream, pos, 500, request.from_oldest)
            for seq, rec in entries:
                yield pb.SubscribeResponse(seq=seq, record=convert.record_to_proto(rec))
                pos = seq
            if not entries:
                if not request.follow:
                    return
                time.sleep(0.05)


def version_protos(registry: Registry) -> list[pb.ComputationVersion]:
    """Every computation's version (services/controller/update.py), for ClusterStatus."""
    return [pb.ComputationVersion(name=c.name, version=registry.version_of(c.name),
                                  has_previous=c.name in registry.previous)
            for c in registry.topology.computations]
