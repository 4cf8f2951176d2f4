"""The registry a savepoint carries: written from the running registry, and admitted
at restore exactly as a registration is (services/controller/registry.py): every spec
validated from its data alone (built-ins built as a worker would; nothing imported),
code paths checked against this controller's --allow-code, the topology's rules and
limits. A savepoint can carry nothing a registration could not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from millwheel.connectors.spec import sink_to_dict, sinks_from_list
from millwheel.errors import InvalidSpecError, MillWheelError
from millwheel.importing import AllowList
from millwheel.limits import MAX_NAME_CHARS, MAX_TOTAL_KEY_RANGES
from millwheel.operators.schema import check_allowed, validate_spec
from millwheel.savepoint.format import SavepointFileError
from millwheel.spec import computation_from_dict, computation_to_dict, injector_to_dict, spec_parts
from millwheel.topology import ComputationSpec, Topology

from .registry import Registry, candidate_nodes


@dataclass(frozen=True)
class CarriedRegistry:
    topology: Topology
    versions: dict[str, int]
    previous: dict[str, ComputationSpec]

    def nodes(self) -> dict[str, int]:
        """node -> range count (injectors: one)."""
        return candidate_nodes(self.topology)

    def streams(self) -> set[str]:
        """Every stream that may have a log: any computation's output (the dead-letter
        stream included), the injectors' streams and the logged streams."""
        topo = self.topology
        out = {s for c in topo.computations for s in (*c.all_outputs(), c.dead_letter_stream)}
        out.update(i.stream for i in topo.injectors)
        out.update(topo.log_streams)
        return out


def registry_dict(registry: Registry) -> dict[str, Any]:
    """The registry as the savepoint's header holds it (the store's own layout)."""
    topo = registry.topology
    return {"computations": [computation_to_dict(c) for c in topo.computations],
            "injectors": [injector_to_dict(i) for i in topo.injectors],  # a pulled source's too
            "log_streams": list(topo.log_streams),
            "sinks": [sink_to_dict(s) for s in topo.sinks],
            "versions": dict(registry.versions),
            "previous": {n: computation_to_dict(c) for n, c in registry.previous.items()}}


def admit(data: Any, allow: AllowList) -> CarriedRegistry:
    """The carried registry, admitted as a registration is; SavepointFileError (a
    malformed one) or the registration's own error (a spec refused here) otherwise."""
    where = "savepoint registry"
    if not isinstance(data, dict):
        raise SavepointFileError(f"{where}: not an object")
    try:
        comps = tuple(computation_from_dict(c) for c in _list(data, "computations"))
        injectors = spec_parts({"injectors": _list(data, "injectors")})[1]  # as a registration checks them
        for inj in injectors:
            _name(inj.name), _name(inj.stream)
        logged = tuple(_name(s) for s in _list(data, "log_streams"))
        sinks = sinks_from_list(_list(data, "sinks"))
        versions = {_name(k): int(v) for k, v in _dict(data, "versions").items()}
        previous = {_name(k): computation_from_dict(v) for k, v in _dict(data, "previous").items()}
    except MillWheelError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SavepointFileError(f"{where}: malformed ({exc.__class__.__name__}: {str(exc)[:200]})") from None
    names = {c.name for c in comps}
    for name, v in versions.items():
        if name not in names or not 1 <= v <= 1 << 62:
            raise SavepointFileError(f"{where}: version {v} of {name[:200]!r} (not a computation, or out of range)")
    for spec in (*comps, *previous.values()):
        validate_spec(spec)
        check_allowed(spec, allow)
    for name, spec in previous.items():
        if name not in names or spec.name != name:
            raise SavepointFileError(f"{where}: a previous version of {name[:200]!r}, which is not registered")
    topology = Topology(comps, injectors, logged, sinks)
    topology.validate()
    total = sum(candidate_nodes(topology).values())
    if total > MAX_TOTAL_KEY_RANGES:
        raise SavepointFileError(f"{where}: {total} key ranges in all, over the limit of {MAX_TOTAL_KEY_RANGES}")
    return CarriedRegistry(topology, versions, previous)


def _list(data: dict[str, Any], name: str) -> list[Any]:
    v = data.get(name, [])
    if not isinstance(v, list):
        raise InvalidSpecError(f"savepoint registry: {name!r} must be a list")
    return v


def _dict(data: dict[str, Any], name: str) -> dict[str, Any]:
    v = data.get(name, {})
    if not isinstance(v, dict):
        raise InvalidSpecError(f"savepoint registry: {name!r} must be an object")
    return v


def _name(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_NAME_CHARS:
        raise InvalidSpecError(f"savepoint registry: a name must be 1..{MAX_NAME_CHARS} characters")
    return v
