"""The controller's registry of computations and injectors, persisted in the store.

The registry is a :class:`~millwheel.topology.Topology` kept in the store's metadata
as ONE entry (the whole registry with its version), so a change is one store write:
a crash or a refused request never leaves half a change behind. (A store written by
an older controller, one entry per computation or injector, is read as well; the
first change rewrites it in the new form.) Every change is validated on a copy first,
from the spec's data only (:mod:`millwheel.operators.schema`: nothing named in a spec
is imported or called here), and import paths against the code allow-list.
"""

from __future__ import annotations

import json
import threading
from typing import Sequence

from millwheel.connectors.own_store import refuse_own_store
from millwheel.connectors.spec import SinkSpec, sink_to_dict, sinks_from_list
from millwheel.errors import AlreadyExistsError, InvalidSpecError, NotFoundError, ResourceLimitError
from millwheel.importing import AllowList
from millwheel.limits import MAX_LOG_STREAMS, MAX_NAME_CHARS, MAX_TOTAL_KEY_RANGES
from millwheel.nodes import injector_node, sink_node
from millwheel.operators.schema import check_allowed, validate_spec
from millwheel.spec import ComputationTexts, computation_from_dict, injector_to_dict, json_object, spec_parts
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, InjectorSpec, Topology

from ..rpc.status import PreconditionError

# {"version", "computations", "injectors", "log_streams"[, "versions", "previous", "sinks"]}
REGISTRY_KEY = "registry/v2"
COMP_PREFIX = "registry/computation/"  # the older layout, read only
INJ_PREFIX = "registry/injector/"
VERSION_KEY = "registry/version"
ORDER_KEY = "registry/order"
LOG_KEY = "registry/log_streams"


