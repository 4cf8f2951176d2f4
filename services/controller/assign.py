"""Key-range assignment: which live worker owns each range, under which token.

Every range of every node (computation ranges, and one per injector) is a unit. A
move acquires a fresh sequencer token from the store *before* the new owner hears of
it, so the previous owner (dead, draining, or a zombie that was only paused) has every
later write fenced. Assignments and worker addresses are persisted in the store's
metadata, so a restarted controller keeps the current owners (and gives them one
heartbeat timeout to check in) instead of moving everything.

Decisions are taken under the controller's lock, store calls are not (issue 21, item 4):
with ``work`` (services/controller/store_work.py) a move is *planned* (``moving``), its
token acquired on a store-work thread, and the decision re-checked under the lock
before it is applied; records of workers and assignments are written the same way. A
move whose shard is away delays that range alone. Without ``work`` (a unit test, a
standby's read-only view) every store call is made at once, in the caller.
"""

from __future__ import annotations

import bisect
import json
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from millwheel.state.protocol import StateStore

from .store_work import StoreWork

log = logging.getLogger("millwheel.controller")

ASSIGN_PREFIX = "assign/"
WORKER_PREFIX = "worker/"
#: Set by a stop with savepoint (services/controller/savepoint.py): no range is assigned any more.
STOPPED_KEY = "savepoint/stopped"
DRAINING_KEY = "savepoint/draining"
Unit = tuple[str, int]


