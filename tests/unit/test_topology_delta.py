"""The registry as changes (services/rpc/topology_delta.py; issue 34 item 9): a worker
holding a version gets what changed since, not the whole registry, and the topology it
makes of it is the one the whole registry's JSON reads as.

The contract on its own (encode/apply: computations added, changed, removed, reordered;
injectors, sinks and log streams changed; random sequences of changes), the controller's
cache of versions (which answers are deltas, which whole, what is encoded and how
often), and a controller in process heartbeated by workers that apply what they get."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from millwheel.connectors.spec import sinks_from_list
from millwheel.spec import computation_from_dict, computation_to_dict, spec_parts
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.state.url import open_store
from millwheel.topology import ComputationSpec, InjectorSpec, Topology
from services.controller.heartbeat import TopologyJson
from services.controller.registry import Registry
from services.controller.service import Controller
from services.generated import millwheel_pb2 as pb
from services.rpc import convert
from services.rpc.convert import spec_to_proto
from services.rpc.topology_delta import DeltaMismatch, apply, changes, encode, received


def comp(name: str, inputs: tuple[str, ...] = ("events",), param: int = 0, ranges: int = 2) -> ComputationSpec:
    return computation_from_dict({"name": name, "inputs": list(inputs), "outputs": [f"{name}_out"],
                                  "code": {"name": "filter", "params": {"expr": f"True or {param}"}},
                                  "options": {"key_ranges": ranges}})


EVENTS = InjectorSpec("events", "events")


def whole(topology: Topology) -> Topology:
    """What a worker reads from the whole registry's JSON."""
    return convert.topology_from_json(convert.topology_to_json(topology))


def roundtrip(base: Topology, new: Topology) -> Topology:
    got = apply(base, encode(3, base, 4, new))
    assert got == new == whole(new)
    return got


# -- the contract ----------------------------------------------------------------------
def test_added_changed_removed_and_reordered_computations() -> None:
    a, b, c = comp("a"), comp("b"), comp("c", ("a_out",))
    base = Topology((a, b, c), (EVENTS,))
    added = Topology((a, b, c, comp("d", ("b_out",))), (EVENTS,))
    got = roundtrip(base, added)
    assert got.computations[0] is a and got.computations[2] is c  # unchanged: the worker's own objects
    assert json.loads(encode(3, base, 4, added))["computations"] == [computation_to_dict(added.computations[3])]
    changed = Topology((a, comp("b", param=7), c), (EVENTS,))
    delta = json.loads(encode(3, base, 4, changed))
    assert [d["name"] for d in delta["computations"]] == ["b"] and delta["removed"] == []
    roundtrip(base, changed)
    removed = Topology((a, c), (EVENTS,))
    delta = json.loads(encode(3, base, 4, removed))
    assert delta["computations"] == [] and delta["removed"] == ["b"] and delta["order"] == ["a", "c"]
    roundtrip(base, removed)
    reordered = Topology((c, b, a), (EVENTS,))
    assert json.loads(encode(3, base, 4, reordered))["computations"] == []
    assert roundtrip(base, reordered).computations == (c, b, a)
    everything = Topology((comp("e"), c, comp("a", param=1)), (EVENTS,))
    roundtrip(base, everything)
    assert roundtrip(base, Topology((), (EVENTS,))) == Topology((), (EVENTS,))


def test_an_equal_spec_under_another_object_is_unchanged() -> None:
    a = comp("a")
    base = Topology((a,), (EVENTS,))
    again = Topology((comp("a"),), (EVENTS,))  # equal, not the same object (a registry read back)
    assert changes(base, again) == ([], [])
    assert apply(base, encode(1, base, 2, again)).computations[0] is a


def test_injectors_sinks_and_log_streams_come_whole() -> None:
    a = comp("a")
    base = Topology((a,), (EVENTS,))
    _c, injectors, _l, _s = spec_parts({"injectors": [
        {"name": "events", "stream": "events"},
        {"name": "pulled", "stream": "more", "source": {"type": "redis-stream", "url": "redis://h/0", "stream": "s"}},
        {"name": "wide", "stream": "wide", "key_ranges": 4}]})
    sinks = sinks_from_list([{"stream": "a_out", "type": "postgres", "url": "postgresql://127.0.0.1/db",
                              "table": "t"}])
    new = Topology((a, comp("b", ("more",))), injectors, ("a_out",), sinks)
    new.validate()
    got = roundtrip(base, new)
    assert got.injectors == injectors and got.sinks == sinks and got.log_streams == ("a_out",)
    back = Topology((a,), (EVENTS,))
    roundtrip(new, back)


