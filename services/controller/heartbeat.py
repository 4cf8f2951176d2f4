"""What a heartbeat answer carries, built so that its cost does not grow with the registry.

Before, every answer held every range of the cluster with its owner (and the range's
watermark, read from the store), and the registry's JSON, serialized again for each
worker whose version differed: with 8,192 ranges a heartbeat took long enough under
the controller's lock that workers were declared dead and came back, again and again;
with 500 computations of 64 KiB parameters each answer after a registration was 32 MB
serialized anew per worker.

Now a worker that sends ``incremental`` gets:

* the owners table as a delta: the assigner versions it (one version per change of a
  range's owner, token or owner's address, :class:`~services.controller.assign.Assigner`),
  the worker says which version it holds, and gets the ranges changed since (nothing
  in a steady cluster), or the whole table (built once per version, outside the lock)
  when it holds none or one too old;
* input watermarks only of the computations assigned to it;
* the registry when its version differs: to a worker that applies deltas and holds one of
  the last versions, the changes since its version (what a registration added, not the
  64 MB of a registry at the caps that every worker parsed after every registration:
  services/rpc/topology_delta.py); to others the whole registry's JSON. Each encoded
  once per version (a delta once per pair), only when a worker needs it, never under
  the controller's lock, each computation once (:class:`TopologyJson`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Mapping

from millwheel.errors import InvalidSpecError
from millwheel.record import MIN_TIMESTAMP
from millwheel.topology import Topology

from ..generated import millwheel_pb2 as pb
from ..rpc import topology_delta
from ..rpc.topology_delta import SpecTexts
from .assign import Assigner, Owner
from .registry import Registry

log = logging.getLogger(__name__)
Unit = tuple[str, int]
Snapshot = tuple[int, int, bool, list[tuple[Unit, Owner | None]], dict[str, str]]


#: How many registry versions the controller keeps to answer a worker with the changes
#: since the one it holds (services/rpc/topology_delta.py); a worker further behind, or
#: holding none, gets the whole registry.
KEEP_VERSIONS = 64


@dataclass(frozen=True)
class TopologyAnswer:
    """What a heartbeat answer says of the registry."""

    version: int = 0  #: the registry version the answer is at (0: none known yet: it says nothing)
    whole: str = ""  #: the whole registry as JSON (topology_json)
    base: int = 0  #: with ``delta``: the version the delta changes
    delta: str = ""  #: the changes from ``base`` to ``version`` (topology_delta_json)
    versions: Mapping[str, int] = field(default_factory=dict)  #: each computation's version, with either


@dataclass
class HeldVersions:
    """The versions of one :class:`Registry` object (a new leader's registry starts afresh:
    a worker holding a version from before gets the whole registry once)."""

    registry: object
    topologies: dict[int, Topology]  #: version -> its topology, oldest first
    newest: tuple[int, Topology, Mapping[str, int]]  #: (version, topology, computation versions)
    whole: tuple[int, str] | None = None  #: the newest version's JSON, once a worker needed it
    #: (target version, base version -> delta JSON)
    deltas: tuple[int, dict[int, str]] = field(default_factory=lambda: (0, {}))


@dataclass(frozen=True)
class TopologySnapshot:
    """Taken under the controller's lock (:meth:`TopologyJson.snapshot`), answered outside it."""

    held: HeldVersions
    version: int
    topology: Topology
    versions: Mapping[str, int]
    known: int  #: the version the worker holds
    base: Topology | None  #: that version's topology, if still held


