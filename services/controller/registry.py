"""The controller's registry of computations and injectors, persisted in the store.

The registry is a :class:`~millwheel.topology.Topology` kept in the store's metadata
as one entry per computation plus a small head (the layout ``v3``, below), and every
change is ONE atomic store write (:meth:`~millwheel.state.protocol.StateStore.put_metas`,
fenced by the leader epoch when the store is the leader's): a crash or a refused
request never leaves half a change behind. Every change is validated on a copy first,
from the spec's data only (:mod:`millwheel.operators.schema`: nothing named in a spec
is imported or called here), and import paths against the code allow-list.

Why one entry per computation: the store has one writer at a time (SQLite's single
writer; one Redis script), and the leader's lease renewal is a write too. Kept as one
entry (the layout ``v2``), the whole registry was rewritten by every change: at the
documented caps (1,000 computations of 64 KiB parameters) a 64 MB write per
registration, which held SQLite's writer for 0.3-1 s on a loaded machine while the
renewal waited behind it and the lease lapsed (issue 34 item 9; docs/bench.md, "The
leader's lease at the caps"). Now a change writes the head and only the entries it
changes: a registration costs what it adds, not the registry.

The layout ``v3``:

* ``registry/v3/head``: ``{"version", "computations": [[name, written], ...] (in
  order), "injectors", "log_streams", "versions", "previous": {name: written},
  "sinks", "keyed"}``; all of it small.
* ``registry/v3/computation/NAME``: ``{"written": W, "spec": {...}}``, a computation's
  spec, written by the change that made the registry version W.
* ``registry/v3/previous/NAME``: the same for the computation's rollback target
  (services/controller/update.py).

The head names the ``written`` version of every entry it means, so a reader that is
not the writer (a standby, while the leader changes the registry) reads the head, then
the entries, and reads again if an entry is not the one the head names: what it
loads is always one stored registry, never a mix of two.

Older stores are read as well: the layout ``v2`` (the whole registry in the one entry
``registry/v2``) and the one before it (one entry per computation or injector under
``registry/computation/``, ``registry/injector/``, ...). The first change writes the
layout ``v3`` and deletes the older entries in the same write.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Sequence

from millwheel.connectors.own_store import refuse_own_store
from millwheel.connectors.spec import SinkSpec, sink_to_dict, sinks_from_list
from millwheel.errors import AlreadyExistsError, InvalidSpecError, NotFoundError, ResourceLimitError, StoreError
from millwheel.importing import AllowList
from millwheel.limits import MAX_LOG_STREAMS, MAX_NAME_CHARS, MAX_TOTAL_KEY_RANGES
from millwheel.nodes import injector_node, sink_node
from millwheel.operators.schema import check_allowed, validate_spec
from millwheel.spec import ComputationTexts, computation_from_dict, injector_to_dict, spec_parts
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, InjectorSpec, Topology

from ..rpc.status import PreconditionError

HEAD_KEY = "registry/v3/head"  # the layout v3 (the module docstring)
COMPUTATION_PREFIX = "registry/v3/computation/"
PREVIOUS_PREFIX = "registry/v3/previous/"
#: The entry whose "version" is the stored registry's version (read by standbys, services/controller/ha.py).
REGISTRY_KEY = HEAD_KEY
V2_KEY = "registry/v2"  # the layout v2, read only: {"version", "computations", "injectors", "log_streams", ...}
COMP_PREFIX = "registry/computation/"  # the layout before v2, read only
INJ_PREFIX = "registry/injector/"
VERSION_KEY = "registry/version"
ORDER_KEY = "registry/order"
LOG_KEY = "registry/log_streams"
READ_TRIES = 20  # reads of head and entries before a reader gives up on a registry changing under it


class Registry:
    def __init__(self, store: StateStore, allow: AllowList | None = None) -> None:
        self.store = store
        self.allow = allow or AllowList()
        # Changes one at a time: validated and stored under this lock alone, never the
        # controller's (heartbeats take that one), however large the registration.
        self.changing = threading.RLock()
        self._texts = ComputationTexts()  # the stored JSON of each spec, encoded once (under changing)
        # What the store holds, name -> (spec, the version that wrote its entry): a change
        # writes the entries whose spec differs and deletes those it drops.
        self._stored: dict[str, tuple[ComputationSpec, int]] = {}
        self._stored_previous: dict[str, tuple[ComputationSpec, int]] = {}
        self._legacy: list[str] = []  # entries of an older layout, deleted by the first change
        data = self._read(store)
        injectors = data["injectors"]  # spec-file fields, or the layout before v2's InjectorSpec fields
        self.topology = Topology(
            tuple(c if isinstance(c, ComputationSpec) else computation_from_dict(c) for c in data["computations"]),
            tuple(injectors) if data.get("old_layout") else spec_parts({"injectors": injectors})[1],
            tuple(data["log_streams"]), sinks_from_list(data.get("sinks", [])))
        self.version = int(data["version"])
        # Per-computation versions and rollback targets (services/controller/update.py);
        # a registry stored before updates existed has neither: every computation is at 1.
        self.versions = {str(k): int(v) for k, v in data.get("versions", {}).items()}
        self.previous = {str(k): v if isinstance(v, ComputationSpec) else computation_from_dict(v)
                         for k, v in data.get("previous", {}).items()}
        # Per computation, every input stream it consumed since registration -> its key
        # extractor (services/controller/compat.py); absent before updates recorded it.
        self.keyed = {str(k): {str(s): str(e) for s, e in v.items()} for k, v in data.get("keyed", {}).items()}

    def _read(self, store: StateStore) -> dict[str, Any]:
        """The stored registry's fields: the layout v3, else an older one (whose entries
        are then noted for deletion). An older layout is read again if a change
        replaced it meanwhile (a leader's first change, while a standby or a successor
        reads): the head appears in that same write."""
        for _ in range(READ_TRIES):
            head = store.get_meta(HEAD_KEY)
            if head is not None:
                data, self._stored, self._stored_previous = _read_v3(store, head)
                return data
            whole = store.get_meta(V2_KEY)
            data = json.loads(whole) if whole is not None else _read_old_layout(store)
            legacy = ([V2_KEY] if whole is not None else []) + _old_layout_names(store)
            if store.get_meta(HEAD_KEY) is None:
                self._legacy = legacy
                return data
        raise StoreError(f"the registry changed under each of {READ_TRIES} reads of it; try again")

    # -- queries ---------------------------------------------------------------------
    @property
    def older_layout(self) -> bool:
        """Read from a layout before v3, which the store still holds until the first change."""
        return bool(self._legacy)

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
        """One store write holds the whole change (the head, the entries of the specs
        that differ from the stored ones, deletions of those dropped); memory follows
        only once it is stored."""
        version = self.version + 1
        versions = self.versions if versions is None else versions
        previous = self.previous if previous is None else previous
        names = {c.name for c in topology.computations}  # an unregistered one's record goes with it
        keyed = {k: v for k, v in (self.keyed if keyed is None else keyed).items() if k in names}
        entries: dict[str, bytes | None] = dict.fromkeys(self._legacy)
        writes: list[tuple[str, ComputationSpec]] = []
        stored = _changed(self._stored, [(c.name, c) for c in topology.computations], version,
                          COMPUTATION_PREFIX, entries, writes)
        stored_previous = _changed(self._stored_previous, list(previous.items()), version,
                                   PREVIOUS_PREFIX, entries, writes)
        # Each spec written encoded once (ComputationTexts); the unchanged are not encoded at all.
        for (key, _spec), text in zip(writes, self._texts.of(spec for _k, spec in writes), strict=True):
            entries[key] = f'{{"written": {version}, "spec": {text}}}'.encode()
        entries[HEAD_KEY] = json.dumps({
            "version": version,
            "computations": [[n, w] for n, (_c, w) in stored.items()],
            "injectors": [injector_to_dict(i) for i in topology.injectors],
            "log_streams": list(topology.log_streams),
            "versions": versions,
            "previous": {n: w for n, (_c, w) in stored_previous.items()},
            "sinks": [sink_to_dict(s) for s in topology.sinks],
            "keyed": keyed,
        }).encode()
        self.store.put_metas(entries)
        self.topology = topology
        self.version = version
        self.versions = versions
        self.previous = previous
        self.keyed = keyed
        self._stored, self._stored_previous, self._legacy = stored, stored_previous, []


def _changed(stored: dict[str, tuple[ComputationSpec, int]], specs: list[tuple[str, ComputationSpec]],
             version: int, prefix: str, entries: dict[str, bytes | None],
             writes: list[tuple[str, ComputationSpec]]) -> dict[str, tuple[ComputationSpec, int]]:
    """The stored entries after a change to ``specs`` (name -> spec, in order): a spec
    equal to its stored one keeps its entry; the others are appended to ``writes`` and
    the dropped entries' deletions put in ``entries``."""
    out: dict[str, tuple[ComputationSpec, int]] = {}
    for name, spec in specs:
        known = stored.get(name)
        if known is not None and (known[0] is spec or known[0] == spec):
            out[name] = (spec, known[1])
        else:
            out[name] = (spec, version)
            writes.append((prefix + name, spec))
    for name in stored:
        if name not in out:
            entries[prefix + name] = None
    return out