def test_random_sequences_of_changes_apply_to_what_the_whole_json_reads() -> None:
    rng = random.Random(34)
    for _run in range(20):
        history: list[Topology] = [Topology((comp("c0"),), (EVENTS,))]
        n = 1
        for _step in range(25):
            topo = history[-1]
            comps = list(topo.computations)
            injectors = list(topo.injectors)
            for _ in range(rng.randint(1, 4)):
                op = rng.choice(["add", "add", "change", "remove", "reorder", "injector", "log"])
                if op == "add" or not comps:
                    ups = [c.name + "_out" for c in comps] + [i.stream for i in injectors]
                    comps.append(comp(f"c{n}", (rng.choice(ups),), rng.randint(0, 3), rng.randint(1, 4)))
                    n += 1
                elif op == "change":
                    i = rng.randrange(len(comps))
                    old = comps[i]
                    comps[i] = comp(old.name, tuple(x.stream for x in old.inputs), rng.randint(4, 99))
                elif op == "remove":  # one nobody consumes
                    consumed = {x.stream for c in comps for x in c.inputs}
                    free = [c for c in comps if f"{c.name}_out" not in consumed]
                    if free:
                        comps.remove(rng.choice(free))
                elif op == "reorder":
                    rng.shuffle(comps)
                elif op == "injector":
                    name = f"i{n}"
                    n += 1
                    injectors.append(InjectorSpec(name, name, key_ranges=rng.randint(1, 3)))
            outputs = [f"{c.name}_out" for c in comps]
            logged = tuple(rng.sample(outputs, min(len(outputs), rng.randint(0, 2))))
            new = Topology(tuple(comps), tuple(injectors), logged)
            new.validate()
            history.append(new)
        for _ in range(10):  # from any version to any later one
            i = rng.randrange(len(history))
            j = rng.randrange(i, len(history))
            got = apply(history[i], encode(i + 1, history[i], j + 1, history[j]))
            assert got == history[j] == whole(history[j])
        # a worker following every version in turn ends where the registry is
        held = history[0]
        for v, topo in enumerate(history[1:], 2):
            held = apply(held, encode(v - 1, history[v - 2], v, topo))
        assert held == history[-1]


def test_a_delta_from_another_base_is_refused() -> None:
    a, b = comp("a"), comp("b")
    base = Topology((a, b), (EVENTS,))
    new = Topology((a, b, comp("c")), (EVENTS,))
    delta = encode(2, base, 3, new)
    with pytest.raises(DeltaMismatch):
        apply(Topology((a,), (EVENTS,)), delta)  # b is neither sent nor held
    with pytest.raises(DeltaMismatch):
        apply(Topology((a, b, comp("x")), (EVENTS,)), delta)  # x held, not in the order, not removed
    with pytest.raises(DeltaMismatch):
        apply(base, "[1, 2]")
    with pytest.raises(DeltaMismatch):
        apply(base, "not json")


def test_a_worker_ignores_a_delta_to_another_version() -> None:
    a = comp("a")
    base = Topology((a,), (EVENTS,))
    new = Topology((a, comp("b")), (EVENTS,))
    resp = pb.HeartbeatResponse(topology_version=5, topology_base_version=4,
                                topology_delta_json=encode(4, base, 5, new))
    assert received(base, 3, resp) is None
    assert received(base, 4, resp) == new
    assert received(Topology(), 3, pb.HeartbeatResponse(topology_version=5,
                                                          topology_json=convert.topology_to_json(new))) == new


# -- the controller's versions -----------------------------------------------------------

def test_the_controller_sends_changes_encoded_once_per_pair(tmp_path: Path, encoded: list[str]) -> None:
    reg = Registry(SQLiteStore(tmp_path / "s.db"))
    tj = TopologyJson(keep=4)
    reg.register_topology([comp(f"c{i}") for i in range(30)], [EVENTS], [])
    encoded.clear()  # (the registry's own stored copy)
    tj.note(reg)
    assert encoded == []  # nothing encoded until a worker needs it
    first = tj.answer(tj.snapshot(reg, -1), True)  # a new worker: the whole registry
    assert first.version == 1 and convert.topology_from_json(first.whole) == reg.topology and not first.delta
    assert len(encoded) == 30
    encoded.clear()
    reg.register_topology([comp("late"), comp("later")], [], [])
    encoded.clear()
    tj.note(reg)
    answers = [tj.answer(tj.snapshot(reg, 1), True) for _ in range(5)]  # five workers at version 1
    assert all(a.delta == answers[0].delta and a.base == 1 and a.version == 2 and not a.whole for a in answers)
    assert encoded == ["late", "later"]  # the new computations alone, once
    assert tj.encoded == {"whole": 1, "delta": 1} and tj.sent == {"whole": 1, "delta": 5}
    assert apply(convert.topology_from_json(first.whole), answers[0].delta) == reg.topology
    assert tj.answer(tj.snapshot(reg, 2), True) == type(answers[0])(2)  # up to date: nothing
    # An older worker (no deltas), one at 0 and one at a version no longer kept: whole.
    assert tj.answer(tj.snapshot(reg, 1), False).whole
    assert tj.answer(tj.snapshot(reg, 0), True).whole
    for i in range(5):
        reg.unregister_computation(f"c{i}")
        tj.note(reg)
    too_old = tj.answer(tj.snapshot(reg, 1), True)
    assert too_old.whole and not too_old.delta
    kept = tj.answer(tj.snapshot(reg, 4), True)
    assert kept.base == 4 and json.loads(kept.delta)["removed"] == ["c2", "c3", "c4"]  # versions 4..7 kept
    # A new leader's registry (read back from the store): every version known afresh.
    again = Registry(reg.store)
    snap = tj.snapshot(again, reg.version - 1)
    assert snap is not None and snap.base is None and tj.answer(snap, True).whole


