"""Connector kinds come from one table (millwheel/connectors/registry.py): each kind a spec
names is validated by its schema and built as its own class, its client library imported
only when it is built, so the controller validates specs without psycopg or nats. Node
names carry their kind (millwheel/nodes.py) in a prefix that is the store's key layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from millwheel.clock import ManualClock
from millwheel.connectors import registry
from millwheel.connectors.pulled import open_source
from millwheel.errors import InvalidSpecError
from millwheel.nodes import NodeKind, injector_node, is_injector, is_sink, kind_of, name_of, sink_node
from millwheel.runtime.sink_runner import open_sink
from millwheel.spec import topology_from_dict

SOURCES = sorted(registry.sources())
SINKS = sorted(registry.sinks())


def minimal(kind: str, role: registry.Role) -> dict[str, Any]:
    """The least a spec gives for this kind: its required fields, a URL of its first scheme."""
    out: dict[str, Any] = {"type": kind}
    for field in sorted(role.schema.required):
        out[field] = f"{role.schema.schemes[0]}://h/0" if field == "url" else "x"
    return out


def spec(sources: list[dict[str, Any]], sinks: list[dict[str, Any]]) -> dict[str, Any]:
    injectors = [{"name": f"in{i}", "stream": "ev", "source": s} for i, s in enumerate(sources)] or [
        {"name": "in0", "stream": "ev"}]  # records sent to it (InjectRecords)
    return {"injectors": injectors, "sinks": [{"stream": "out", "name": f"out{i}", **s} for i, s in enumerate(sinks)],
            "computations": [{"name": "c", "inputs": ["ev"], "outputs": ["out"],
                              "code": {"name": "filter", "params": {"expr": "True"}}}]}


def test_the_kinds_a_spec_may_name_are_unchanged() -> None:
    assert SOURCES == ["files", "nats-jetstream", "redis-stream"]
    assert SINKS == ["nats-jetstream", "postgres", "redis-stream"]


@pytest.mark.parametrize("kind", SOURCES)
def test_each_source_kind_is_validated_then_built_as_its_class(kind: str, tmp_path: Path) -> None:
    role = registry.sources()[kind]
    topo = topology_from_dict(spec([minimal(kind, role)], []))
    source = topo.injectors[0].source
    assert source is not None and source.type == kind
    built = open_source("in0", source.settings, ManualClock(), str(tmp_path))
    cls = type(built.connector)
    assert f"{cls.__module__}:{cls.__name__}" == role.path


@pytest.mark.parametrize("kind", SINKS)
def test_each_sink_kind_is_validated_then_built_as_its_class(kind: str) -> None:
    role = registry.sinks()[kind]
    topo = topology_from_dict(spec([], [minimal(kind, role)]))
    cls = type(open_sink(topo.sinks[0].connector.settings))
    assert f"{cls.__module__}:{cls.__name__}" == role.path


def test_a_files_source_reads_paths_relative_to_the_spec(tmp_path: Path) -> None:
    (tmp_path / "ev.jsonl").write_text(json.dumps({"key": "k", "value": 1, "timestamp": 5}) + "\n")
    topo = topology_from_dict(spec([{"type": "files", "path": "ev.jsonl", "until": "end"}], []))
    assert topo.injectors[0].source is not None
    src = open_source("in0", topo.injectors[0].source.settings, ManualClock(), str(tmp_path))
    try:
        batch = src.read(None, 10)
    finally:
        src.close()
    assert [r.key for r in batch.records] == ["k"]


def test_validating_every_kind_imports_no_client_library() -> None:
    """What the controller does with a spec: no psycopg, nats or redis, no connector module."""
    data = spec([minimal(k, r) for k, r in registry.sources().items()],
                [minimal(k, r) for k, r in registry.sinks().items()])
    code = ("import json, sys\n"
            "from millwheel.spec import topology_from_dict\n"
            f"topology_from_dict(json.loads({json.dumps(data)!r}))\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(done.stdout))
    clients = {"psycopg", "nats", "redis"}
    connectors = {r.path.partition(":")[0] for r in [*registry.sources().values(), *registry.sinks().values()]}
    assert not {m for m in loaded if m.split(".")[0] in clients} | (loaded & connectors)


@pytest.mark.parametrize("settings,message", [
    ({"type": "kafka"}, "injector 'ev': unknown source type 'kafka'"),
    ({"type": "postgres"}, "injector 'ev': unknown source type 'postgres'"),  # a sink only
])
def test_an_unknown_source_kind_is_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=f"^{message}$"):
        open_source("ev", settings, ManualClock())


@pytest.mark.parametrize("kind", ["kafka", "files"])  # files: a source only
def test_an_unknown_sink_kind_is_refused(kind: str) -> None:
    with pytest.raises(InvalidSpecError, match=f"^unknown sink type '{kind}'$"):
        open_sink({"type": kind})


def test_a_spec_naming_an_unknown_kind_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(InvalidSpecError) as err:
        topology_from_dict(spec([], [{"type": "files", "path": "x"}]))
    assert "sinks[0].type: must be one of ['nats-jetstream', 'postgres', 'redis-stream'], got 'files'" \
        in str(err.value)


@pytest.mark.parametrize("kind", list(NodeKind))
def test_a_node_name_round_trips_through_its_kind(kind: NodeKind) -> None:
    node = kind.node("ev")
    assert kind_of(node) is kind
    assert name_of(node) == "ev"
    assert is_injector(node) == (kind is NodeKind.INJECTOR)
    assert is_sink(node) == (kind is NodeKind.SINK)


def test_node_names_keep_the_store_layout() -> None:
    assert injector_node("ev") == "injector:ev"
    assert sink_node("out.postgres") == "sink:out.postgres"
    assert kind_of("c") is NodeKind.COMPUTATION
    # A worker's address labels some metrics beside node names: it is no injector.
    assert kind_of("127.0.0.1:5000") is NodeKind.COMPUTATION
