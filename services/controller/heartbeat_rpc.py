"""The Cluster service's ``Heartbeat``, as the leader answers it (a mixin of
:class:`~services.controller.service.ControllerService`).

Decided under the controller's lock, written outside it: who is alive, which reports
come from a range's owner, then each report's store write on a store-work thread of
its own range (a Redis shard that is away holds back only the ranges whose keys live
on it), waited for a moment; then the answer, built as
:mod:`services.controller.heartbeat` says (the owners table as a delta, the registry's
JSON once per version)."""

from __future__ import annotations

import threading
from concurrent.futures import wait
from typing import Any, Callable

from millwheel.errors import FencedError, InvalidSpecError

from ..generated import millwheel_pb2 as pb
from ..rpc.server import check
from ..rpc.status import rpc
from .assign import Assigner
from .failing import FailingRanges
from .heartbeat import OwnerTables, TopologyJson, input_watermarks
from .leader import Elector
from .registry import Registry
from .store_work import StoreWork
from .watermarks import Watermarks

Ctx = Any

#: How long a heartbeat waits (outside the lock) for its reports' store writes before it
#: answers: in the common case they are done and the answer has the fresh watermarks
#: and fences; a range whose shard is away is answered for at the next heartbeat. A
#: range whose previous write is still under way is not waited for at all.
REPORT_WAIT_S = 0.5


class Heartbeats:
    """``Heartbeat`` (a mixin of ControllerService, whose ``__init__`` sets these)."""

    lock: threading.RLock
    assigner: Assigner
    registry: Registry
    elector: Elector
    failing: FailingRanges
    work: StoreWork
    wms: Watermarks
    owner_tables: OwnerTables
    topology_json: TopologyJson
    _pending: dict[tuple[str, int], int]
    _sinks_down: dict[str, dict[str, float]]
    _sink_positions: dict[str, dict[str, int]]
    _led_epoch: int | None
    leading: Callable[[], bool]
    redirect: Callable[[Any], Exception]
    watermarks: Callable[[], tuple[dict[str, int], dict[str, int]]]
    _ranges: Callable[..., list[pb.RangeInfo]]

    @rpc
    def Heartbeat(self, request: Any, context: Ctx) -> pb.HeartbeatResponse:
        check(request)
        if not request.worker_id or not request.address:
            raise InvalidSpecError("Heartbeat: worker_id and address are required")
        if not self.leading():
            if self.elector.epoch is not None and self.elector.epoch == self._led_epoch:
                # Still the leader, its lease being renewed late (a store failover): the
                # worker is alive all the same, and is not declared dead once renewed.
                self.assigner.touch(request.worker_id)
            raise self.redirect(context)  # workers heartbeat to the leader alone
        if request.liveness_only:  # a busy worker's watchdog: last-seen only (services/worker/watchdog.py)
            self.assigner.touch(request.worker_id)
            return pb.HeartbeatResponse()
        # Heard: alive as of now, whatever the wait for the lock below (a registration or
        # a rebalance may hold it; the reaper must not declare this worker dead meanwhile).
        self.assigner.touch(request.worker_id)
        fenced, writes = [], []
        with self.lock:  # the decisions: who is alive, which reports are the owner's
            a = self.assigner
            if a.heartbeat(request.worker_id, request.address, request.metrics_address,
                           request.draining, frozenset(request.refused)):
                a.rebalance()
            self.failing.heard(request.worker_id, request.failing, a.workers)
            self._sinks_down[request.worker_id] = dict(request.sinks_down)  # docs/connectors.md
            self._sink_positions[request.worker_id] = dict(request.sink_positions)  # what a drain waits for
            for rep in request.reports:
                unit = (rep.node, rep.range_id)
                if not a.owns(request.worker_id, unit, rep.token):
                    fenced.append(rep)
                    continue
                self._pending[unit] = rep.pending
                writes.append((rep, self.work.busy(("wm", *unit))))
        # The writes, outside the lock, each range on its own (a slow shard holds back its
        # own ranges); waited for a moment unless the range's previous write is still under way.
        futures = [(rep, busy, self.wms.report(rep.node, rep.range_id, rep.token, rep.watermark,
                                               self._reissuer(request.worker_id, rep)))
                   for rep, busy in writes]
        wait([f for _rep, busy, f in futures if not busy], timeout=REPORT_WAIT_S)
        fenced += [rep for rep, _busy, f in futures if f.done() and isinstance(f.exception(), FencedError)]
        snap: Any = None
        full_items = None
        with self.lock:
            a = self.assigner
            if request.incremental:  # the owners table as a delta (services/controller/heartbeat.py)
                snap = self.owner_tables.snapshot(
                    a, request.known_assignments_epoch, request.known_assignments_version)
                if snap[2] and self.owner_tables.cached_full(snap[0], snap[1]) is None:
                    full_items = self.owner_tables.full_items(a)
                inputs = input_watermarks(self.registry, self.owner_tables.assigned_nodes(a, request.worker_id),
                                          self.wms.node)
                resp = pb.HeartbeatResponse(input_watermarks=inputs, fenced=fenced, assignments_epoch=snap[0],
                                            assignments_version=snap[1], assignments_full=snap[2])
            else:  # an older worker: every range, every time
                out, inputs = self.watermarks()
                resp = pb.HeartbeatResponse(assignments=self._ranges(), input_watermarks=inputs, fenced=fenced)
        if snap is not None:
            resp.owners.extend(self.owner_tables.build(snap, full_items))
        version, text = self.topology_json.get(self.registry)  # serialized once per version
        resp.topology_version = version
        if request.known_topology_version != version:
            resp.topology_json = text
        return resp

    def _reissuer(self, worker_id: str, rep: Any) -> Any:
        """What to do (under the lock) if the store fenced this report although the
        controller thought it current: the store moved on without us (a move cut short
        by a controller crash): a fresh token to the same worker, unless the range moved
        meanwhile anyway."""
        a, unit = self.assigner, (rep.node, rep.range_id)

        def reissue() -> None:
            if self.assigner is a and a.owns(worker_id, unit, rep.token):
                a.reissue(unit)
        return reissue