class Registry:
    def __init__(self, store: StateStore, allow: AllowList | None = None) -> None:
        self.store = store
        self.allow = allow or AllowList()
        # Changes one at a time: validated and stored under this lock alone, never the
        # controller's (heartbeats take that one), however large the registration.
        self.changing = threading.RLock()
        self._texts = ComputationTexts()  # the stored JSON of each spec, encoded once (under changing)
        whole = store.get_meta(REGISTRY_KEY)
        if whole is not None:
            data = json.loads(whole)
            self.topology = Topology(
                tuple(computation_from_dict(c) for c in data["computations"]),
                spec_parts({"injectors": data["injectors"]})[1],
                tuple(data["log_streams"]), sinks_from_list(data.get("sinks", [])))
            self.version = int(data["version"])
            # Per-computation versions and rollback targets (services/controller/update.py);
            # a registry stored before updates existed has neither: every computation is at 1.
            self.versions = {str(k): int(v) for k, v in data.get("versions", {}).items()}
            self.previous = {str(k): computation_from_dict(v) for k, v in data.get("previous", {}).items()}
            # Per computation, every input stream it consumed since registration -> its key
            # extractor (services/controller/compat.py); absent before updates recorded it.
            self.keyed = {str(k): {str(s): str(e) for s, e in v.items()} for k, v in data.get("keyed", {}).items()}
        else:
            self.topology, self.version = _read_old_layout(store)
            self.versions, self.previous = {}, {}
            self.keyed = {}

    # -- queries ---------------------------------------------------------------------
    def computation(self, name: str) -> ComputationSpec:
        for spec in self.topology.computations:
            if spec.name == name:
                return spec
        known = ", ".join(c.name for c in self.topology.computations) or "none registered"
        raise NotFoundError(f"no computation named {name[:MAX_NAME_CHARS]!r} (known: {known})")

    def version_of(self, name: str) -> int:
        """A computation's version: 1 at registration, +1 per update (missing: 1)."""
        return self.versions.get(name, 1)

    def injector(self, name: str) -> InjectorSpec | None:
        return self.topology.injector(name)

    def nodes(self) -> dict[str, int]:
        """Every node that owns key ranges -> its range count (injectors have one)."""
        return candidate_nodes(self.topology)

    def has_node(self, node: str) -> bool:
        return node in self.nodes()

    # -- changes ---------------------------------------------------------------------
    def register_computation(self, spec: ComputationSpec, log_streams: tuple[str, ...] = ()) -> None:
        if any(c.name == spec.name for c in self.topology.computations):
            raise AlreadyExistsError(f"computation {spec.name!r} is already registered")
        for stream in log_streams:
            if stream not in spec.all_outputs():
                raise InvalidSpecError(
                    f"computation {spec.name!r}: log stream {stream[:200]!r} is not one of its outputs")
        self.register_topology((spec,), (), log_streams)

    def register_topology(self, computations: Sequence[ComputationSpec],
                          injectors: Sequence[InjectorSpec], log_streams: Sequence[str],
                          sinks: Sequence[SinkSpec] = ()) -> tuple[list[ComputationSpec], list[InjectorSpec]]:
        """Register all of it or nothing: returns what was new. A computation or
        injector identical to a registered one is left as it is (so a spec file can be
        registered again); one that differs is ALREADY_EXISTS."""
        with self.changing:
            return self._register_topology(computations, injectors, log_streams, sinks)

    def _register_topology(self, computations: Sequence[ComputationSpec],
                           injectors: Sequence[InjectorSpec], log_streams: Sequence[str],
                           sinks: Sequence[SinkSpec] = ()) -> tuple[list[ComputationSpec], list[InjectorSpec]]:
        topo = self.topology
        if len(log_streams) > MAX_LOG_STREAMS:
            raise InvalidSpecError(f"log_streams: {len(log_streams)} streams, over the limit of {MAX_LOG_STREAMS}")
        new_comps: list[ComputationSpec] = []
        for spec in computations:
            validate_spec(spec)
            check_allowed(spec, self.allow)
            existing = next((c for c in topo.computations if c.name == spec.name), None)
            if existing is not None:
                if existing != spec:
                    raise AlreadyExistsError(f"computation {spec.name!r} is already registered "
                                             "(with a different spec)")
                continue
            new_comps.append(spec)
        new_injectors: list[InjectorSpec] = []
        for inj in injectors:
            if not inj.name or not inj.stream:
                raise InvalidSpecError("injector: needs a non-empty 'name' and 'stream'")
            known = self.injector(inj.name) or next((i for i in new_injectors if i.name == inj.name), None)
            if known is not None:
                if known.stream != inj.stream:
                    raise AlreadyExistsError(f"injector {inj.name!r} is already registered for "
                                             f"stream {known.stream!r}")
                if known.key_ranges != inj.key_ranges:
                    raise AlreadyExistsError(f"injector {inj.name!r} is already registered with "
                                             f"{known.key_ranges} key ranges, not {inj.key_ranges}")
                if known.source != inj.source and inj.source is not None:
                    raise AlreadyExistsError(f"injector {inj.name!r} is already registered "
                                             "(with a different source)")
                continue
            new_injectors.append(inj)
        new_sinks: list[SinkSpec] = []
        for sink in sinks:
            known_sink = next((s for s in (*topo.sinks, *new_sinks) if s.name == sink.name), None)
            if known_sink is not None:
                if known_sink != sink:
                    raise AlreadyExistsError(f"sink {sink.name!r} is already registered (with other settings)")
                continue
            new_sinks.append(sink)
        # A Redis connector naming the store's own server would write into its keys (issue 34, item 5).
        refuse_own_store([*((f"injector {i.name!r} source", i.source.type, i.source.settings)
                            for i in new_injectors if i.source is not None),
                          *((f"sink {s.name!r}", s.connector.type, s.connector.settings) for s in new_sinks)],
                         self.store)
        outputs = {s for c in (*topo.computations, *new_comps) for s in c.all_outputs()}
        for stream in log_streams:
            if stream not in outputs:
                raise InvalidSpecError(f"log stream {stream[:200]!r} is not an output of any computation")
        logged = tuple(dict.fromkeys((*topo.log_streams, *log_streams)))
        candidate = Topology((*topo.computations, *new_comps), (*topo.injectors, *new_injectors), logged,
                             (*topo.sinks, *new_sinks))
        candidate.validate()
        total = sum(candidate_nodes(candidate).values())
        if total > MAX_TOTAL_KEY_RANGES and total > sum(self.nodes().values()):
            raise ResourceLimitError(f"registry: {total} key ranges in all, over the limit of "
                                     f"{MAX_TOTAL_KEY_RANGES}")
        if new_comps or new_injectors or new_sinks or logged != topo.log_streams:
            self._commit(candidate)
        return new_comps, new_injectors

    def register_injector(self, spec: InjectorSpec) -> bool:
        """Register ``spec``; False if the same injector was already there (idempotent)."""
        return bool(self.register_topology((), (spec,), ())[1])

    def unregister_computation(self, name: str) -> None:
        with self.changing:
            self._unregister_computation(name)

    def _unregister_computation(self, name: str) -> None:
        spec = self.computation(name)
        candidate = Topology(
            tuple(c for c in self.topology.computations if c.name != name), self.topology.injectors,
            tuple(s for s in self.topology.log_streams if s not in spec.all_outputs()), self.topology.sinks,
        )
        try:
            candidate.validate()
        except InvalidSpecError as exc:
            raise PreconditionError(f"cannot unregister {name!r}: {exc}") from None
        # Registered again later, it starts at version 1 with no rollback target.
        self._commit(candidate, {k: v for k, v in self.versions.items() if k != name},
                     {k: v for k, v in self.previous.items() if k != name})

    def replace_computation(self, spec: ComputationSpec, topology: Topology, version: int,
                            previous: ComputationSpec | None, keyed: dict[str, str] | None = None) -> None:
        """Store ``topology`` (``spec`` replacing its namesake, checked by the caller,
        services/controller/update.py) with the computation's new version and rollback
        target (and, given, its record of input key extractors), in the one write every
        change is."""
        versions = {**self.versions, spec.name: version}
        prev = dict(self.previous)
        if previous is None:
            prev.pop(spec.name, None)
        else:
            prev[spec.name] = previous
        self._commit(topology, versions, prev, None if keyed is None else {**self.keyed, spec.name: keyed})

    def _commit(self, topology: Topology, versions: dict[str, int] | None = None,
                previous: dict[str, ComputationSpec] | None = None,
                keyed: dict[str, dict[str, str]] | None = None) -> None:
        """One store write holds the whole change; memory follows only once it is stored."""
        version = self.version + 1
        versions = self.versions if versions is None else versions
        previous = self.previous if previous is None else previous
        names = {c.name for c in topology.computations}  # an unregistered one's record goes with it
        keyed = {k: v for k, v in (self.keyed if keyed is None else keyed).items() if k in names}
        # Each computation encoded once (ComputationTexts): a change encodes what it adds.
        texts = self._texts.of((*topology.computations, *previous.values()))
        specs, prev = texts[:len(topology.computations)], texts[len(topology.computations):]
        self.store.put_meta(REGISTRY_KEY, json_object({
            "version": version,
            "computations": None,
            "injectors": [injector_to_dict(i) for i in topology.injectors],
            "log_streams": list(topology.log_streams),
            "versions": versions,
            "previous": None,
            "sinks": [sink_to_dict(s) for s in topology.sinks],
            "keyed": keyed,
        }, {"computations": "[" + ", ".join(specs) + "]",
            "previous": "{" + ", ".join(f"{json.dumps(n)}: {t}" for n, t in zip(previous, prev, strict=True)) + "}",
            }).encode())
        self.topology = topology
        self.version = version
        self.versions = versions
        self.previous = previous
        self.keyed = keyed


def candidate_nodes(topology: Topology) -> dict[str, int]:
    out = {injector_node(i.name): i.key_ranges for i in topology.injectors}
    out.update({c.name: c.options.key_ranges for c in topology.computations})
    out.update({sink_node(s.name): 1 for s in topology.sinks})
    return out


def _read_old_layout(store: StateStore) -> tuple[Topology, int]:
    """The registry as controllers before the one-entry layout stored it."""
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
    return Topology(tuple(ordered), tuple(injectors), logged), int(store.get_meta(VERSION_KEY) or b"0")
