"""The controller's registry over a real SQLite store: a change is one store write (a
head and one entry per computation), a refused change leaves store and memory exactly
as they were, and stores written in the older layouts (the whole registry in one
entry; one entry per computation before that) are still read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from millwheel.errors import AlreadyExistsError, InvalidSpecError, PermissionDeniedError, ResourceLimitError
from millwheel.importing import AllowList
from millwheel.spec import computation_from_dict, computation_to_dict
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import ComputationSpec, InjectorSpec
from services.controller.registry import HEAD_KEY, V2_KEY, Registry


def comp(name: str, source: str = "events", code: dict[str, object] | None = None) -> ComputationSpec:
    return computation_from_dict({"name": name, "inputs": [source], "outputs": [f"{name}_out"],
                                  "code": code or {"name": "filter", "params": {"expr": "True"}}})


def stored(store: SQLiteStore) -> dict[str, bytes]:
    return store.list_meta("registry/")


def test_refused_topology_changes_nothing(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    reg = Registry(store)
    reg.register_topology([comp("a")], [InjectorSpec("events", "events")], [])
    topo, version, before = reg.topology, reg.version, stored(store)
    bad_cases = [
        ([comp("b"), comp("c", code={"name": "window_aggregate", "params": {"size_us": "x"}})],
         InvalidSpecError, "computation 'c'.code.params.size_us"),
        ([comp("b"), comp("a", code={"name": "filter", "params": {"expr": "False"}})],
         AlreadyExistsError, "'a' is already registered"),
        ([comp("b"), comp("c", source="ghost")], InvalidSpecError, "'ghost' is produced by no"),
        ([comp("b"), comp("c", code={"name": "mypkg.mod:Code"})], PermissionDeniedError, "allow-list"),
    ]
    for comps, error, message in bad_cases:
        with pytest.raises(error, match=message):
            reg.register_topology(comps, [InjectorSpec("other", "other")], [])
        assert (reg.topology, reg.version, stored(store)) == (topo, version, before)
        assert Registry(store).topology == topo


def test_a_change_is_one_store_write_and_repeats_are_no_change(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    reg = Registry(store, AllowList.parse("mypkg.*"))
    reg.register_topology([comp("a"), comp("b", code={"name": "mypkg.mod:Code"})],
                          [InjectorSpec("events", "events")], ["a_out"])
    assert list(stored(store)) == ["registry/v3/computation/a", "registry/v3/computation/b", HEAD_KEY]
    again = Registry(store)
    assert again.topology == reg.topology and again.version == reg.version == 1
    assert reg.register_topology([comp("a")], [InjectorSpec("events", "events")], []) == ([], [])
    assert reg.version == 1  # the same spec again: nothing new, nothing written
    reg.unregister_computation("b")
    assert Registry(store).topology.computations == (reg.computation("a"),) and reg.version == 2
    assert list(stored(store)) == ["registry/v3/computation/a", HEAD_KEY]  # b's entry went with it


def test_total_key_ranges_are_bounded(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    reg = Registry(store)
    big = [computation_from_dict({"name": f"c{i}", "inputs": ["events"], "outputs": [f"o{i}"],
                                  "code": {"name": "filter", "params": {"expr": "True"}},
                                  "options": {"key_ranges": 4096}}) for i in range(5)]
    with pytest.raises(ResourceLimitError, match="20481 key ranges in all, over the limit of 16384"):
        reg.register_topology(big, [InjectorSpec("events", "events")], [])
    assert reg.version == 0 and not reg.topology.computations


def test_the_older_layout_is_read(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    a, b = comp("a"), comp("b", source="a_out")
    for spec in (b, a):
        store.put_meta(f"registry/computation/{spec.name}", json.dumps(computation_to_dict(spec)).encode())
    store.put_meta("registry/injector/events", json.dumps({"name": "events", "stream": "events"}).encode())
    store.put_meta("registry/order", json.dumps(["a", "b"]).encode())
    store.put_meta("registry/log_streams", json.dumps(["a_out"]).encode())
    store.put_meta("registry/version", b"7")
    reg = Registry(store)
    assert [c.name for c in reg.topology.computations] == ["a", "b"]
    assert reg.topology.injectors == (InjectorSpec("events", "events"),)
    assert reg.topology.log_streams == ("a_out",) and reg.version == 7
    reg.unregister_computation("b")  # the first change writes the new layout, deleting the old one
    again = Registry(store)
    assert [c.name for c in again.topology.computations] == ["a"] and again.version == 8
    assert again.topology.injectors == (InjectorSpec("events", "events"),) and again.topology.log_streams == ("a_out",)
    assert list(stored(store)) == ["registry/v3/computation/a", HEAD_KEY]


def test_versions_persist_and_a_registry_stored_before_them_loads_at_version_1(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    # A registry entry as controllers before UpdateComputation wrote it: no "versions".
    store.put_meta(V2_KEY, json.dumps({
        "version": 4, "computations": [computation_to_dict(comp("a"))],
        "injectors": [{"name": "events", "stream": "events"}], "log_streams": []}).encode())
    reg = Registry(store)
    assert reg.version_of("a") == 1 and reg.previous == {}
    new = comp("a", code={"name": "filter", "params": {"expr": "False"}})
    topo = type(reg.topology)((new,), reg.topology.injectors, ())
    reg.replace_computation(new, topo, 2, reg.computation("a"))
    again = Registry(store)
    assert again.version_of("a") == 2 and again.previous == {"a": comp("a")}
    assert again.computation("a") == new and again.version == 5
    again.unregister_computation("a")  # registered again later, it starts over at 1
    assert Registry(store).version_of("a") == 1 and Registry(store).previous == {}
