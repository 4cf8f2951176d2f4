"""The controller's read-only RPCs: watermarks, state, keys, cluster status, Subscribe.

Every controller answers these itself, leader or standby (a standby from the registry
and assignment it re-reads from the store, the registry checked against the store's
before each DescribeComputation and ListComputations; services/controller/ha.py), except
ClusterStatus, which a standby forwards to the leader: only the leader hears the
workers' heartbeats, so only it knows which are alive.

:class:`Queries` is the part that answers them, constructed with the plane and the
leadership part (for forwarding and a standby's fresh view).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable, Iterator, TypeVar

import grpc

from millwheel.errors import InvalidSpecError, NotFoundError
from millwheel.keys import key_range
from millwheel.limits import MAX_NAME_CHARS
from millwheel.nodes import injector_node
from millwheel.record import Record
from millwheel.runtime.retention import read_retained
from millwheel.state.url_display import redact
from millwheel.topology import ComputationSpec

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from ..rpc.server import check
from ..rpc.status import UnavailableError
from . import views
from .ha import Leadership
from .held_by import LeastWriter
from .plane import ControlPlane
from .registry import Registry
from .rescale_journal import read_keyed

log = logging.getLogger("millwheel.controller")
T = TypeVar("T")
STANDBY_READ_S = 10.0  # how long a standby's GetWatermark waits for the store's values
SUBSCRIBE_READ = 500  #: log entries read at a time for a Subscribe of one record a message
MAX_SUBSCRIBE_BATCH = 10_000  #: records in one Subscribe message at most (SubscribeRequest.max_batch)
SUBSCRIBE_BATCH_BYTES = 4 << 20  #: and about this many bytes (gRPC messages are capped at 64 MiB)
Ctx = grpc.ServicerContext


class Queries:
    """ListComputations, DescribeComputation, GetWatermark, GetState, ListKeys,
    ClusterStatus, Subscribe: answered from the plane, forwarding what only the leader
    knows through ``leadership``."""

    def __init__(self, plane: ControlPlane, leadership: Leadership,
                 least_writer: LeastWriter | None = None) -> None:
        """``least_writer``: an injector's least live writer (services/controller/writers.py),
        for what holds its watermark."""
        self.plane = plane
        self.leadership = leadership
        self.least_writer = least_writer

    def _looked_up(self, lookup: Callable[[], T]) -> T:
        """``lookup()``; if it finds no such name on a standby, once more after re-reading
        the store's view (a user who registered through the leader and reads through a
        standby must not get NOT_FOUND for what exists)."""
        try:
            return lookup()
        except NotFoundError:
            if not self.leadership.fresh_view():
                raise
            return lookup()

    # -- the registry ----------------------------------------------------------------
    def list_computations(self, request: Any, context: Ctx) -> pb.ListComputationsResponse:
        check(request)
        self.leadership.current_view()
        p = self.plane
        with p.lock:
            topo = p.registry.topology
            wms = p.watermarks()
            return pb.ListComputationsResponse(
                computations=[views.info(p, c.name, wms) for c in topo.computations],
                injectors=[convert.injector_to_proto(i) for i in topo.injectors])

    def describe_computation(self, request: Any, context: Ctx) -> pb.ComputationInfo:
        """On a standby, the registry the store holds now (its version compared first,
        the view re-read if it moved: a spec just updated through any controller is
        never answered as it was; issue 34), and a name its view lacks looked up again
        in the store's view (as the other reads: one just registered through this
        standby, which the leader stored, must not be NOT_FOUND)."""
        check(request)
        self.leadership.current_view()

        def answer() -> pb.ComputationInfo:
            with self.plane.lock:
                return views.info(self.plane, request.name)
        return self._looked_up(answer)

    # -- queries ---------------------------------------------------------------------
    def get_watermark(self, request: Any, context: Ctx) -> pb.GetWatermarkResponse:
        check(request)
        p = self.plane

        def answer() -> pb.GetWatermarkResponse:
            if not p.leading():  # a standby's copy may lag what the leader served: the store's now
                p.wms.refresh_now(p.registry.nodes(), STANDBY_READ_S)
            with p.lock:
                out, inputs = p.watermarks()
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
                    watermarks=[views.node_watermark(p, n, out, inputs, self.least_writer) for n in nodes])
        return self._looked_up(answer)

    def get_state(self, request: Any, context: Ctx) -> pb.GetStateResponse:
        check(request)
        store = self.plane.store
        spec = self._looked_up(lambda: self._computation(request.computation))
        if not request.key:
            raise InvalidSpecError(f"GetState of {spec.name!r}: key must not be empty")
        state, timers = read_keyed(store, spec.name, lambda node: (
            store.read_state(node, [request.key]).get(request.key),
            store.read_key_timers(node, request.key)))
        return pb.GetStateResponse(
            exists=state is not None or bool(timers), state=state or b"",
            timers=[convert.timer_to_proto(t) for t in timers],
            range_id=key_range(request.key, spec.options.key_ranges))

    def list_keys(self, request: Any, context: Ctx) -> pb.ListKeysResponse:
        check(request)
        store = self.plane.store
        spec = self._looked_up(lambda: self._computation(request.computation))
        size = request.page_size or 100
        if not 1 <= size <= 10_000:
            raise InvalidSpecError(f"ListKeys: page_size must be 1..10000, got {size}")
        keys = read_keyed(store, spec.name,
                          lambda node: store.list_keys(node, request.page_token or None, size + 1))
        more = len(keys) > size
        keys = keys[:size]
        return pb.ListKeysResponse(keys=keys, next_page_token=keys[-1] if more else "")

    def _computation(self, name: str) -> ComputationSpec:
        with self.plane.lock:
            return self.plane.registry.computation(name)

    def _logged(self, stream: str) -> None:
        """NotFoundError unless ``stream`` is open to Subscribe (logged by the topology)."""
        with self.plane.lock:
            topology = self.plane.registry.topology
        if stream not in topology.logged_streams():
            raise NotFoundError(convert.unlogged_stream_message(topology, stream))

    def cluster_status(self, request: Any, context: Ctx) -> pb.ClusterStatusResponse:
        check(request)
        p = self.plane
        if not p.leading() and p.elector.leader_address not in (None, p.address):
            try:
                return self.leadership.forward("ClusterStatus", request, context)
            except UnavailableError as exc:  # the leader cannot be reached: the store's view
                log.info("ClusterStatus from the store's view: %s", exc)
        with p.lock:
            out, inputs = p.watermarks()
            assigner = p.assigner
            owned = Counter(o.worker_id for o in assigner.units.values())  # one pass, not one per worker
            workers = [
                pb.WorkerInfo(worker_id=w.worker_id, address=w.address,
                              metrics_address=w.metrics_address, alive=w.alive,
                              draining=w.draining, last_heartbeat_age_s=w.heartbeat_age_s(),
                              ranges=owned[w.worker_id])
                for w in sorted(assigner.workers.values(), key=lambda w: w.worker_id)
            ]
            return pb.ClusterStatusResponse(
                workers=workers, ranges=views.ranges(p),
                watermarks=[views.node_watermark(p, n, out, inputs) for n in sorted(out)],
                store_url=redact(p.store.url),  # never the password
                leader=p.elector.leader_address or "", leader_epoch=p.elector.leader_epoch,
                answered_by=p.address, versions=version_protos(p.registry))

    def subscribe(self, request: Any, context: Ctx) -> Iterator[pb.SubscribeResponse]:
        """The stream's log from ``after_seq``, one record a message, or with ``max_batch``
        as many as one read of the log returned (up to ``max_batch``) in each message."""
        check(request)
        self._looked_up(lambda: self._logged(request.stream))
        pos = request.after_seq
        batch = min(request.max_batch, MAX_SUBSCRIBE_BATCH)
        read = batch or SUBSCRIBE_READ
        while context.is_active() and not self.plane.stop.is_set():
            # Never a silent gap: a position retention removed is OUT_OF_RANGE naming the
            # oldest available one, unless from_oldest (millwheel/runtime/retention.py).
            pos, entries = read_retained(self.plane.store, request.stream, pos, read, request.from_oldest)
            if batch:
                for part in _by_size(entries):
                    resp = pb.SubscribeResponse(seqs=[seq for seq, _rec in part])
                    convert.add_records(resp.records, (rec for _seq, rec in part))
                    pos = part[-1][0]
                    yield resp
            else:
                for seq, rec in entries:
                    yield pb.SubscribeResponse(seq=seq, record=convert.record_to_proto(rec))
                    pos = seq
            if not entries:
                if not request.follow:
                    return
                time.sleep(0.05)


def _by_size(entries: list[tuple[int, Record]]) -> Iterator[list[tuple[int, Record]]]:
    """``entries`` in runs of at most SUBSCRIBE_BATCH_BYTES (keys, values and IDs; one
    record alone may be larger: it goes by itself), in order."""
    run: list[tuple[int, Record]] = []
    size = 0
    for entry in entries:
        rec = entry[1]
        n = len(rec.key) + len(rec.value) + len(rec.record_id) + 24
        if run and size + n > SUBSCRIBE_BATCH_BYTES:
            yield run
            run, size = [], 0
        run.append(entry)
        size += n
    if run:
        yield run


def version_protos(registry: Registry) -> list[pb.ComputationVersion]:
    """Every computation's version (services/controller/update.py), for ClusterStatus."""
    return [pb.ComputationVersion(name=c.name, version=registry.version_of(c.name),
                                  has_previous=c.name in registry.previous)
            for c in registry.topology.computations]