@dataclass
class WorkerState:
    worker_id: str
    address: str
    metrics_address: str = ""
    ingest_address: str = ""  # where writers send records (services/worker/ingest.py); "" from older workers
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
                 check_tokens: bool = True, work: StoreWork | None = None,
                 lock: threading.RLock | None = None) -> None:
        """Load the assignment from the store (reads only: call it outside the lock). The
        workers found there get ``max(timeout_s, grace_s)`` to heartbeat before they are
        declared dead: a new leader keeps the assignment its workers report instead of
        moving every range. ``check_tokens`` False: a standby's read-only view (no token
        read per range). ``work`` and ``lock``: store calls made off the controller's
        ``lock`` (the module docstring)."""
        self.store = store
        self.timeout_s = timeout_s
        self.work = work
        self.lock = lock or threading.RLock()
        self.workers: dict[str, WorkerState] = {}
        self.units: dict[Unit, Owner] = {}
        # The owners table's versions (what incremental heartbeats are answered against):
        # each change of a unit's owner, token or owner's address is one version, the unit
        # logged under it; ``epoch`` names this table (a new leader builds a new one).
        self.epoch = random.getrandbits(63) or 1
        self.version = 0
        self._log: list[Unit] = []  # the unit changed at version _log_base + 1 + index
        self._log_base = 0
        self.moving: dict[Unit, str | None] = {}  # planned moves whose token is being acquired
        self.due = False  # a move failed or no longer held: rebalance at the reaper's next pass
        self.stopped = store.get_meta(STOPPED_KEY) is not None
        # Draining (services/controller/drain.py): Inject refused, ranges still run.
        self.draining = store.get_meta(DRAINING_KEY) is not None
        self.frozen: set[str] = set()  # computations being rescaled: their ranges are placed nowhere
        # Rescales under way on this leader (services/controller/rescale.py): computation ->
        # "copying" (its data moves off the lock; its tokens are the rescale's) or "cleanup".
        self.rescaling: dict[str, str] = {}
        # Ranges a savepoint's cut is reading (services/controller/savepoint.py): fenced for
        # nobody, placed nowhere and not re-issued until the cut places them again. Memory
        # only: a new leader places them as usual (unless the stop is stored).
        self.held: set[Unit] = set()
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
            if w is not None and w.address != address:  # its ranges' address changed
                for unit in self.owned_by(worker_id):
                    self._changed(unit)
            w = self.workers[worker_id] = WorkerState(worker_id, address, metrics)
            record = json.dumps({"id": worker_id, "address": address, "metrics": metrics}).encode()
            self._later(("worker", worker_id), lambda: self.store.put_meta(WORKER_PREFIX + worker_id, record))
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
            self._later(("worker", wid), partial(self.store.put_meta, WORKER_PREFIX + wid, None))

    # -- units -----------------------------------------------------------------------
    def sync_units(self, nodes: dict[str, int], tokens: dict[Unit, int] | None = None) -> None:
        """Make the unit set match the registry: one unit per range of every node.
        ``tokens``: current tokens of new units, read beforehand (outside the lock);
        a new unit without one has it read next, off the lock."""
        wanted = {(node, r) for node, count in nodes.items() for r in range(count)}
        for unit in [u for u in self.units if u not in wanted]:
            del self.units[unit]
            self.moving.pop(unit, None)
            self._changed(unit)
            self._later(("unit", unit), partial(self._drop, unit))
        for unit in sorted(wanted - set(self.units)):
            token = tokens.get(unit) if tokens else None
            self.units[unit] = Owner(None, token or 0)
            self._changed(unit)
            if token is None:  # its store token is read (or it is moved) next
                self._later(("unit", unit), partial(self._learn_token, unit))

    def owned_by(self, worker_id: str) -> list[Unit]:
        return [u for u, o in self.units.items() if o.worker_id == worker_id]

    def rebalance(self, limit: int | None = None) -> int:
        """Move units off dead and draining workers, and off workers that refuse to run
        their computation, and even out the rest; returns moves. A unit no live worker
        may run stays where it is. A unit being moved counts for its target. With
        ``limit``, stop after that many moves (the caller releases the controller's lock
        in between, and calls again). A service stopped with a savepoint runs nothing."""
        self.due = False
        if self.stopped:
            return 0
        live = sorted(w.worker_id for w in self.workers.values() if w.alive and not w.draining)
        counts = {wid: 0 for wid in live}
        orphans: list[Unit] = []
        moves = 0

        def may_run(wid: str, unit: Unit) -> bool:
            return unit[0] not in self.workers[wid].refuses

        for unit in sorted(self.units):
            if unit[0] in self.frozen or unit in self.held:  # a rescale's or a cut's: nobody's until done
                continue
            if unit in self.moving:  # counts for where it is going
                target = self.moving[unit]
                if target in counts:
                    counts[target] += 1
                continue
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
            if limit is not None and moves >= limit:
                self.due = True
                return moves
            able = [w for w in live if may_run(w, unit)] or live
            target = min(able, key=lambda wid: (counts[wid], wid))
            if target != self.units[unit].worker_id:
                self._move(unit, target)
                moves += 1
            counts[target] += 1
        owned: dict[str, list[Unit]] = {}  # sorted once per worker, kept up to date
        for unit, o in sorted(self.units.items()):
            if o.worker_id in counts and unit not in self.moving:
                owned.setdefault(o.worker_id, []).append(unit)
        while limit is None or moves < limit:
            hi = max(live, key=lambda wid: (counts[wid], wid))
            lo = min(live, key=lambda wid: (counts[wid], wid))
            if counts[hi] - counts[lo] <= 1:
                break
            mine = owned.get(hi, [])
            pick = next((i for i in range(len(mine) - 1, -1, -1) if may_run(lo, mine[i])), None)
            if pick is None:
                break  # what hi holds, lo may not run: as even as the allow-lists allow
            unit = mine.pop(pick)
            bisect.insort(owned.setdefault(lo, []), unit)
            self._move(unit, lo)
            counts[hi] -= 1
            counts[lo] += 1
            moves += 1
        if self.moving:  # moves still under way were left alone: look again once they land
            self.due = True
        return moves

    def reissue(self, unit: Unit) -> None:
        """A fresh token for the same owner (its old one was fenced by someone else); not
        for a range being rescaled (its tokens are the rescale's until it is done) or read by
        a savepoint's cut."""
        if unit in self.units and unit not in self.moving and unit[0] not in self.frozen \
                and unit not in self.held:
            self._move(unit, self.units[unit].worker_id)

    def reissue_now(self, unit: Unit) -> int:
        """A fresh token for the same owner, acquired here and now, the caller holding the
        lock; returns it. For the rare operations whose next step needs the new token
        in force (an update's window drop, a savepoint's cut): every write under the old
        one is fenced from here on. A move of the unit under way lands later, with a
        token newer still."""
        return self.move_now(unit, self.units[unit].worker_id)

    def move_now(self, unit: Unit, owner: str | None) -> int:
        """As :meth:`reissue_now`, to ``owner`` (None: nobody runs it, as a stop with a
        savepoint wants)."""
        token = self.store.acquire(*unit)
        self.units[unit] = Owner(owner, token)
        self._changed(unit)
        self.store.put_meta(_unit_key(unit), json.dumps({"worker": owner, "token": token}).encode())
        return token

    def release(self, previous: dict[Unit, str | None]) -> int:
        """A savepoint's cut is done (the caller holds the lock): its held ranges are
        placed again, each back on its ``previous`` owner while that worker is alive, not
        draining and willing to run it (a cut does not reshuffle the assignment); the rest
        by the usual rebalance. Returns the moves planned (their tokens are acquired off
        the lock, as any move's)."""
        units, self.held = self.held, set()
        moves = 0
        for unit in sorted(units):
            wid = previous.get(unit)
            w = self.workers.get(wid or "")
            if self.stopped or unit not in self.units or unit in self.moving or unit[0] in self.frozen \
                    or self.units[unit].worker_id is not None or w is None or not w.alive or w.draining \
                    or unit[0] in w.refuses:
                continue
            self._move(unit, wid)
            moves += 1
        return moves + self.rebalance()

    # -- store calls, made off the lock ----------------------------------------------
    def _later(self, key: tuple[str, Any], call: Callable[[], None]) -> None:
        """``call()`` now without ``work``; else on a store-work thread (after the key's
        earlier calls), its failure logged."""
        if self.work is None:
            call()
            return

        def logged() -> None:
            try:
                call()
            except Exception as exc:
                log.warning("store call for %s failed: %s", key, exc)
        self.work.submit(key, logged)

    def _move(self, unit: Unit, worker_id: str | None) -> None:
        """Plan a move; its token is acquired (and the decision applied) by :meth:`_acquire`."""
        self.moving[unit] = worker_id
        self._later(("unit", unit), lambda: self._acquire(unit, worker_id))

    def _acquire(self, unit: Unit, worker_id: str | None) -> None:
        """The store half of a move (outside the lock): acquire the fresh token, then under
        the lock check the decision still holds and apply it; the assignment record last."""
        try:
            token = self.store.acquire(*unit)
        except BaseException:
            with self.lock:
                if self.moving.get(unit, "") == worker_id:
                    del self.moving[unit]
                    self.due = True  # planned again at the reaper's next pass
            raise
        with self.lock:
            if self.moving.get(unit, "") == worker_id:
                del self.moving[unit]
            if unit not in self.units:  # unregistered meanwhile: the fresh token fences all
                return
            w = self.workers.get(worker_id or "")
            if worker_id is not None and (self.stopped or unit in self.held):  # a savepoint's meanwhile
                worker_id = None
            elif worker_id is not None and (w is None or not w.alive or w.draining):
                log.info("range %s/%d: %s left before its move completed; placed again",
                         unit[0], unit[1], worker_id)
                worker_id, self.due = None, True
            old = self.units[unit].worker_id
            self.units[unit] = Owner(worker_id, token)
            self._changed(unit)
        self.store.put_meta(_unit_key(unit), json.dumps({"worker": worker_id, "token": token}).encode())
        log.info("range %s/%d: %s -> %s (token %d)", unit[0], unit[1], old, worker_id, token)

    def _drop(self, unit: Unit) -> None:
        """The store half of removing a unit: fence whoever still runs it, forget its owner."""
        self.store.acquire(*unit)
        self.store.put_meta(_unit_key(unit), None)

    def _learn_token(self, unit: Unit) -> None:
        """A new unit's current token (shown while no worker owns it), unless moved meanwhile."""
        token = self.store.current_token(*unit)
        with self.lock:
            owner = self.units.get(unit)
            if owner is not None and owner.worker_id is None and unit not in self.moving \
                    and token > owner.token:
                owner.token = token
                self._changed(unit)

    def owns(self, worker_id: str, unit: Unit, token: int) -> bool:
        owner = self.units.get(unit)
        return owner is not None and owner.worker_id == worker_id and owner.token == token

    # -- versions of the owners table ------------------------------------------------
    def _changed(self, unit: Unit) -> None:
        """Call under the lock: one version of the owners table, ``unit`` changed in it."""
        self.version += 1
        self._log.append(unit)
        keep = max(4096, 2 * len(self.units))  # a few rebalances' worth; older: the whole table
        if len(self._log) > 2 * keep:
            cut = len(self._log) - keep
            del self._log[:cut]
            self._log_base += cut

    def changed_since(self, epoch: int, version: int) -> set[Unit] | None:
        """Units changed after ``version`` of table ``epoch``; None when that is not a
        version of this table the log still covers (the caller sends the whole table)."""
        if epoch != self.epoch or not self._log_base <= version <= self.version:
            return None
        return set(self._log[version - self._log_base:])
