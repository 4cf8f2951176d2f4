"""RescaleComputation: change a running computation's key-range count.

Routing stays :func:`millwheel.keys.key_range` (``crc32(key) mod N``): every process
already agrees on it, and the senders route each outbox entry at send time from the
registry they hold (services/worker/send.py), so a new N needs no change of the wire or
the stores. Consistent key groups (Flink's) would make a split move fewer keys, but a
rescale here copies a computation's data once under its fence either way, and a fixed
group count would cap N for good; the cost is that most keys change range.

How it is exactly once. Decisions and the fence are made under the registry's and the
controller's locks; the copies are made without them (issue 22: a copy of 100k keys
took 35-46 s, during which no heartbeat was answered), on the calling RPC's thread:

1. *under the locks*: every range of the computation gets a fresh token for *nobody*
   (:meth:`~services.controller.assign.Assigner.move_now` with None): from that store
   write on, whatever a worker was running there is fenced (its checkpoints, acks,
   watermark reports); a batch it had not checkpointed is still in its producers'
   outboxes and is delivered again later, to the key's new range. The computation is
   put in ``Assigner.frozen`` (its ranges placed nowhere, not even re-issued) and in
   ``Assigner.rescaling`` (``copying``: a second rescale, an update or an
   unregistration of it is refused with FAILED_PRECONDITION, a savepoint's cut waits);
   the journal entry ``rescale/NAME`` says ``staging``;
2. **stage**, *off the locks*: the data is copied by key into a staging node
   ``rescale:NAME`` laid out with N ranges (millwheel/savepoint/repartition.py): state
   and timers by key, the computation's own pending productions kept once, its
   consumed IDs once (services/controller/rescale_journal.py);
3. **commit**, *under the locks*: the journal entry says ``commit`` (one store write):
   from here on the new layout is the outcome (the registry's range total is checked
   again first: a registration made during the copy may have used the room);
4. **apply**, *off the locks*: the computation's ranges (old and new numbers) are
   cleared and the staged data copied in, every consumed ID into every range; new
   range numbers get the old ranges' least watermark;
5. *under the locks*: the registry is stored with ``key_ranges`` N and version + 1 (one
   write), the journal says ``cleanup``; the computation leaves ``frozen``: the
   assigner makes units for the new ranges and places them (the pause ends here);
6. *off the locks*: the staging node is cleared, the journal entry deleted; then the
   computation leaves ``rescaling`` and the call returns.

Between these steps every other computation's ranges move, heartbeats are answered and
the console reads, as always: the locks are held for the decisions and a few store
writes (one token per old range in 1, one write in 3, two in 5), not for the copies.

A controller killed anywhere ends in one layout: before 3, the new leader
(:func:`~services.controller.rescale_journal.recover`, run before it assigns anything)
deletes the staged data and the old layout runs on, untouched (it was only read); from
3 on, it redoes 4-5 from the staged data, which stays whole until the registry names the
new layout. Every range is assigned to nobody from 1 until 5 (a new leader finds the
tokens moved and places the ranges only after ``recover``), so no worker runs a mix.

Watermarks: a range's stored watermark only rises, so a range that keeps its number
keeps its stored value, and new numbers get the least of the old ranges' (``W``, what
the computation's watermark was). A key moved into a range whose value was above
``W`` may bring pending work older than that value (a timer, a production), so the
controller counts every range of the computation as ``W`` until its new owner's own
report reaches what is stored (:meth:`~services.controller.watermarks.Watermarks.hold`).
Every moved item is at least ``W`` (each old range's watermark bounded its pending
work), so the computation's watermark neither goes back nor passes pending work. The
hold is the leader's memory: a controller change in the seconds before the new owners
report ends it early (stated in docs/service.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc

from millwheel.errors import InvalidSpecError, ResourceLimitError
from millwheel.limits import MAX_KEY_RANGES, MAX_TOTAL_KEY_RANGES
from millwheel.nodes import NodeKind, kind_of
from millwheel.topology import ComputationSpec

from ..generated import millwheel_pb2 as pb
from ..rpc.server import check
from ..rpc.status import PreconditionError, UnavailableError
from . import rescale_journal as rj
from . import views
from .assign import Assigner
from .plane import ControlPlane
from .registry import Registry
from .rescale_journal import CLEANUP, COPYING, JOURNAL, crash, journal, tokens

log = logging.getLogger("millwheel.controller")

MOVING_WAIT_S = 30.0  #: how long a rescale waits for moves of its ranges under way


@dataclass
class _Plan:
    """A rescale fenced (step 1), carried through the steps made off the locks."""

    spec: ComputationSpec
    n: int
    entry: dict[str, Any]
    known: dict[tuple[str, int], int]  # the tokens it holds (its ranges', the staging node's)
    assigner: Assigner  # the one it fenced in (a new election makes another)
    started: float

    @property
    def name(self) -> str:
        return self.spec.name


class Rescaling:
    """The RescaleComputation RPC, on the plane it is constructed with; and, on election,
    the finishing of a rescale cut short (:meth:`finish_interrupted`, handed to the
    leadership part as a callback)."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def finish_interrupted(self, registry: Registry) -> None:
        """On election, before anything is assigned (services/controller/ha.py)."""
        if self.plane.store.list_meta(JOURNAL):
            rj.recover(self.plane.store, registry, self.plane.wms)

    def rescale(self, request: Any, context: grpc.ServicerContext) -> pb.RescaleComputationResponse:
        check(request)
        name, n = request.computation, request.key_ranges
        if not 1 <= n <= MAX_KEY_RANGES:
            raise InvalidSpecError(f"RescaleComputation: key_ranges {n} is outside 1..{MAX_KEY_RANGES}")
        p = self.plane
        deadline = time.monotonic() + MOVING_WAIT_S
        while True:
            with p.registry.changing, p.lock:
                if name in p.assigner.rescaling:
                    raise PreconditionError(
                        f"rescale of {name[:200]!r}: a rescale of {name[:200]!r} is under way (its "
                        f"{p.assigner.rescaling[name]} phase); nothing changed: send this again once it is done")
                spec = self._rescalable(name, n)
                old = spec.options.key_ranges
                if old == n:  # sent again after a lost answer, or nothing to do
                    return pb.RescaleComputationResponse(computation=views.info(p, name), previous_key_ranges=old,
                                                         changed=False)
                if not any(u[0] == name for u in p.assigner.moving):
                    plan = self._fence(spec, n)
                    break
            if time.monotonic() > deadline:  # a move's token is being acquired off the lock
                raise UnavailableError(f"rescale of {name!r}: moves of its key ranges still under way after "
                                       f"{MOVING_WAIT_S:.0f} s (the store is slow?); nothing changed, try again")
            time.sleep(0.05)
        return self._rescale(plan)

    def _rescalable(self, name: str, n: int) -> ComputationSpec:
        """The computation, or why it cannot be rescaled (nothing changed). A rescale of
        it that failed after its commit (the store failing) is completed first."""
        registry = self.plane.registry
        if kind_of(name) is NodeKind.INJECTOR or registry.injector(name) is not None:
            raise PreconditionError(f"rescale of {name[:200]!r}: an injector has one key range (range 0) "
                                    "and cannot be rescaled; rescale the computations it feeds")
        spec = registry.computation(name)  # NOT_FOUND
        raw = self.plane.store.get_meta(JOURNAL + name)
        if raw is not None:
            self._finish(name, json.loads(raw))
            spec = self.plane.registry.computation(name)
        self._room(spec, n)
        return spec

    def _room(self, spec: ComputationSpec, n: int) -> None:
        total = sum(self.plane.registry.nodes().values()) - spec.options.key_ranges + n
        if total > MAX_TOTAL_KEY_RANGES:
            raise ResourceLimitError(f"rescale of {spec.name!r} to {n} key ranges: {total} in the registry in "
                                     f"all, over the limit of {MAX_TOTAL_KEY_RANGES} (nothing changed)")

    def _finish(self, name: str, entry: dict[str, Any]) -> None:
        """Complete (committed) or undo (staged) a rescale of ``name`` cut short by a
        store failure, then place its ranges again (the caller holds both locks: the
        rare path of a store that failed under a rescale)."""
        p = self.plane
        token = tokens(p.store, {})
        if entry.get("phase") == "staging":
            rj.drop_stage(p.store, name, entry, token)
        else:
            rj.apply(p.store, p.registry, name, entry, token)
        p.assigner.frozen.discard(name)
        p.registry_changed()

    def _fence(self, spec: ComputationSpec, n: int) -> _Plan:
        """Step 1 (the caller holds both locks)."""
        name, a = spec.name, self.plane.assigner
        plan = _Plan(spec, n, {"phase": "staging", "from": spec.options.key_ranges, "to": n,
                               "at_us": self.plane.clock.now_us(), "ids": "once"}, {}, a, time.monotonic())
        a.frozen.add(name)  # placed nowhere until done (also if a store call fails)
        a.rescaling[name] = COPYING
        try:
            for r in range(spec.options.key_ranges):  # nobody runs any of its ranges from here on
                plan.known[(name, r)] = a.move_now((name, r), None)
            journal(self.plane.store, name, plan.entry)
        except Exception:
            del a.rescaling[name]
            self._undo(plan)
            raise
        return plan

    def _undo(self, plan: _Plan) -> None:
        """Before the commit: the staged data dropped, the old layout placed again (the
        caller holds both locks, or nothing: then they are taken for the placing)."""
        p = self.plane
        try:
            rj.drop_stage(p.store, plan.name, plan.entry, tokens(p.store, plan.known))
        except Exception as again:  # the journal stays: undone by the next call or leader
            log.warning("rescale of %r: its undo failed (%s): its ranges wait for the next call", plan.name, again)
            return
        with p.registry.changing, p.lock:
            plan.assigner.frozen.discard(plan.name)
            p.registry_changed()

    def _rescale(self, plan: _Plan) -> pb.RescaleComputationResponse:
        """Steps 2-6 of the module docstring; the caller holds no lock."""
        name, old, n, a = plan.name, plan.spec.options.key_ranges, plan.n, plan.assigner
        p = self.plane
        store = p.store
        token = tokens(store, plan.known)
        at_us = int(plan.entry["at_us"])
        try:
            locks = contextlib.ExitStack()
            try:  # 2
                staged, floor = rj.stage(store, name, old, n, token, at_us)
                crash("rescale_staged")
                locks.enter_context(p.registry.changing)
                locks.enter_context(p.lock)  # held on into 3
                self._room(plan.spec, n)
            except Exception:  # the store failed (or no room) before the commit: the old layout stands
                with locks:
                    self._undo(plan)
                raise
            entry = {**plan.entry, "phase": "commit", "watermark": floor}
            try:
                with locks:
                    journal(store, name, entry)  # 3: the commit
                    crash("rescale_committed")
                ids = rj.apply_data(store, name, entry, token)  # 4
                with p.registry.changing, p.lock:  # 5
                    rj.apply_registry(p.registry, name, n)
                    entry = {**entry, "phase": "cleanup"}
                    journal(store, name, entry)
                    a.frozen.discard(name)
                    a.rescaling[name] = CLEANUP
                    if floor is not None:
                        p.wms.hold(name, floor, n)
                    p.registry_changed()  # the new ranges are placed
                    pause_us = int((time.monotonic() - plan.started) * 1e6)
            except Exception as exc:  # the journal says how far it got; the next call or leader goes on
                raise UnavailableError(f"rescale of {name!r} to {n} key ranges: the store failed at its commit "
                                       f"or after it ({exc}); its ranges run again once it is finished: send the "
                                       "rescale again (or the next controller finishes it at its election)") from exc
            try:  # 6
                rj.drop_stage(store, name, entry, token)
            except Exception as exc:  # the journal stays: the next rescale of it or the next leader clears it
                log.warning("rescale of %r done, but clearing its staging node failed: %s", name, exc)
        finally:
            with p.lock:
                a.rescaling.pop(name, None)
        log.warning("computation %r rescaled: %d -> %d key ranges (%d keys, %d timers, %d pending productions, "
                    "%d consumed IDs written); its ranges paused %.3f s", name, old, n, staged.keys,
                    staged.timers, staged.productions, ids, pause_us / 1e6)
        with p.lock:
            info = views.info(p, name)
        return pb.RescaleComputationResponse(
            computation=info, previous_key_ranges=old, changed=True, pause_us=pause_us,
            keys=staged.keys, timers=staged.timers, productions=staged.productions, consumed_ids=ids)

