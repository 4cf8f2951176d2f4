"""Incremental heartbeats: a worker's owners table built from deltas is the whole table.

A real controller (in process, a SQLite store) is heartbeated as two workers would:
one incremental (it keeps the table from the answers: the whole table once, then only
changes), one as an older worker (every range, every time). After registrations, a
worker joining, one leaving (draining) and an unregistration, the incremental table
equals the full one at every step, and an answer in a steady cluster carries no range.
"""

from __future__ import annotations

import time
from pathlib import Path

from millwheel.state.url import open_store
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.controller.plane import ControlPlane
from services.controller.service import Controller, ControllerServicer
from services.generated import millwheel_pb2 as pb
from services.rpc.convert import spec_to_proto
from services.worker.units import OwnerInfo, merged_owners


def comp(name: str, ranges: int) -> pb.ComputationSpec:
    return spec_to_proto(ComputationSpec(name, (InputSpec("events"),), (f"{name}_out",),
                                         CodeRef("window_aggregate", {"size_us": 1_000_000}),
                                         Options(key_ranges=ranges)))


class Worker:
    def __init__(self, controller: ControllerServicer, worker_id: str) -> None:
        self.c = controller
        self.id = worker_id
        self.owners: dict[tuple[str, int], OwnerInfo] = {}
        self.known = (0, 0)
        self.topology_version = 0
        self.last: pb.HeartbeatResponse | None = None

    def beat(self, draining: bool = False, incremental: bool = True) -> pb.HeartbeatResponse:
        resp = self.c.Heartbeat(pb.HeartbeatRequest(
            worker_id=self.id, address=f"127.0.0.1:1/{self.id}", draining=draining, incremental=incremental,
            known_assignments_epoch=self.known[0], known_assignments_version=self.known[1],
            known_topology_version=self.topology_version), None)
        merged = merged_owners(self.owners, resp)
        if merged is not None:
            self.owners = merged
        self.known = (resp.assignments_epoch, resp.assignments_version)
        self.topology_version = resp.topology_version
        self.last = resp
        return resp


def settle(c: ControlPlane) -> None:
    """Wait for the moves decided so far to land: range moves acquire their tokens off
    the controller's lock, on store-work threads (services/controller/assign.py)."""
    deadline = time.monotonic() + 30
    while True:
        with c.lock:
            if not c.assigner.moving and c.work.idle():
                return
        assert time.monotonic() < deadline, "moves never landed"
        time.sleep(0.01)


def full_table(legacy: Worker) -> dict[tuple[str, int], OwnerInfo]:
    resp = legacy.beat(draining=True, incremental=False)
    return {u: o for u, o in merged_owners({}, resp).items() if o.worker_id}  # type: ignore[union-attr]


def test_owners_from_deltas_equal_the_whole_table_through_changes(tmp_path: Path) -> None:
    controller = Controller(open_store(f"sqlite:///{tmp_path}/s.db"), heartbeat_timeout_s=600)
    c, plane = controller.servicer, controller.plane
    controller.start("127.0.0.1:1")
    try:
        while not plane.leading():
            pass
        a, b, legacy = Worker(c, "a"), Worker(c, "b"), Worker(c, "old")
        legacy.beat(draining=True, incremental=False)  # draining: never given a range
        first = a.beat()
        assert first.assignments_full and not first.owners  # nothing registered yet
        c.RegisterTopology(pb.RegisterTopologyRequest(
            computations=[comp("x", 300), comp("y", 7)], injectors=[pb.InjectorSpec(name="ev", stream="events")]),
            None)
        settle(plane)
        resp = a.beat()
        assert not resp.assignments_full and len(resp.owners) == 308  # every new range, as a delta
        assert {u for u, o in a.owners.items() if o.worker_id == "a"} == set(a.owners)
        assert resp.topology_json and resp.topology_version == 1
        steady = a.beat()
        assert not steady.owners and not steady.topology_json and not steady.assignments_full
        b.beat()  # joins: half the ranges move to it
        settle(plane)
        a.beat()
        b.beat()
        assert a.owners == b.owners == full_table(legacy)
        assert 150 <= sum(o.worker_id == "b" for o in b.owners.values()) <= 160
        # Input watermarks of the computations it runs, no others.
        assert set(a.last.input_watermarks) == {u[0] for u, o in a.owners.items()  # type: ignore[union-attr]
                                                if o.worker_id == "a" and not u[0].startswith("injector:")}
        c.UnregisterComputation(pb.UnregisterComputationRequest(name="y"), None)
        settle(plane)
        b.beat(draining=True)  # leaving: everything back to a
        settle(plane)
        a.beat()
        assert a.owners == full_table(legacy) and not any(u[0] == "y" for u in a.owners)
        assert all(o.worker_id == "a" for o in a.owners.values()) and len(a.owners) == 301
        # A worker holding a table of another epoch (another leader) or none gets it whole.
        a.known = (a.known[0] + 1, a.known[1])
        again = a.beat()
        assert again.assignments_full and len(again.owners) == 301
    finally:
        controller.close()