def candidate_nodes(topology: Topology) -> dict[str, int]:
    out = {injector_node(i.name): i.key_ranges for i in topology.injectors}
    out.update({c.name: c.options.key_ranges for c in topology.computations})
    out.update({sink_node(s.name): 1 for s in topology.sinks})
    return out


def _read_v3(store: StateStore, head: bytes) -> tuple[
        dict[str, Any], dict[str, tuple[ComputationSpec, int]], dict[str, tuple[ComputationSpec, int]]]:
    """The registry of the layout v3: the head's fields with the specs read in, and the
    stored entries. Read again while an entry is not the one the head names (a change
    stored between the reads of the head and of the entries)."""
    for _ in range(READ_TRIES):
        data = json.loads(head)
        computations = _entries(store, COMPUTATION_PREFIX, [(str(n), int(w)) for n, w in data["computations"]])
        previous = _entries(store, PREVIOUS_PREFIX, [(str(n), int(w)) for n, w in data["previous"].items()])
        if computations is not None and previous is not None:
            data["computations"] = [c for c, _w in computations.values()]
            data["previous"] = {n: c for n, (c, _w) in previous.items()}
            return data, computations, previous
        again = store.get_meta(HEAD_KEY)
        if again is None:
            raise StoreError(f"the registry's head {HEAD_KEY!r} disappeared from the store while it was read")
        head = again
    raise StoreError(f"the registry changed under each of {READ_TRIES} reads of it; try again")


