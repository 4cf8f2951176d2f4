"""The Cluster service's ``Heartbeat``, as the leader answers it (:class:`Heartbeats`).

Decided under the controller's lock, written outside it: who is alive, which reports
come from a range's owner, then each report's store write on a store-work thread of
its own range (a Redis shard that is away holds back only the ranges whose keys live
on it), waited for a moment; then the answer, built as
:mod:`services.controller.heartbeat` says (the owners table as a delta, the registry as
the changes since the worker's version, or whole, each encoded once)."""

from __future__ import annotations

from concurrent.futures import wait
from typing import Any

from millwheel.errors import FencedError, InvalidSpecError

from ..generated import millwheel_pb2 as pb
from ..rpc.server import check
from . import views
from .ha import Leadership
from .heartbeat import input_watermarks
from .plane import ControlPlane

Ctx = Any

#: How long a heartbeat waits (outside the lock) for its reports' store writes before it
#: answers: in the common case they are done and the answer has the fresh watermarks
#: and fences; a range whose shard is away is answered for at the next heartbeat. A
#: range whose previous write is still under way is not waited for at all.
REPORT_WAIT_S = 0.5


class Heartbeats:
    """``Heartbeat``, on the plane it is constructed with (a standby redirects workers
    to the leader through ``leadership``)."""

    def __init__(self, plane: ControlPlane, leadership: Leadership) -> None:
        self.plane = plane
        self.leadership = leadership

    def heartbeat(self, request: Any, context: Ctx) -> pb.HeartbeatResponse:
        check(request)
        p = self.plane
        if not request.worker_id or not request.address:
            raise InvalidSpecError("Heartbeat: worker_id and address are required")
        if not p.leading():
            if p.elector.epoch is not None and p.elector.epoch == p.led_epoch:
                # Still the leader, its lease being renewed late (a store failover): the
                # worker is alive all the same, and is not declared dead once renewed.
                p.assigner.touch(request.worker_id)
            raise self.leadership.redirect(context)  # workers heartbeat to the leader alone
        if request.liveness_only:  # a busy worker's watchdog: last-seen only (services/worker/watchdog.py)
            p.assigner.touch(request.worker_id)
            return pb.HeartbeatResponse()
        # Heard: alive as of now, whatever the wait for the lock below (a registration or
        # a rebalance may hold it; the reaper must not declare this worker dead meanwhile).
        p.assigner.touch(request.worker_id)
        fenced, writes = [], []
        with p.lock:  # the decisions: who is alive, which reports are the owner's
            a = p.assigner
            if a.heartbeat(request.worker_id, request.address, request.metrics_address,
                           request.draining, frozenset(request.refused)):
                a.rebalance()
            a.workers[request.worker_id].ingest_address = request.ingest_address
            p.failing.heard(request.worker_id, request.failing, a.workers)
            p.sinks_down[request.worker_id] = dict(request.sinks_down)  # docs/connectors.md
            p.sink_positions[request.worker_id] = dict(request.sink_positions)  # what a drain waits for
            for rep in request.reports:
                unit = (rep.node, rep.range_id)
                if not a.owns(request.worker_id, unit, rep.token):
                    fenced.append(rep)
                    continue
                p.pending[unit] = rep.pending
                p.wms.note_reason(rep.node, rep.range_id, rep.held)  # held_by's rule 5
                writes.append((rep, p.work.busy(("wm", *unit))))
        # The writes, outside the lock, each range on its own (a slow shard holds back its
        # own ranges); waited for a moment unless the range's previous write is still under way.
        futures = [(rep, busy, p.wms.report(rep.node, rep.range_id, rep.token, rep.watermark,
                                               self._reissuer(request.worker_id, rep)))
                   for rep, busy in writes]
        wait([f for _rep, busy, f in futures if not busy], timeout=REPORT_WAIT_S)
        fenced += [rep for rep, _busy, f in futures if f.done() and isinstance(f.exception(), FencedError)]
        snap: Any = None
        full_items = None
        tables = p.owner_tables
        with p.lock:
            a = p.assigner
            # The registry version and the one the worker holds, if still kept: O(1), no encoding here.
            topo = p.topology_json.snapshot(p.registry, request.known_topology_version)
            if request.incremental:  # the owners table as a delta (services/controller/heartbeat.py)
                snap = tables.snapshot(a, request.known_assignments_epoch, request.known_assignments_version)
                if snap[2] and tables.cached_full(snap[0], snap[1]) is None:
                    full_items = tables.full_items(a)
                inputs = input_watermarks(p.registry, tables.assigned_nodes(a, request.worker_id), p.wms.node)
                resp = pb.HeartbeatResponse(input_watermarks=inputs, fenced=fenced, assignments_epoch=snap[0],
                                            assignments_version=snap[1], assignments_full=snap[2])
            else:  # an older worker: every range, every time
                out, inputs = p.watermarks()
                resp = pb.HeartbeatResponse(assignments=views.ranges(p), input_watermarks=inputs, fenced=fenced)
        if snap is not None:
            resp.owners.extend(tables.build(snap, full_items))
        # The registry when the worker's version differs: the changes since its version, or the
        # whole (each encoded once per version, only when needed: services/controller/heartbeat.py).
        topology = p.topology_json.answer(topo, request.topology_deltas)
        resp.topology_version = topology.version
        if topology.whole or topology.delta:
            resp.topology_json, resp.topology_delta_json = topology.whole, topology.delta
            resp.topology_base_version = topology.base
            # Each computation's version at that registry version: a worker loads a new
            # version's user modules again (services/worker/code.py).
            resp.computation_versions.update(topology.versions)
        return resp

    def _reissuer(self, worker_id: str, rep: Any) -> Any:
        """What to do (under the lock) if the store fenced this report although the
        controller thought it current: the store moved on without us (a move cut short
        by a controller crash): a fresh token to the same worker, unless the range moved
        meanwhile anyway."""
        p = self.plane
        a, unit = p.assigner, (rep.node, rep.range_id)

        def reissue() -> None:
            if p.assigner is a and a.owns(worker_id, unit, rep.token):
                a.reissue(unit)
        return reissue
