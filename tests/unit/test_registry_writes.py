"""What a registry change writes (services/controller/registry.py, the layout v3): the
head and only the entries it changes, in one atomic ``put_metas``, so a registration
costs what it adds and not the registry (issue 34 item 9: the whole registry rewritten
per change held the store's single writer while the leader's lease renewal waited).
A refused write (a stale leader epoch) leaves the stored registry exactly as it was,
and a reader never loads a mix of two stored registries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest

from millwheel.importing import AllowList
from millwheel.spec import computation_from_dict, computation_to_dict
from millwheel.state import open_store
from millwheel.state.lease import LeadershipLostError
from millwheel.state.protocol import StateStore
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import ComputationSpec, InjectorSpec, Topology
from services.controller.registry import COMPUTATION_PREFIX, HEAD_KEY, PREVIOUS_PREFIX, V2_KEY, Registry
from tests.support.redis_server import RedisServer

ALLOW = AllowList.parse("mypkg.*")
PARAMS = "x" * 8192  # 8 KiB of parameters per spec: the specs, not the head, dominate a write


def comp(name: str, expr: str = "True") -> ComputationSpec:
    return computation_from_dict({"name": name, "inputs": ["events"], "outputs": [f"{name}_out"],
                                  "code": {"name": "mypkg.mod:Code", "params": {"expr": expr, "pad": PARAMS}}})


class Counting:
    """A store whose ``put_metas`` calls are recorded (names and bytes), optionally
    with a leader epoch (as the leader's store passes it) and an action before a read."""

    def __init__(self, store: StateStore, epoch: int | None = None) -> None:
        self.store = store
        self.epoch = epoch
        self.writes: list[dict[str, bytes | None]] = []
        self.before_list: list[Callable[[], None]] = []

    def put_metas(self, entries: Mapping[str, bytes | None]) -> None:
        self.writes.append(dict(entries))
        self.store.put_metas(entries, epoch=self.epoch)

    def put_meta(self, name: str, value: bytes | None) -> None:
        raise AssertionError(f"the registry writes with put_metas only, not put_meta({name!r})")

    def list_meta(self, prefix: str) -> dict[str, bytes]:
        while self.before_list:
            self.before_list.pop(0)()
        return self.store.list_meta(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def size(write: Mapping[str, bytes | None]) -> int:
    return sum(len(k) + len(v or b"") for k, v in write.items())


def everything(store: StateStore) -> dict[str, bytes]:
    return store.list_meta("registry/")


def same(a: Registry, b: Registry) -> None:
    assert (a.topology, a.version, a.versions, a.previous, a.keyed) == (b.topology, b.version, b.versions,
                                                                        b.previous, b.keyed)


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "s.db")
    yield store
    store.close()


def test_a_registration_writes_what_it_adds_not_the_registry(sqlite: SQLiteStore) -> None:
    store = Counting(sqlite)
    reg = Registry(store, ALLOW)  # type: ignore[arg-type]
    reg.register_topology([comp(f"c{i}") for i in range(200)], [InjectorSpec("events", "events")], [])
    assert len(store.writes) == 1
    whole = size(store.writes[0])
    one_spec = len(json.dumps(computation_to_dict(comp("c0"))))
    assert whole > 200 * one_spec
    reg.register_topology([comp("late")], [], [])
    last = store.writes[-1]
    assert sorted(last) == [COMPUTATION_PREFIX + "late", HEAD_KEY]
    assert size(last) < 2 * one_spec < whole / 100  # one spec and the small head, not 200 specs
    # An update writes the new spec and its rollback target; an unregistration deletes.
    new = comp("c7", expr="False")
    old = reg.computation("c7")
    reg.replace_computation(new, Topology(tuple(new if c.name == "c7" else c for c in reg.topology.computations),
                                          reg.topology.injectors), 2, old)
    assert set(store.writes[-1]) == {HEAD_KEY, COMPUTATION_PREFIX + "c7", PREVIOUS_PREFIX + "c7"}
    assert size(store.writes[-1]) < 3 * one_spec
    reg.unregister_computation("c7")
    assert store.writes[-1][COMPUTATION_PREFIX + "c7"] is None and store.writes[-1][PREVIOUS_PREFIX + "c7"] is None
    assert set(store.writes[-1]) == {HEAD_KEY, COMPUTATION_PREFIX + "c7", PREVIOUS_PREFIX + "c7"}
    # A registration of what is registered already writes nothing at all.
    count = len(store.writes)
    reg.register_topology([comp("c1"), comp("late")], [], [])
    assert len(store.writes) == count
    # Restarted on the store, a controller reads exactly the registry it had, and its
    # next change is as small as ever.
    again = Registry(store, ALLOW)  # type: ignore[arg-type]
    same(again, reg)
    again.register_topology([comp("later")], [], [])
    assert sorted(store.writes[-1]) == [COMPUTATION_PREFIX + "later", HEAD_KEY]
    same(Registry(sqlite, ALLOW), again)


def test_a_refused_write_leaves_the_stored_registry_as_it_was(sqlite: SQLiteStore) -> None:
    assert sqlite.claim_lease("a", 60_000) == 1
    store = Counting(sqlite, epoch=1)
    reg = Registry(store, ALLOW)  # type: ignore[arg-type]
    reg.register_topology([comp("a"), comp("b")], [InjectorSpec("events", "events")], [])
    old = reg.computation("a")
    new = comp("a", expr="False")
    reg.replace_computation(new, Topology((new, reg.computation("b")), reg.topology.injectors), 2, old)
    before, memory = everything(sqlite), (reg.topology, reg.version, reg.versions, reg.previous)
    sqlite.release_lease("a", 1)
    assert sqlite.claim_lease("b", 60_000) == 2  # another controller leads now: epoch 1 is stale
    changes: list[Callable[[], object]] = [
        lambda: reg.register_topology([comp("c")], [InjectorSpec("more", "more")], []),
        lambda: reg.unregister_computation("b"),
        lambda: reg.replace_computation(old, Topology((old, reg.computation("b")), reg.topology.injectors), 3,
                                        None),
    ]
    for change in changes:
        with pytest.raises(LeadershipLostError):
            change()
        assert everything(sqlite) == before
        assert (reg.topology, reg.version, reg.versions, reg.previous) == memory
        same(Registry(sqlite, ALLOW), reg)
    # The new leader's change goes through and its successor reads it.
    leader = Registry(Counting(sqlite, epoch=2), ALLOW)  # type: ignore[arg-type]
    leader.unregister_computation("b")
    assert Registry(sqlite, ALLOW).topology.computations == (new,) and Registry(sqlite, ALLOW).previous == {"a": old}


def test_a_reader_never_loads_a_mix_of_two_registries(sqlite: SQLiteStore) -> None:
    writer = Registry(sqlite, ALLOW)
    writer.register_topology([comp("a"), comp("b")], [InjectorSpec("events", "events")], [])
    store = Counting(sqlite)

    def update() -> None:  # stored between the reader's read of the head and of the entries
        new = comp("a", expr="False")
        writer.replace_computation(new, Topology((new, writer.computation("b")), writer.topology.injectors), 2,
                                   writer.computation("a"))

    store.before_list.append(update)
    reader = Registry(store, ALLOW)  # type: ignore[arg-type]
    same(reader, writer)
    assert reader.version == 2 and reader.computation("a") == comp("a", expr="False")


def test_an_older_layout_is_replaced_in_the_first_change(sqlite: SQLiteStore) -> None:
    specs = [comp("a"), comp("b")]
    sqlite.put_meta(V2_KEY, json.dumps({
        "version": 4, "computations": [computation_to_dict(c) for c in specs],
        "injectors": [{"name": "events", "stream": "events"}], "log_streams": ["a_out"],
        "versions": {"a": 3}, "previous": {"a": computation_to_dict(comp("a", expr="False"))},
        "sinks": [], "keyed": {"a": {"events": ""}}}).encode())
    sqlite.put_meta("registry/version", b"2")  # a leftover of the layout before v2
    assert sqlite.claim_lease("a", 60_000) == 1
    store = Counting(sqlite, epoch=1)
    reg = Registry(store, ALLOW)  # type: ignore[arg-type]
    assert reg.older_layout and reg.version == 4 and reg.versions == {"a": 3}
    assert reg.previous == {"a": comp("a", expr="False")} and reg.keyed == {"a": {"events": ""}}
    sqlite.release_lease("a", 1)
    assert sqlite.claim_lease("b", 60_000) == 2
    with pytest.raises(LeadershipLostError):  # refused: the older layout stays, whole
        reg.register_topology([comp("c")], [], [])
    assert set(everything(sqlite)) == {V2_KEY, "registry/version"}
    store.epoch = 2
    reg.register_topology([comp("c")], [], [])
    assert store.writes[-1][V2_KEY] is None and store.writes[-1]["registry/version"] is None
    assert sorted(everything(sqlite)) == sorted([HEAD_KEY, PREVIOUS_PREFIX + "a",
                                                 *(COMPUTATION_PREFIX + n for n in "abc")])
    again = Registry(sqlite, ALLOW)
    same(again, reg)
    assert not again.older_layout and again.version == 5
    reg.register_topology([comp("d")], [], [])
    assert sorted(store.writes[-1]) == [COMPUTATION_PREFIX + "d", HEAD_KEY]


def test_a_reader_of_an_older_layout_replaced_meanwhile_reads_the_new_one(sqlite: SQLiteStore) -> None:
    sqlite.put_meta(V2_KEY, json.dumps({
        "version": 4, "computations": [computation_to_dict(comp("a"))],
        "injectors": [{"name": "events", "stream": "events"}], "log_streams": []}).encode())
    writer = Registry(sqlite, ALLOW)
    store = Counting(sqlite)
    store.before_list.append(lambda: writer.unregister_computation("a"))  # replaces v2 with v3
    reader = Registry(store, ALLOW)  # type: ignore[arg-type]
    same(reader, writer)
    assert reader.version == 5 and not reader.topology.computations and not reader.older_layout
    assert sqlite.get_meta(V2_KEY) is None


def test_the_registry_round_trips_on_redis() -> None:
    with RedisServer() as server:
        store = open_store(server.url)
        try:
            assert store.claim_lease("a", 60_000) == 1
            reg = Registry(Counting(store, epoch=1), ALLOW)  # type: ignore[arg-type]
            reg.register_topology([comp(f"c{i}") for i in range(30)], [InjectorSpec("events", "events")],
                                  ["c3_out"])
            new = comp("c3", expr="False")
            reg.replace_computation(new, Topology(
                tuple(new if c.name == "c3" else c for c in reg.topology.computations), reg.topology.injectors,
                reg.topology.log_streams), 2, reg.computation("c3"), {"events": ""})
            reg.unregister_computation("c5")
            same(Registry(store, ALLOW), reg)
            store.release_lease("a", 1)
            assert store.claim_lease("b", 60_000) == 2
            before = everything(store)
            with pytest.raises(LeadershipLostError):
                reg.register_topology([comp("late")], [], [])
            assert everything(store) == before
            same(Registry(store, ALLOW), reg)
        finally:
            store.close()
