"""What the controller's parts share: one :class:`ControlPlane`, handed to each part.

The controller is composed of parts, each a class of its own module constructed with the
plane and the few other parts it needs (services/controller/service.py builds them):
leadership (ha.py), registration, queries, injection, updates, rescaling, heartbeats,
savepoints. None of them holds state another part reads; what several of them read or
change lives here, with the one lock that guards it.

**The lock** (:attr:`ControlPlane.lock`, a re-entrant lock). It guards:

* which :class:`Registry` and :class:`Assigner` are current (:attr:`registry` and
  :attr:`assigner` are replaced whole on election and by a standby's periodic pass:
  a part reads them from the plane at each use, never keeps them);
* the assigner's tables (units, workers, moves, ``frozen``, ``held``, ``rescaling``,
  ``stopped``, ``draining``): range assignment is decided under it;
* what heartbeats report: :attr:`pending`, :attr:`sinks_down`, :attr:`sink_positions`,
  :attr:`failing`, and the owners-table snapshot (:attr:`owner_tables`);
* the controller's links to workers (services/controller/inject.py ``WorkerLinks``).

Who takes it: heartbeats (the decisions, then the answer: heartbeat_rpc.py), the
reaper (service.py), registrations after the registry changed (:meth:`after_registration`),
updates and rescales (their fence and commit, with ``Registry.changing`` taken first),
savepoints (the fence and the placing back), a drain (its first step and its sink
positions), the queries that build answers from the assignment and the console's
snapshots. It is never held across a store call on the paths of heartbeats, range moves
and the reaper: those decide under it and make their store calls on store-work threads
(services/controller/store_work.py). Registry changes take ``Registry.changing`` (one at
a time) before this lock, never after it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from millwheel.clock import Clock
from millwheel.importing import AllowList
from millwheel.record import MIN_TIMESTAMP
from millwheel.state.protocol import StateStore

from ..metrics import PrometheusSensors
from .assign import Assigner
from .failing import FailingRanges
from .heartbeat import OwnerTables, TopologyJson
from .leader import Elector
from .registry import Registry
from .store_work import StoreWork
from .watermarks import Watermarks

REBALANCE_CHUNK = 256  # range moves (two store writes each) per hold of the lock after a registration


@dataclass
class Timeouts:
    """How long the controller waits for workers."""

    heartbeat_s: float = 3.0  #: a worker not heard from for this long is dead
    takeover_grace_s: float = 10.0  #: a new leader gives the workers it finds this long to heartbeat


@dataclass
class ControlPlane:
    """The state the controller's parts share (see the module docstring for the lock)."""

    store: StateStore  #: every write carries the leader epoch (services/controller/leader.py LeaderStore)
    elector: Elector
    clock: Clock
    allow_code: AllowList
    timeouts: Timeouts
    sensors: PrometheusSensors | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    work: StoreWork = field(default_factory=StoreWork)  #: store calls decided under the lock, made outside it
    stop: threading.Event = field(default_factory=threading.Event)
    failing: FailingRanges = field(default_factory=FailingRanges)  #: ranges their owners cannot run, as reported
    #: heartbeats' registry: its last versions, their JSON and changes encoded once when needed
    topology_json: TopologyJson = field(default_factory=TopologyJson)
    owner_tables: OwnerTables = field(default_factory=OwnerTables)  #: heartbeats' owners table as deltas
    #: outbox entries per range, as last reported
    pending: dict[tuple[str, int], int] = field(default_factory=dict)
    #: worker -> its failing sinks -> seconds failing (docs/connectors.md)
    sinks_down: dict[str, dict[str, float]] = field(default_factory=dict)
    #: worker -> its sinks -> committed log position (what a drain waits for)
    sink_positions: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the epoch whose takeover is complete (services/controller/ha.py), None while standing by
    led_epoch: int | None = None
    wms: Watermarks = field(init=False)
    registry: Registry = field(init=False)
    assigner: Assigner = field(init=False)

    def __post_init__(self) -> None:
        self.wms = Watermarks(self.store, self.work, self.lock)
        self.registry = Registry(self.store, self.allow_code)
        self.assigner = Assigner(self.store, self.timeouts.heartbeat_s, check_tokens=False)  # a view until elected

    @property
    def address(self) -> str:
        """Where the other controllers and the workers reach this one."""
        return self.elector.address

    def leading(self) -> bool:
        """Leads, and has taken over: registry and assignment loaded for this epoch.
        (Until then a new leader answers like a standby, so no heartbeat meets the
        read-only view in which every worker looks dead.)"""
        epoch = self.elector.epoch
        return epoch is not None and epoch == self.led_epoch and self.elector.is_leader()

    # -- after the registry changed -----------------------------------------------------
    def registry_changed(self) -> None:
        """Units for every registered node, and moves for what is unplaced (the caller
        holds the lock); the registry's new version kept for the heartbeats first."""
        self.topology_json.note(self.registry)
        self.assigner.sync_units(self.registry.nodes())
        self.assigner.rebalance()

    def after_registration(self) -> None:
        """After a registry change made outside the controller's lock (the caller holds
        ``Registry.changing``): the new version kept for the heartbeats (O(1): its JSON, or
        its changes, are encoded when a worker needs them, services/controller/heartbeat.py),
        then the units, under the lock: a worker learns the version with its new owners or before."""
        registry = self.registry
        nodes = registry.nodes()
        known = set(self.assigner.units)
        tokens = {(n, r): self.store.current_token(n, r)  # read before taking the lock
                  for n, count in nodes.items() for r in range(count) if (n, r) not in known}
        with self.lock:
            self.topology_json.note(registry)
            self.assigner.sync_units(registry.nodes(), tokens)
        while True:  # moves in chunks: heartbeats get the lock in between
            with self.lock:
                if self.assigner.rebalance(limit=REBALANCE_CHUNK) < REBALANCE_CHUNK:
                    return

    # -- watermarks --------------------------------------------------------------------
    def watermarks(self) -> tuple[dict[str, int], dict[str, int]]:
        """(output watermark of every node, input watermark of every computation), from
        the controller's copy (services/controller/watermarks.py): no store call."""
        nodes = self.registry.nodes()
        out = {node: self.wms.node(node, count) for node, count in nodes.items()}
        topo = self.registry.topology
        inputs = {
            c.name: min((out.get(u, MIN_TIMESTAMP) for u in topo.upstream(c.name)),
                        default=MIN_TIMESTAMP)
            for c in topo.computations
        }
        return out, inputs

    def publish_watermarks(self) -> None:
        """Every node's watermark and lag to the sensors (the caller holds the lock)."""
        if self.sensors is None:
            return
        self.sensors.controller_role(self.leading(), self.elector.leader_epoch)
        out = {node: self.wms.node(node, count) for node, count in self.registry.nodes().items()}
        now = self.clock.now_us()
        self.sensors.keep_nodes(set(out))  # no series for what is no longer registered
        for node, wm in out.items():
            self.sensors.watermark(node, wm, now - wm if wm > MIN_TIMESTAMP else 0)