class TopologyJson:
    """The registry as heartbeats carry it: to a worker that says it applies deltas and
    holds one of the last :data:`KEEP_VERSIONS` versions, the changes since
    (services/rpc/topology_delta.py: what a registration added, not the whole registry);
    to any other worker the whole registry's JSON. Each is encoded once per version (a
    delta once per pair of versions), only when some worker needs it, never under the
    controller's lock; each computation's JSON once per spec object.

    The versions are kept as (version, topology) pairs read together: under the
    controller's lock with ``Registry.changing`` free (or the caller's), as every change
    of the registry commits under one of them: a pair read in the middle of a commit
    would be a topology named by the wrong version, and a worker holding it would apply
    later deltas to the wrong base."""

    def __init__(self, keep: int = KEEP_VERSIONS) -> None:
        self.keep = keep
        self._lock = threading.Lock()  # the versions held (short holds, under the controller's lock)
        self._encoding = threading.Lock()  # one encoding at a time: concurrent heartbeats wait, then share
        self._held: HeldVersions | None = None
        self._texts = SpecTexts()  # each computation encoded once (under _encoding)
        self._texts_for: tuple[HeldVersions | None, int] = (None, -1)  # the versions whose texts are kept
        #: answers sent and JSON documents encoded, whole and as deltas (for tests and logs)
        self.sent = {"whole": 0, "delta": 0}
        self.encoded = {"whole": 0, "delta": 0}

    def note(self, registry: Registry) -> HeldVersions | None:
        """The registry's version and topology kept as a pair, unless a change of it is
        under way on another thread (then None). The caller holds the controller's lock. O(1)."""
        changing = getattr(registry, "changing", None)
        if changing is not None and not changing.acquire(blocking=False):
            return None
        try:
            version, topology = registry.version, registry.topology
            versions: Mapping[str, int] = getattr(registry, "versions", {})
        finally:
            if changing is not None:
                changing.release()
        with self._lock:
            held = self._held
            if held is None or held.registry is not registry:
                held = self._held = HeldVersions(registry, {version: topology}, (version, topology, versions))
            elif version > held.newest[0]:
                held.topologies[version] = topology
                while len(held.topologies) > self.keep:
                    del held.topologies[next(iter(held.topologies))]
                held.newest = (version, topology, versions)
            return held

    def snapshot(self, registry: Registry, known: int) -> TopologySnapshot | None:
        """Under the controller's lock, per heartbeat: the newest version held (noted now
        if no change is under way), and the topology of the version ``known`` the worker
        holds if it is still kept. O(1). None: no version of this registry known yet."""
        held = self.note(registry)
        with self._lock:
            if held is None:
                held = self._held if self._held is not None and self._held.registry is registry else None
            if held is None:
                return None
            version, topology, versions = held.newest
            base = held.topologies.get(known) if 0 < known != version else None
            return TopologySnapshot(held, version, topology, versions, known, base)

    def answer(self, snap: TopologySnapshot | None, deltas: bool) -> TopologyAnswer:
        """Outside the controller's lock: nothing if the worker holds the version, else the
        changes since its version (``deltas``: it applies them, and its version is held),
        else the whole registry."""
        if snap is None:
            return TopologyAnswer()
        if snap.known == snap.version:
            return TopologyAnswer(snap.version)
        if deltas and snap.base is not None:
            return TopologyAnswer(snap.version, base=snap.known, delta=self._delta(snap, snap.base),
                                  versions=snap.versions)
        return TopologyAnswer(snap.version, whole=self._whole(snap), versions=snap.versions)

    def get(self, registry: Registry) -> tuple[int, str]:
        """(version, JSON) of the whole registry now ((0, "") while a change is under way
        and no version was noted yet)."""
        snap = self.snapshot(registry, 0)
        return (snap.version, self._whole(snap)) if snap is not None else (0, "")

    def _delta(self, snap: TopologySnapshot, base: Topology) -> str:
        held = snap.held
        with self._encoding:
            target, cached = held.deltas
            if snap.version > target:  # only the newest version's deltas are kept
                cached = {}
                held.deltas = (snap.version, cached)
            text = cached.get(snap.known) if snap.version == held.deltas[0] else None
            if text is None:
                self._keep_texts(snap)
                text = topology_delta.encode(snap.known, base, snap.version, snap.topology, self._texts.text)
                self.encoded["delta"] += 1
                log.info("registry version %d: its changes since version %d encoded for the workers "
                         "holding it (%d characters)", snap.version, snap.known, len(text))
                if snap.version == held.deltas[0]:
                    cached[snap.known] = text
            self.sent["delta"] += 1
            return text

    def _whole(self, snap: TopologySnapshot) -> str:
        held = snap.held
        with self._encoding:
            cached = held.whole
            if cached is None or cached[0] != snap.version:
                self._keep_texts(snap)
                cached = (snap.version, topology_delta.whole(snap.topology, self._texts))
                self.encoded["whole"] += 1
                log.info("registry version %d: encoded whole (%d characters) for a worker holding version %d",
                         snap.version, len(cached[1]), snap.known)
                if held.whole is None or held.whole[0] < snap.version:
                    held.whole = cached
            self.sent["whole"] += 1
            return cached[1]

    def _keep_texts(self, snap: TopologySnapshot) -> None:
        """The texts kept: those of the newest version's computations (once per version)."""
        at = (snap.held, snap.version)
        if (at[0] is not self._texts_for[0] or at[1] != self._texts_for[1]) and snap.version == snap.held.newest[0]:
            self._texts.keep(snap.topology.computations)
            self._texts_for = at