def _entries(store: StateStore, prefix: str,
             wanted: list[tuple[str, int]]) -> dict[str, tuple[ComputationSpec, int]] | None:
    """The specs the head names (name, written), in its order; None if an entry is not the one named."""
    if not wanted:
        return {}
    found = store.list_meta(prefix)
    out: dict[str, tuple[ComputationSpec, int]] = {}
    for name, written in wanted:
        raw = found.get(prefix + name)
        if raw is None:
            return None
        entry = json.loads(raw)
        if int(entry["written"]) != written:
            return None
        out[name] = (computation_from_dict(entry["spec"]), written)
    return out


def _read_old_layout(store: StateStore) -> dict[str, Any]:
    """The registry as controllers before the layout v2 stored it (empty if none is stored)."""
    order = json.loads(store.get_meta(ORDER_KEY) or b"[]")
    comps = {
        name[len(COMP_PREFIX):]: computation_from_dict(json.loads(value))
        for name, value in store.list_meta(COMP_PREFIX).items()
    }
    ordered = [comps[n] for n in order if n in comps]
    ordered += [c for n, c in sorted(comps.items()) if n not in order]
    injectors = [InjectorSpec(**json.loads(value)) for value in store.list_meta(INJ_PREFIX).values()]
    return {"version": int(store.get_meta(VERSION_KEY) or b"0"), "computations": ordered, "old_layout": True,
            "injectors": injectors, "log_streams": json.loads(store.get_meta(LOG_KEY) or b"[]")}


def _old_layout_names(store: StateStore) -> list[str]:
    """The entries of the layout before v2 still in the store (deleted by the first change)."""
    names = [*store.list_meta(COMP_PREFIX), *store.list_meta(INJ_PREFIX)]
    return names + [n for n in (VERSION_KEY, ORDER_KEY, LOG_KEY) if store.get_meta(n) is not None]
