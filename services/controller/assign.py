"""Key-range assignment: which live worker owns each range, under which token.

Every range of every node (computation ranges, and one per injector) is a unit. A
move acquires a fresh sequencer token from the store *before* the new owner hears of
it, so the previous owner (dead, draining, or a zombie that was only paused) has every
later write fenced. Assignments and worker addresses are persisted in the store's
metadata, so a restarted controller keeps the current owners (and gives them one
heartbeat timeout to check in) instead of moving everything.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from millwheel.state.protocol import StateStore

log = logging.getLogger("millwheel.controller")

ASSIGN_PREFIX = "assign/"
WORKER_PREFIX = "worker/"
#: Set by a stop with savepoint (services/controller/savepoint.py): no range is assigned any more.
STOPPED_KEY = "savepoint/stopped"
Unit = tuple[str, int]


@dataclass
class WorkerState:
    worker_id: str
    address: str
    metrics_address: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    draining: bool = False
    refuses: frozenset[str] = frozenset()  # computations its --allow-code refuses
    grace_until: float = 0.0  # not declared dead before this (monotonic): a new leader's grace

    def heartbeat_age_s(self) -> float:
        """Seconds since its last heartbeat, never negative: ``last_seen`` is read before
        the clock, since a heartbeat (or a watchdog's touch, which takes no lock) may set
        it at any moment, and a clock read taken earlier (say before waiting for the
        controller's lock) made the age negative."""
        seen = self.last_seen
        return max(0.0, time.monotonic() - seen)


@dataclass
class Owner:
    worker_id: str | None
    token: int


def _unit_key(unit: Unit) -> str:
    return f"{ASSIGN_PREFIX}{unit[0]}\x1f{unit[1]}"


class Assigner:
    def __init__(self, store: StateStore, timeout_s: float, grace_s: float = 0.0,
                 check_tokens: bool = True) -> None:
        """Load the assignment from the store (reads only). The workers found there get
        ``max(timeout_s, grace_s)`` to heartbeat before they are declared dead: a new
        leader keeps the assignment its workers report instead of moving every range.
        ``check_tokens`` False: a standby's read-only view (no token read per range)."""
        self.store = store
        self.timeout_s = timeout_s
        self.workers: dict[str, WorkerState] = {}
        self.units: dict[Unit, Owner] = {}
        self.stopped = store.get_meta(STOPPED_KEY) is not None
        grace_until = time.monotonic() + grace_s
        for name, value in store.list_meta(WORKER_PREFIX).items():
            data = json.loads(value)
            self.workers[name[len(WORKER_PREFIX):]] = WorkerState(
                data["id"], data["address"], data.get("metrics", ""), grace_until=grace_until)
        for name, value in store.list_meta(ASSIGN_PREFIX).items():
            node, _, rid = name[len(ASSIGN_PREFIX):].rpartition("\x1f")
            data = json.loads(value)
            unit = (node, int(rid))
            owner = Owner(data["worker"], int(data["token"]))
            if check_tokens and owner.token != store.current_token(*unit):  # a move was cut short: redo it
                owner.worker_id = None
            self.units[unit] = owner

    # -- membership ------------------------------------------------------------------
    def heartbeat(self, worker_id: str, address: str, metrics: str, draining: bool,
                  refuses: frozenset[str] = frozenset()) -> bool:
        """Record a heartbeat; True if membership (or what a worker refuses to run)
        changed: a rebalance is due."""
        w = self.workers.get(worker_id)
        changed = False
        if w is None or w.address != address or w.metrics_address != metrics:
            w = self.workers[worker_id] = WorkerState(worker_id, address, metrics)
            self.store.put_meta(WORKER_PREFIX + worker_id, json.dumps(
                {"id": worker_id, "address": address, "metrics": metrics}).encode())
            changed = True
        if not w.alive or w.draining != draining or w.refuses != refuses:
            changed = True
        w.alive, w.draining, w.refuses, w.last_seen = True, draining, refuses, time.monotonic()
        return changed

    def touch(self, worker_id: str) -> None:
        """A liveness-only heartbeat (from a busy worker's watchdog): a live worker's
        last-seen time moves; nothing else changes, and a dead worker stays dead."""
        w = self.workers.get(worker_id)
        if w is not None and w.alive:
            w.last_seen = time.monotonic()

    def reap(self) -> bool:
        """Declare workers silent past the timeout dead; True if any changed."""
        now = time.monotonic()
        changed = False
        for w in self.workers.values():
            if w.alive and now - w.last_seen > self.timeout_s and now > w.grace_until:
                log.warning("worker %s (%s) silent for %.1fs: declared dead", w.worker_id,
                            w.address, now - w.last_seen)
                w.alive = False
                changed = True
        return changed

    def forget_dead(self, older_than_s: float = 600.0) -> None:
        now = time.monotonic()
        for wid in [w.worker_id for w in self.workers.values()
                    if not w.alive and now - w.last_seen > older_than_s
                    and not any(o.worker_id == w.worker_id for o in self.units.values())]:
            del self.workers[wid]
            self.store.put_meta(WORKER_PREFIX + wid, None)

    # -- units -----------------------------------------------------------------------
    def sync_units(self, nodes: dict[str, int]) -> None:
        """Make the unit set match the registry: one unit per range of every node."""
        wanted = {(node, r) for node, count in nodes.items() for r in range(count)}
        for unit in [u for u in self.units if u not in wanted]:
            self.store.acquire(*unit)  # fence whoever still runs it
            del self.units[unit]
            self.store.put_meta(_unit_key(unit), None)
        for unit in sorted(wanted - set(self.units)):
            self.units[unit] = Owner(None, self.store.current_token(*unit))

    def owned_by(self, worker_id: str) -> list[Unit]:
        return [u for u, o in self.units.items() if o.worker_id == worker_id]

    def rebalance(self) -> int:
        """Move units off dead and draining workers, and off workers that refuse to run
        their computation, and even out the rest; returns moves. A unit no live worker
        may run stays where it is. A service stopped with a savepoint runs nothing."""
        if self.stopped:
            return 0
        live = sorted(w.worker_id for w in self.workers.values() if w.alive and not w.draining)
        counts = {wid: 0 for wid in live}
        orphans: list[Unit] = []
        moves = 0

        def may_run(wid: str, unit: Unit) -> bool:
            return unit[0] not in self.workers[wid].refuses

        for unit in sorted(self.units):
            owner = self.units[unit].worker_id
            if owner in counts:
                counts[owner] += 1
                if not may_run(owner, unit) and any(may_run(w, unit) for w in live):
                    counts[owner] -= 1
                    orphans.append(unit)
            elif owner is None or not live:
                if owner is not None and self.workers.get(owner, WorkerState("", "")).draining:
                    self._move(unit, None)  # last worker leaving: hand the range back
                    moves += 1
                elif owner is None:
                    orphans.append(unit)
            else:
                orphans.append(unit)
        if not live:
            return moves
        for unit in orphans:
            able = [w for w in live if may_run(w, unit)] or live
            target = min(able, key=lambda wid: (counts[wid], wid))
            if target != self.units[unit].worker_id:
                self._move(unit, target)
                moves += 1
            counts[target] += 1
        while True:
            hi = max(live, key=lambda wid: (counts[wid], wid))
            lo = min(live, key=lambda wid: (counts[wid], wid))
            if counts[hi] - counts[lo] <= 1:
                break
            movable = [u for u in sorted(self.owned_by(hi)) if may_run(lo, u)]
            if not movable:
                break  # what hi holds, lo may not run: as even as the allow-lists allow
            self._move(movable[-1], lo)
            counts[hi] -= 1
            counts[lo] += 1
            moves += 1
        return moves

    def reissue(self, unit: Unit) -> None:
        """A fresh token for the same owner (its old one was fenced by someone else)."""
        if unit in self.units:
            self._move(unit, self.units[unit].worker_id)

    def _move(self, unit: Unit, worker_id: str | None) -> None:
        token = self.store.acquire(*unit)
        old = self.units[unit].worker_id
        self.units[unit] = Owner(worker_id, token)
        self.store.put_meta(_unit_key(unit), json.dumps({"worker": worker_id, "token": token}).encode())
        log.info("range %s/%d: %s -> %s (token %d)", unit[0], unit[1], old, worker_id, token)

    def owns(self, worker_id: str, unit: Unit, token: int) -> bool:
        owner = self.units.get(unit)
        return owner is not None and owner.worker_id == worker_id and owner.token == token
