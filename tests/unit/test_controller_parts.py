"""The controller's parts, each constructed alone over a real SQLite store: no gRPC
server, no worker process, no controller process.

A :class:`ControlPlane` over a fresh SQLite file leads at once (the lease is free); the
part under test is constructed with it and the few parts it needs, as
services/controller/service.py does. What is checked is what a user of the service
relies on: a heartbeat's report from a worker that no longer owns a range is fenced and
not stored; a standby sends workers to the leader; heartbeats are answered, and the
plane's lock is free, while a store write of another heartbeat is blocked; Inject
refuses records once the service is stopped, draining or the injector closed, and
writes nothing; a rescale refuses what it cannot do, changes nothing then, and does what
it can.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator, cast

import grpc
import pytest

from millwheel.connectors.spec import SinkSpec, sinks_from_list
from millwheel.errors import InvalidSpecError, MillWheelError, ResourceLimitError
from millwheel.importing import AllowList
from millwheel.nodes import injector_node, sink_node
from millwheel.record import MAX_TIMESTAMP
from millwheel.savepoint import capture
from millwheel.savepoint.format import SavepointFileError
from millwheel.state.protocol import StateStore
from millwheel.state.url import open_store
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.controller import rescale as rescale_module
from services.controller.assign import STOPPED_KEY
from services.controller.ha import Leadership
from services.controller.heartbeat_rpc import Heartbeats
from services.controller.inject import Injection, InjectSettings, WorkerLinks
from services.controller.leader import Elector, LeaderStore
from services.controller.plane import ControlPlane, Timeouts
from services.controller.registration import Registration
from services.controller.registry import Registry
from services.controller.rescale import Rescaling
from services.controller.savepoint import Savepoints, _StopGate
from services.controller.update import Updates
from services.generated import millwheel_pb2 as pb
from services.inject_limits import InjectLimits
from services.rpc.controller_link import LEADER_METADATA
from services.rpc.convert import sink_to_proto, spec_to_proto
from services.rpc.status import NotLeaderError, PreconditionError
from tests.support.blocking_store import BlockingStore

pytestmark = pytest.mark.timeout(120)


class Context:
    """The part of a ``grpc.ServicerContext`` the parts use."""

    def __init__(self) -> None:
        self.trailing: tuple[tuple[str, str], ...] = ()

    def set_trailing_metadata(self, md: tuple[tuple[str, str], ...]) -> None:
        self.trailing = md

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def is_active(self) -> bool:
        return True

    def time_remaining(self) -> float | None:
        return None


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Parts:
    """A leading plane and the parts the tests use, constructed as service.py does."""

    def __init__(self, url: str, address: str = "127.0.0.1:1") -> None:
        self.raw = store = open_store(url)
        elector = Elector(store, "", 2.0)
        self.plane = ControlPlane(store=cast(StateStore, LeaderStore(store, elector)), elector=elector,
                                  clock=_Clock(), allow_code=AllowList(), timeouts=Timeouts(heartbeat_s=600))
        self.rescaling = Rescaling(self.plane)
        self.leadership = Leadership(self.plane, self.rescaling.finish_interrupted)
        self.registration = Registration(self.plane)
        self.heartbeats = Heartbeats(self.plane, self.leadership)
        self.injection = Injection(self.plane, self.leadership, WorkerLinks(self.plane),
                                   InjectSettings(limits=InjectLimits(), timeout_s=1.0))
        elector.start(address)  # the lease is free: it leads, and the takeover runs inline

    def close(self) -> None:
        self.plane.elector.stop(release=True)
        self.plane.work.close()
        self.raw.close()

    def register(self, name: str = "counts", ranges: int = 2, sinks: tuple[SinkSpec, ...] = ()) -> None:
        spec = ComputationSpec(name, (InputSpec("events"),), (f"{name}_out",),
                               CodeRef("window_aggregate", {"size_us": 1_000_000}), Options(key_ranges=ranges))
        self.registration.register_topology(pb.RegisterTopologyRequest(
            computations=[spec_to_proto(spec)], injectors=[pb.InjectorSpec(name="ev", stream="events")],
            sinks=[sink_to_proto(s) for s in sinks]), Context())

    def beat(self, worker: str, reports: dict[tuple[str, int], int] | None = None, wm: int = 0) -> Any:
        return self.heartbeats.heartbeat(pb.HeartbeatRequest(
            worker_id=worker, address=f"127.0.0.1:{1000 + len(worker)}/{worker}",
            reports=[pb.WatermarkReport(node=n, range_id=r, token=t, watermark=wm)
                     for (n, r), t in (reports or {}).items()]), Context())

    def settle(self) -> None:
        """Until the moves decided so far have landed (tokens are acquired off the lock)."""
        deadline = time.monotonic() + 30
        while True:
            with self.plane.lock:
                if not self.plane.assigner.moving and self.plane.work.idle():
                    return
            assert time.monotonic() < deadline, "moves never landed"
            time.sleep(0.01)

    def owned(self, worker: str) -> dict[tuple[str, int], int]:
        with self.plane.lock:
            return {u: o.token for u, o in self.plane.assigner.units.items() if o.worker_id == worker}


class _Clock:
    def now_us(self) -> int:
        return int(time.time() * 1e6)


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    p = Parts(f"sqlite:///{tmp_path}/s.db")
    assert p.plane.leading()
    try:
        yield p
    finally:
        p.close()


# -- heartbeats ---------------------------------------------------------------------------
def test_a_report_under_a_superseded_token_is_fenced_and_not_stored(parts: Parts) -> None:
    parts.register(ranges=2)
    parts.beat("w1")
    parts.settle()
    mine = parts.owned("w1")
    assert set(mine) == {("counts", 0), ("counts", 1), (injector_node("ev"), 0)}
    unit = ("counts", 0)
    resp = parts.beat("w1", {unit: mine[unit]}, wm=5_000)
    assert not resp.fenced
    assert parts.raw.read_watermarks("counts")[0] == 5_000

    stale = {unit: mine[unit] - 1 if mine[unit] > 1 else mine[unit] + 1}  # a token it does not hold
    resp = parts.beat("w1", stale, wm=9_000)
    assert [(f.node, f.range_id) for f in resp.fenced] == [unit]
    assert parts.raw.read_watermarks("counts")[0] == 5_000  # the stale report changed nothing
    parts.beat("w2")  # a second worker joins: some ranges move to it
    parts.settle()
    theirs = parts.owned("w2")
    assert theirs and set(theirs) | set(parts.owned("w1")) == set(mine)
    moved = sorted(theirs)[0]
    resp = parts.beat("w1", {moved: mine[moved]}, wm=7_000)  # w1 reports a range it lost
    assert [(f.node, f.range_id) for f in resp.fenced] == [moved]
    assert parts.raw.read_watermarks(moved[0]).get(moved[1], 0) < 7_000


def test_a_standby_sends_workers_to_the_leader(parts: Parts, tmp_path: Path) -> None:
    standby = Parts(f"sqlite:///{tmp_path}/s.db", address="127.0.0.1:2")
    try:
        assert not standby.plane.leading()
        ctx = Context()
        with pytest.raises(NotLeaderError, match="standby; the leader is 127.0.0.1:1"):
            standby.heartbeats.heartbeat(pb.HeartbeatRequest(worker_id="w1", address="127.0.0.1:9"), ctx)
        assert ctx.trailing == ((LEADER_METADATA, "127.0.0.1:1"),)
        assert "w1" not in standby.plane.assigner.workers  # nothing recorded there
    finally:
        standby.close()


def test_the_lock_is_free_and_heartbeats_answered_while_a_report_write_is_blocked(parts: Parts) -> None:
    parts.register(ranges=4)
    parts.beat("w1")
    parts.settle()
    parts.beat("w2")  # joins: half the ranges move to it
    parts.settle()
    mine, theirs = parts.owned("w1"), parts.owned("w2")
    assert mine and theirs
    blocked = sorted(mine)[0]
    leader_store = cast(Any, parts.plane.store)
    blocking = BlockingStore(leader_store._store, blocked)
    leader_store._store = blocking  # under the leader's fence, as a Redis shard that is away
    stuck = threading.Thread(target=lambda: parts.beat("w1", mine, wm=5_000), daemon=True)
    try:
        stuck.start()
        assert blocking.entered.wait(30), "the blocked range's report never reached the store"
        assert parts.plane.lock.acquire(timeout=5), "the controller's lock is held across a store write"
        parts.plane.lock.release()
        for _ in range(3):  # the other worker is answered, its reports stored; nothing moves
            resp = parts.beat("w2", theirs, wm=7_000)
            assert not resp.fenced
            assert parts.owned("w2") == theirs
        assert all(parts.raw.read_watermarks(n)[r] == 7_000 for n, r in theirs)
        assert stuck.is_alive() and not blocking.release.is_set()
        assert parts.plane.wms.of(blocked[0]).get(blocked[1]) != 5_000  # not served before it is stored
    finally:
        blocking.release.set()
        stuck.join(30)
    assert parts.raw.read_watermarks(blocked[0])[blocked[1]] == 5_000


# -- injection ----------------------------------------------------------------------------
def inject(parts: Parts, *messages: pb.InjectRequest) -> Aborted | pb.InjectResponse:
    try:
        return parts.injection.inject(iter(messages), cast(Any, Context()))
    except Aborted as exc:
        return exc


def records(n: int) -> list[pb.Record]:
    return [pb.Record(key=f"k{i}", value=b"v", timestamp=1_000 + i) for i in range(n)]


@pytest.mark.parametrize("state, says", [("stopped", "stopped with a savepoint"), ("draining", "draining")])
def test_inject_is_refused_once_the_service_is_stopped_or_draining(parts: Parts, state: str, says: str) -> None:
    parts.register()
    setattr(parts.plane.assigner, state, True)
    answer = inject(parts, pb.InjectRequest(injector="ev", records=records(3)))
    assert isinstance(answer, Aborted)
    assert answer.code == grpc.StatusCode.FAILED_PRECONDITION and says in answer.details
    assert "inject message 0" in answer.details
    assert parts.raw.read_watermarks(injector_node("ev")) == {}  # nothing reached the injector's range
    with pytest.raises(PreconditionError, match="takes no more records"):
        parts.injection.replay_dead_letters(pb.ReplayDeadLettersRequest(computation="counts"), Context())


def test_records_for_a_closed_injector_are_refused(parts: Parts) -> None:
    parts.register()
    node = injector_node("ev")
    token = parts.raw.acquire(node, 0, epoch=parts.plane.elector.epoch)
    parts.raw.report_watermark(node, 0, token, MAX_TIMESTAMP)  # an earlier Inject said done
    answer = inject(parts, pb.InjectRequest(injector="ev", records=records(2)))
    assert isinstance(answer, Aborted) and answer.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "injector 'ev' is closed" in answer.details


def test_inject_names_what_is_wrong_and_registers_nothing(parts: Parts) -> None:
    parts.register()
    version = parts.plane.registry.version
    answer = inject(parts, pb.InjectRequest(injector="other", records=records(1)))
    assert isinstance(answer, Aborted) and answer.code == grpc.StatusCode.NOT_FOUND
    assert "no injector named 'other'" in answer.details
    answer = inject(parts, pb.InjectRequest(injector="ev", stream="elsewhere", records=records(1)))
    assert isinstance(answer, Aborted) and answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "writes stream 'events', not 'elsewhere'" in answer.details
    assert parts.plane.registry.version == version


def test_an_injectors_owner_is_used_only_while_alive(parts: Parts) -> None:
    parts.register()
    node = injector_node("ev")
    assert parts.injection.owner_address(node) is None  # no worker yet
    parts.beat("w1")
    parts.settle()
    assert parts.injection.owner_address(node) == "127.0.0.1:1002/w1"
    with parts.plane.lock:
        parts.plane.assigner.workers["w1"].alive = False
    assert parts.injection.owner_address(node) is None


# -- rescaling ----------------------------------------------------------------------------
def rescale(parts: Parts, name: str, n: int) -> pb.RescaleComputationResponse:
    return parts.rescaling.rescale(pb.RescaleComputationRequest(computation=name, key_ranges=n), Context())


def test_a_rescale_refuses_what_it_cannot_do_and_changes_nothing(parts: Parts,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    parts.register(ranges=2)
    monkeypatch.setattr(rescale_module, "MAX_TOTAL_KEY_RANGES", 5)  # the registry's room: 2 + 1 injector
    version = parts.plane.registry.version
    tokens = {r: parts.raw.current_token("counts", r) for r in range(2)}
    refusals: list[tuple[str, int, type[MillWheelError], str]] = [
        ("counts", 0, InvalidSpecError, "outside 1.."),
        ("ev", 2, PreconditionError, "an injector has one key range"),
        (injector_node("ev"), 2, PreconditionError, "an injector has one key range"),
        ("counts", 5, ResourceLimitError, "over the limit of 5"),
    ]
    for name, n, error, says in refusals:
        with pytest.raises(error, match=says):
            rescale(parts, name, n)
    with parts.plane.lock:
        parts.plane.assigner.rescaling["counts"] = "copying"
    with pytest.raises(PreconditionError, match="a rescale of 'counts' is under way"):
        rescale(parts, "counts", 3)
    with parts.plane.lock:
        del parts.plane.assigner.rescaling["counts"]
    assert parts.plane.registry.version == version
    assert parts.plane.registry.computation("counts").options.key_ranges == 2
    assert {r: parts.raw.current_token("counts", r) for r in range(2)} == tokens  # nothing fenced
    assert not parts.plane.assigner.frozen
    same = rescale(parts, "counts", 2)  # nothing to do
    assert not same.changed and parts.plane.registry.version == version


def test_a_rescale_fences_the_old_ranges_and_places_the_new_layout(parts: Parts) -> None:
    parts.register(ranges=2)
    parts.beat("w1")
    parts.settle()
    before = parts.owned("w1")
    version = parts.plane.registry.version
    resp = rescale(parts, "counts", 3)
    assert resp.changed and resp.previous_key_ranges == 2
    assert parts.plane.registry.computation("counts").options.key_ranges == 3
    assert parts.plane.registry.version == version + 1
    assert not parts.plane.assigner.rescaling and not parts.plane.assigner.frozen
    parts.beat("w1")
    parts.settle()
    after = parts.owned("w1")
    assert {u for u in after if u[0] == "counts"} == {("counts", 0), ("counts", 1), ("counts", 2)}
    for r in range(2):  # the old owner's tokens were superseded: whatever it ran there is fenced
        assert after[("counts", r)] > before[("counts", r)]


# -- updates and rescales keep what they do not change -----------------------------------
def test_an_update_and_a_rescale_keep_the_connector_sinks(parts: Parts) -> None:
    """Issue 34, item 1: both rebuilt the topology without its sinks, silently: the sink's
    range vanished and the external system stopped receiving the stream."""
    sinks = sinks_from_list([{"stream": "counts_out", "type": "postgres", "url": "postgresql://127.0.0.1/db",
                              "table": "counts"}])
    parts.register(ranges=2, sinks=sinks)
    sink = sink_node(sinks[0].name)
    assert parts.plane.registry.topology.sinks == sinks and sink in parts.plane.registry.nodes()
    old = parts.plane.registry.computation("counts")
    new = ComputationSpec(old.name, old.inputs, old.outputs, CodeRef("window_aggregate", {"size_us": 2_000_000}),
                          old.options)
    resp = Updates(parts.plane).update(pb.UpdateComputationRequest(spec=spec_to_proto(new),
                                                                   on_open_windows="drop"), Context())
    assert resp.changed
    assert parts.plane.registry.topology.sinks == sinks and sink in parts.plane.registry.nodes()
    assert rescale(parts, "counts", 3).changed
    assert parts.plane.registry.topology.sinks == sinks and sink in parts.plane.registry.nodes()
    with parts.plane.lock:
        assert (sink, 0) in parts.plane.assigner.units  # still placed: its owner runs it
    stored = Registry(parts.raw)  # what a new leader loads
    assert stored.topology.sinks == sinks and stored.computation("counts").options.key_ranges == 3


# -- savepoints ---------------------------------------------------------------------------
def test_a_stop_with_savepoint_whose_cut_fails_stops_nothing(parts: Parts, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34, item 4: the stop was stored before the cut was read, so a cut that failed
    (a key's state too large for a frame) left the service refusing every Inject for
    good, with no file to restore. It is stored only once the file is whole."""
    parts.register(ranges=2)
    parts.beat("w1")
    parts.settle()
    before = parts.owned("w1")
    savepoints = Savepoints(parts.plane, parts.leadership, hand_over=parts.injection.hand_over)

    def too_large(*_args: Any, **_kwargs: Any) -> None:
        raise SavepointFileError("savepoint: an item of 'counts' is over the frame limit")

    monkeypatch.setattr(capture, "capture_nodes", too_large)
    with tempfile.TemporaryFile() as spool, pytest.raises(SavepointFileError):
        savepoints._cut(True, spool, lambda _phase, _n: None, _StopGate(parts.plane))
    assert not parts.plane.assigner.stopped and parts.raw.get_meta(STOPPED_KEY) is None
    parts.settle()
    assert set(parts.owned("w1")) == set(before)  # placed again: the service runs on
    monkeypatch.undo()
    gate = _StopGate(parts.plane)
    with tempfile.TemporaryFile() as spool:  # a cut that works stops the service, for a new leader too
        summary = savepoints._cut(True, spool, lambda _phase, _n: None, gate)
    assert summary.stopped and parts.plane.assigner.stopped and parts.raw.get_meta(STOPPED_KEY) is None
    gate.store()  # (CreateSavepoint does, once the whole file went out on the call)
    assert summary.stopped and parts.plane.assigner.stopped and parts.raw.get_meta(STOPPED_KEY) is not None
    parts.beat("w1")
    parts.settle()
    assert parts.owned("w1") == {}
    answer = inject(parts, pb.InjectRequest(injector="ev", records=records(1)))
    assert isinstance(answer, Aborted) and "stopped with a savepoint" in answer.details