def test_a_change_under_way_is_not_read_half_done(tmp_path: Path) -> None:
    """While another thread holds ``Registry.changing`` (a registration validating and
    storing), a heartbeat answers from the newest version kept, never from the registry's
    attributes, which a commit sets one after the other."""
    reg = Registry(SQLiteStore(tmp_path / "s.db"))
    tj = TopologyJson()
    assert tj.snapshot(reg, 0) is not None  # version 0, noted
    reg.register_topology([comp("a")], [EVENTS], [])
    held, release = threading.Event(), threading.Event()

    def registering() -> None:
        with reg.changing:
            held.set()
            release.wait(10)
    t = threading.Thread(target=registering)
    t.start()
    held.wait(10)
    try:
        reg.topology = Topology()  # as a commit would, half done: the version not yet set
        snap = tj.snapshot(reg, 0)
        assert snap is not None and snap.version == 0 and snap.topology == Topology()  # the version noted before
    finally:
        release.set()
        t.join()
    fresh = Registry(SQLiteStore(tmp_path / "t.db"))  # no version of it noted yet, while it changes: nothing
    grab, done = threading.Event(), threading.Event()

    def hold() -> None:
        with fresh.changing:
            grab.set()
            done.wait(10)
    h = threading.Thread(target=hold)
    h.start()
    grab.wait(10)
    try:
        assert tj.snapshot(fresh, 0) is None and tj.answer(None, True).version == 0
    finally:
        done.set()
        h.join()


def test_get_is_the_whole_registry_of_a_registry_without_its_lock() -> None:
    tj = TopologyJson()
    reg: Any = SimpleNamespace(version=3, topology=Topology((comp("a"),), (EVENTS,)))
    version, text = tj.get(reg)
    assert version == 3 and convert.topology_from_json(text) == reg.topology


# -- a controller in process -------------------------------------------------------------
class Worker:
    """Heartbeats as services/worker/service.py does: the topology from each answer."""

    def __init__(self, controller: Any, worker_id: str, deltas: bool = True) -> None:
        self.c, self.id, self.deltas = controller, worker_id, deltas
        self.topology, self.version = Topology(), -1
        self.got: list[str] = []

    def beat(self) -> pb.HeartbeatResponse:
        resp: pb.HeartbeatResponse = self.c.Heartbeat(pb.HeartbeatRequest(
            worker_id=self.id, address=f"127.0.0.1:1/{self.id}", incremental=True, draining=True,
            known_topology_version=self.version, topology_deltas=self.deltas), None)
        if resp.topology_json or resp.topology_delta_json:
            self.got.append("whole" if resp.topology_json else "delta")
            topology = received(self.topology, self.version, resp)
            assert topology is not None
            self.topology, self.version = topology, resp.topology_version
        return resp


def test_workers_follow_the_registry_by_its_changes(tmp_path: Path) -> None:
    controller = Controller(open_store(f"sqlite:///{tmp_path}/s.db"), heartbeat_timeout_s=600)
    c, plane = controller.servicer, controller.plane
    controller.start("127.0.0.1:1")
    try:
        deadline = time.monotonic() + 30
        while not plane.leading():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        a, b, old = Worker(c, "a"), Worker(c, "b"), Worker(c, "old", deltas=False)
        for w in (a, b, old):
            w.beat()
        register, ctx = c.RegisterTopology, cast(Any, None)
        register(pb.RegisterTopologyRequest(computations=[spec_to_proto(comp(f"c{i}")) for i in range(10)],
                                            injectors=[pb.InjectorSpec(name="events", stream="events")]), ctx)
        for w in (a, b, old):
            w.beat()
        register(pb.RegisterTopologyRequest(computations=[spec_to_proto(comp("d", ("c1_out",)))]), ctx)
        c.UnregisterComputation(pb.UnregisterComputationRequest(name="c3"), ctx)
        for w in (a, b, old):
            w.beat()
            assert w.topology == plane.registry.topology and w.version == plane.registry.version
        steady = a.beat()
        assert not steady.topology_json and not steady.topology_delta_json
        assert a.got == b.got == ["whole", "whole", "delta"] and old.got == ["whole", "whole", "whole"]
        assert plane.topology_json.sent["delta"] == 2 and plane.topology_json.encoded["delta"] == 1
        late = Worker(c, "late")  # a worker started now: the whole registry
        late.beat()
        assert late.got == ["whole"] and late.topology == plane.registry.topology
    finally:
        controller.close()
