"""At the documented caps (1,000 computations of 64 KiB parameters; 16,384 key ranges) the
leader's recurring work is proportional to what changed, not to the registry (issue 34
item 9: the whole registry worked over per pass or per registration starved the lease
renewals of a loaded machine's CPU and GIL). Counted here, not timed: how many specs a
registration encodes, how often the log retention policies are worked out, how many
nodes' watermarks a refresh reads, and when the elector's next round is due.
(`python -m bench.cases.caps` measures the lease and heartbeats at the caps.)"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from millwheel.clock import SystemClock
from millwheel.spec import computation_from_dict, computation_to_dict, injector_to_dict
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import ComputationSpec, InjectorSpec, Topology
from services.controller import leader, retention
from services.controller.heartbeat import TopologyJson
from services.controller.registry import COMPUTATION_PREFIX, HEAD_KEY, PREVIOUS_PREFIX, Registry
from services.controller.watermarks import READS_PER_REFRESH, Watermarks
from services.rpc import convert


def comp(name: str) -> ComputationSpec:
    return computation_from_dict({"name": name, "inputs": ["events"], "outputs": [f"{name}_out"],
                                  "code": {"name": "filter", "params": {"expr": "True"}}})



def test_a_registration_encodes_only_the_computations_it_adds(tmp_path: Path, encoded: list[str]) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    reg = Registry(store)
    reg.register_topology([comp(f"c{i}") for i in range(20)], [InjectorSpec("events", "events")], [])
    assert len(encoded) == 20
    encoded.clear()
    reg.register_topology([comp("late")], [], [])
    assert encoded == ["late"]
    # The head names each entry and the change that wrote it; each spec is its own entry.
    want = {"version": 2, "computations": [[f"c{i}", 1] for i in range(20)] + [["late", 2]],
            "injectors": [injector_to_dict(i) for i in reg.topology.injectors], "log_streams": [],
            "versions": {}, "previous": {}, "sinks": [], "keyed": {}}
    assert store.get_meta(HEAD_KEY) == json.dumps(want).encode()
    assert json.loads(store.get_meta(COMPUTATION_PREFIX + "late") or b"") == {
        "written": 2, "spec": computation_to_dict(reg.computation("late"))}
    again = Registry(store)
    assert (again.topology, again.version) == (reg.topology, 2)


def test_an_update_stores_its_rollback_target_with_the_rest(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    reg = Registry(store)
    reg.register_topology([comp("a"), comp("b")], [InjectorSpec("events", "events")], [])
    old = reg.computation("a")
    new = computation_from_dict({**computation_to_dict(old), "outputs": ["a_out", "more"]})
    topo = Topology(tuple(new if c.name == "a" else c for c in reg.topology.computations), reg.topology.injectors)
    reg.replace_computation(new, topo, 2, old)
    assert json.loads(store.get_meta(HEAD_KEY) or b"")["previous"] == {"a": 2}
    assert json.loads(store.get_meta(PREVIOUS_PREFIX + "a") or b"") == {"written": 2, "spec": computation_to_dict(old)}
    again = Registry(store)
    assert again.previous == {"a": old} and again.computation("a") == new and again.versions == {"a": 2}


def test_the_heartbeats_registry_json_encodes_each_computation_once(encoded: list[str]) -> None:
    specs = tuple(comp(f"c{i}") for i in range(10))
    tj = TopologyJson()
    reg: Any = SimpleNamespace(version=1, topology=Topology(specs, (InjectorSpec("events", "events"),)))
    _v, text = tj.get(reg)
    assert len(encoded) == 10
    encoded.clear()
    reg.version, reg.topology = 2, Topology((*specs, comp("late")), reg.topology.injectors)
    version, text = tj.get(reg)
    assert encoded == ["late"] and version == 2
    assert convert.topology_from_json(text) == reg.topology


def test_log_retention_works_out_the_policies_once_per_topology(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Topology] = []
    seen: list[Any] = []

    def counting(topology: Topology) -> Any:
        calls.append(topology)
        return {"x": topology}

    class Trimmer:
        def __init__(self, *_a: Any) -> None:
            pass

        def run(self, policies: Any, _stopping: Any) -> bool:
            seen.append(policies)
            return False
    monkeypatch.setattr(retention, "retention_of", counting)
    monkeypatch.setattr(retention, "LogTrimmer", Trimmer)
    first = Topology((comp("a"),), (InjectorSpec("events", "events"),))
    host: Any = SimpleNamespace(leading=lambda: True, elector=SimpleNamespace(epoch=1), store=None,
                                lock=threading.RLock(), registry=SimpleNamespace(topology=first))
    thread = retention.RetentionThread(host, SystemClock())
    for _ in range(3):
        thread._pass()
    assert calls == [first] and len(seen) == 3
    host.registry = SimpleNamespace(topology=Topology((comp("b"),), first.injectors))
    thread._pass()
    assert calls == [first, host.registry.topology]


class Work:
    def __init__(self) -> None:
        self.keys: list[Any] = []

    def submit(self, key: Any, fn: Any, replace: bool = False) -> Any:
        self.keys.append(key)


def test_a_watermark_refresh_reads_a_bounded_number_of_nodes_in_turn() -> None:
    work = Work()
    wms = Watermarks(store=None, work=work, lock=threading.RLock())  # type: ignore[arg-type]
    nodes = {f"c{i}": 1 for i in range(READS_PER_REFRESH * 2 + 10)}
    read: list[str] = []
    for _ in range(3):
        work.keys.clear()
        wms.refresh(nodes, force=True)
        assert len(work.keys) == READS_PER_REFRESH
        read += [k[1] for k in work.keys]
    assert set(read) == set(nodes)  # every node within three refreshes
    few = {"a": 1, "b": 2}
    work.keys.clear()
    wms.refresh(few, force=True)
    assert sorted(k[1] for k in work.keys) == ["a", "b"]  # a small registry: every node, every time


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class SlowLease:
    """A lease whose renewal takes ``delay`` seconds of the fake clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.delay = 0.0

    def claim_lease(self, holder: str, ttl_ms: int) -> int:
        return 1

    def renew_lease(self, holder: str, epoch: int, ttl_ms: int) -> bool:
        self.clock.now += self.delay
        return True

    def read_lease(self) -> None:
        return None


def test_the_elector_sends_its_next_renewal_a_quarter_ttl_after_the_last_was_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(leader, "time", clock)
    store = SlowLease(clock)
    elector = leader.Elector(store, "a:1", ttl_s=2.0)  # type: ignore[arg-type]
    elector.holder = "a:1 1 x"
    elector.step(inline=True)
    assert elector.is_leader() and elector._due_in() == pytest.approx(0.5)
    store.delay = 0.7  # answered late: the next one goes at once, not 0.5 s after this answer
    clock.now += 0.5
    elector.step()
    assert elector._due_in() == 0.0
    assert elector.is_leader()  # valid until 1.5 s after it was SENT
    clock.now += 0.79
    assert elector.is_leader()
    clock.now += 0.02
    assert not elector.is_leader()  # safety unchanged: 0.75 of the TTL after the renewal was sent