class OwnerTables:
    """Owners-table answers: a snapshot taken under the controller's lock (cheap), the
    messages built outside it; the whole table cached per (epoch, version)."""

    def __init__(self) -> None:
        self._full: tuple[int, int, list[pb.RangeOwner]] | None = None
        self._full_lock = threading.Lock()
        self._nodes: dict[str, tuple[int, int, frozenset[str]]] = {}  # worker -> (epoch, version, nodes)

    @staticmethod
    def snapshot(assigner: Assigner, known_epoch: int, known_version: int) -> Snapshot:
        """Under the controller's lock: what the answer needs, copied (Owner objects are
        replaced on change, never mutated, so a shallow copy is a consistent view)."""
        changed = assigner.changed_since(known_epoch, known_version)
        full = changed is None
        if changed is None:
            items: list[tuple[Unit, Owner | None]] = []  # the cached table, or built from units
        else:
            items = [(u, assigner.units.get(u)) for u in sorted(changed)]
        addresses = {wid: w.address for wid, w in assigner.workers.items()}
        return assigner.epoch, assigner.version, full, items, addresses

    def full_items(self, assigner: Assigner) -> list[tuple[Unit, Owner | None]]:
        """Under the lock, only when the table of this version is not cached yet."""
        return list(assigner.units.items())

    def cached_full(self, epoch: int, version: int) -> list[pb.RangeOwner] | None:
        full = self._full
        return full[2] if full is not None and full[:2] == (epoch, version) else None

    def build(self, snap: Snapshot, full_items: list[tuple[Unit, Owner | None]] | None) -> list[pb.RangeOwner]:
        """Outside the lock: the RangeOwner messages of a snapshot."""
        epoch, version, full, items, addresses = snap
        if full:
            with self._full_lock:
                cached = self.cached_full(epoch, version)
                if cached is not None:
                    return cached
                owners = _owners(sorted(full_items or ()), addresses)
                self._full = (epoch, version, owners)
                return owners
        return _owners(items, addresses)

    def assigned_nodes(self, assigner: Assigner, worker_id: str) -> frozenset[str]:
        """Under the lock: the nodes with ranges assigned to ``worker_id``, recomputed
        only when the table changed since the last time it was asked."""
        cached = self._nodes.get(worker_id)
        if cached is not None and cached[:2] == (assigner.epoch, assigner.version):
            return cached[2]
        nodes = frozenset(u[0] for u, o in assigner.units.items() if o.worker_id == worker_id)
        self._nodes[worker_id] = (assigner.epoch, assigner.version, nodes)
        if len(self._nodes) > 4 * len(assigner.workers) + 16:  # workers forgotten
            for wid in [w for w in self._nodes if w not in assigner.workers]:
                del self._nodes[wid]
        return nodes


def _owners(items: list[tuple[Unit, Owner | None]], addresses: dict[str, str]) -> list[pb.RangeOwner]:
    out = []
    for (node, range_id), owner in items:
        if owner is None or not owner.worker_id:
            out.append(pb.RangeOwner(node=node, range_id=range_id, token=owner.token if owner else 0))
        else:
            out.append(pb.RangeOwner(node=node, range_id=range_id, worker_id=owner.worker_id,
                                     worker_address=addresses.get(owner.worker_id, ""), token=owner.token))
    return out


def input_watermarks(registry: Registry, nodes: frozenset[str],
                     node_watermark: Callable[[str, int], int]) -> dict[str, int]:
    """The input watermark of each computation among ``nodes``: a store read per node
    upstream of them (``node_watermark(node, ranges)``), not per registered node."""
    topo = registry.topology
    counts = registry.nodes()
    wms: dict[str, int] = {}
    out = {}
    for node in nodes:
        try:
            ups = topo.upstream(node)  # injectors have no input
        except InvalidSpecError:
            continue
        for u in ups:
            if u not in wms:
                wms[u] = node_watermark(u, counts[u]) if u in counts else MIN_TIMESTAMP
        out[node] = min((wms[u] for u in ups), default=MIN_TIMESTAMP)
    return out
