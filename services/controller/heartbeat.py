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
* the registry's JSON when its version differs, serialized once per registry version
  (:class:`TopologyJson`), never under the controller's lock, each computation encoded
  once (:class:`~millwheel.spec.ComputationTexts`: a registration encodes what it adds).
"""

from __future__ import annotations

import threading
from typing import Callable

from millwheel.errors import InvalidSpecError
from millwheel.record import MIN_TIMESTAMP
from millwheel.spec import ComputationTexts
from millwheel.topology import Topology

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from .assign import Assigner, Owner
from .registry import Registry

Unit = tuple[str, int]
Snapshot = tuple[int, int, bool, list[tuple[Unit, Owner | None]], dict[str, str]]


class TopologyJson:
    """The registry as the JSON heartbeats carry, serialized once per registry version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cached: tuple[int, str] | None = None
        self._texts = ComputationTexts()  # each computation encoded once (under _lock)

    def get(self, registry: Registry) -> tuple[int, str]:
        """(version, JSON) of the registry now. The version is read before the topology:
        a change in between pairs the newer topology with the older version, which the
        worker replaces at its next heartbeat, never the reverse (which it would keep)."""
        version = registry.version
        topology: Topology = registry.topology
        with self._lock:  # concurrent heartbeats wait for the one serializing, then share it
            cached = self._cached
            if cached is not None and cached[0] == version:
                return cached
            cached = self._cached = (version, convert.topology_to_json(topology, self._texts))
            return cached

    def prime(self, version: int, topology: Topology) -> None:
        """Serialize a registry version now (at registration, on the registering thread)."""
        with self._lock:
            self._cached = (version, convert.topology_to_json(topology, self._texts))


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
