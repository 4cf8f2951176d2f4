"""What the parts of a worker process share: the ranges owned here and what the
heartbeat last heard of the cluster.

The worker process (:mod:`services.worker.service`: the heartbeat and range ownership)
is the only writer of the cluster's view (owners, registry, input watermarks) and of
the owned ranges; its parts (receiving, :mod:`services.worker.receive`; sending,
:mod:`services.worker.send`; connectors, :mod:`services.worker.connectors`) are each
handed this one object and read the view afresh at each use: the heartbeat replaces
``owners``, ``topology``, ``router`` and ``unit_of`` whole, never mutating them in place.
"""

from __future__ import annotations

import threading

from millwheel.runtime.routing import Router
from millwheel.topology import Topology

from .parking import UnitOf
from .units import OwnedRange, OwnerInfo

Unit = tuple[str, int]


class Shared:
    """The owned ranges, the cluster as last heard, and the wake-ups of the two loops."""

    def __init__(self) -> None:
        self.worker_id = ""  # set once the server has its port, before the first heartbeat
        self.units: dict[Unit, OwnedRange] = {}
        # Held to add or remove a range against the assignment, and around the inject order.
        self.units_lock = threading.Lock()
        self.owners: dict[Unit, OwnerInfo] = {}  # every range's owner, as last heard
        self.input_wms: dict[str, int] = {}
        self.topology = Topology()
        self.version = -1
        self.router = Router(self.topology)
        self.unit_of = UnitOf(self.topology)  # a production's consumer range (services/worker/parking.py)
        # (node, range, token) rejected by the store: not taken again under that token, and
        # reported to the controller, which then issues a fresh one if it still means us.
        self.fenced_tokens: set[tuple[str, int, int]] = set()
        self.wake = threading.Event()  # new work for the pump (services/worker/send.py)
        self.hb_wake = threading.Event()  # a watermark may have moved: heartbeat soon
