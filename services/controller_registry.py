"""The controller's registry of computations and injectors, persisted in the store.

The registry is a :class:`~millwheel.topology.Topology` kept in the store's metadata
(one entry per computation or injector, plus a version), so a restarted controller
serves exactly what was registered. Every change is validated on a copy first: a bad
request changes nothing.
"""

from __future__ import annotations

import json

from millwheel.errors import AlreadyExistsError, InvalidSpecError, NotFoundError
from millwheel.operators import build_computation
from millwheel.spec import computation_from_dict, computation_to_dict
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, InjectorSpec, Topology, injector_node
from services.status import PreconditionError

COMP_PREFIX = "registry/computation/"
INJ_PREFIX = "registry/injector/"
VERSION_KEY = "registry/version"
ORDER_KEY = "registry/order"
LOG_KEY = "registry/log_streams"


class Registry:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        order = json.loads(store.get_meta(ORDER_KEY) or b"[]")
        comps = {
            name[len(COMP_PREFIX):]: computation_from_dict(json.loads(value))
            for name, value in store.list_meta(COMP_PREFIX).items()
        }
        ordered = [comps[n] for n in order if n in comps]
        ordered += [c for n, c in sorted(comps.items()) if n not in order]
        injectors = [
            InjectorSpec(**json.loads(value)) for value in store.list_meta(INJ_PREFIX).values()
        ]
        logged = tuple(json.loads(store.get_meta(LOG_KEY) or b"[]"))
        self.topology = Topology(tuple(ordered), tuple(injectors), logged)
        self.version = int(store.get_meta(VERSION_KEY) or b"0")

    # -- queries ---------------------------------------------------------------------
    def computation(self, name: str) -> ComputationSpec:
        for spec in self.topology.computations:
            if spec.name == name:
                return spec
        known = ", ".join(c.name for c in self.topology.computations) or "none registered"
        raise NotFoundError(f"no computation named {name!r} (known: {known})")

    def injector(self, name: str) -> InjectorSpec | None:
        return next((i for i in self.topology.injectors if i.name == name), None)

    def nodes(self) -> dict[str, int]:
        """Every node that owns key ranges -> its range count (injectors have one)."""
        out = {injector_node(i.name): 1 for i in self.topology.injectors}
        out.update({c.name: c.options.key_ranges for c in self.topology.computations})
        return out

    def has_node(self, node: str) -> bool:
        return node in self.nodes()

    # -- changes ---------------------------------------------------------------------
    def register_computation(self, spec: ComputationSpec, log_streams: tuple[str, ...] = ()) -> None:
        if any(c.name == spec.name for c in self.topology.computations):
            raise AlreadyExistsError(f"computation {spec.name!r} is already registered")
        for stream in log_streams:
            if stream not in spec.all_outputs():
                raise InvalidSpecError(
                    f"computation {spec.name!r}: log stream {stream!r} is not one of its outputs")
        topo = self.topology
        logged = tuple(dict.fromkeys((*topo.log_streams, *log_streams)))
        candidate = Topology((*topo.computations, spec), topo.injectors, logged)
        candidate.validate()
        build_computation(spec)  # the code must import and accept its parameters
        self.store.put_meta(COMP_PREFIX + spec.name, json.dumps(computation_to_dict(spec)).encode())
        self._commit(candidate)

    def register_injector(self, spec: InjectorSpec) -> bool:
        """Register ``spec``; False if the same injector was already there (idempotent)."""
        if not spec.name or not spec.stream:
            raise InvalidSpecError("injector: needs a non-empty 'name' and 'stream'")
        existing = self.injector(spec.name)
        if existing is not None:
            if existing.stream != spec.stream:
                raise AlreadyExistsError(
                    f"injector {spec.name!r} is already registered for stream {existing.stream!r}"
                )
            return False
        candidate = Topology(self.topology.computations, (*self.topology.injectors, spec),
                             self.topology.log_streams)
        candidate.validate()
        self.store.put_meta(INJ_PREFIX + spec.name, json.dumps(
            {"name": spec.name, "stream": spec.stream}).encode())
        self._commit(candidate)
        return True

    def unregister_computation(self, name: str) -> None:
        spec = self.computation(name)
        candidate = Topology(
            tuple(c for c in self.topology.computations if c.name != name), self.topology.injectors,
            tuple(s for s in self.topology.log_streams if s not in spec.all_outputs()),
        )
        try:
            candidate.validate()
        except InvalidSpecError as exc:
            raise PreconditionError(f"cannot unregister {name!r}: {exc}") from None
        self.store.put_meta(COMP_PREFIX + name, None)
        self._commit(candidate)

    def _commit(self, topology: Topology) -> None:
        self.topology = topology
        self.version += 1
        self.store.put_meta(ORDER_KEY, json.dumps([c.name for c in topology.computations]).encode())
        self.store.put_meta(LOG_KEY, json.dumps(list(topology.log_streams)).encode())
        self.store.put_meta(VERSION_KEY, str(self.version).encode())
