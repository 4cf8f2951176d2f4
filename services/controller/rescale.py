"""RescaleComputation: change a running computation's key-range count.

Routing stays :func:`millwheel.keys.key_range` (``crc32(key) mod N``): every process
already agrees on it, and the senders route each outbox entry at send time from the
registry they hold (services/worker/send.py), so a new N needs no change of the wire or
the stores. Consistent key groups (Flink's) would make a split move fewer keys, but a
rescale here copies a computation's data once under its fence either way, and a fixed
group count would cap N for good; the cost is that most keys change range.

How it is exactly once. Under the registry's and the controller's locks (no heartbeat
is answered, no registration made, meanwhile):

1. every range of the computation gets a fresh token for *nobody*
   (:meth:`~services.controller.assign.Assigner.move_now` with None): from that store
   write on, whatever a worker was running there is fenced (its checkpoints, acks,
   watermark reports); a batch it had not checkpointed is still in its producers'
   outboxes and is delivered again later, to the key's new range;
2. **stage**: the journal entry ``rescale/NAME`` says ``staging``; the data is copied
   by key into a staging node ``rescale:NAME`` laid out with N ranges
   (millwheel/savepoint/repartition.py): state and timers by key, the computation's own
   pending productions kept once, every old range's consumed IDs into every new range;
3. **commit**: the journal entry says ``commit`` (one store write): from here on the
   new layout is the outcome;
4. **apply**: the computation's ranges (old and new numbers) are cleared and the staged
   data copied in; new range numbers get the old ranges' least watermark;
5. the registry is stored with ``key_ranges`` N and version + 1 (one write), the
   journal says ``cleanup``, the staging node is cleared, the journal entry deleted;
6. the locks are released: the assigner makes units for the new ranges and places them.

A controller killed anywhere ends in one layout: before 3, the new leader
(:func:`recover`, run before it assigns anything) deletes the staged data and the old
layout runs on, untouched (it was only read); from 3 on, it redoes 4-5 from the staged
data, which stays whole until the registry names the new layout. Every range is
assigned to nobody from 1 until the end (a new leader finds the tokens moved and places
the ranges only after :func:`recover`), so no worker runs a mix.

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

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

import grpc

from millwheel.clock import SystemClock
from millwheel.errors import InvalidSpecError, ResourceLimitError
from millwheel.limits import MAX_KEY_RANGES, MAX_TOTAL_KEY_RANGES
from millwheel.runtime.crash import crash_hook_from_env
from millwheel.savepoint import repartition
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, Topology

from ..generated import millwheel_pb2 as pb
from ..rpc.server import check
from ..rpc.status import PreconditionError, UnavailableError, rpc
from .assign import Assigner
from .ha import leader_only
from .registry import Registry
from .watermarks import Watermarks

log = logging.getLogger("millwheel.controller")

JOURNAL = "rescale/"  #: metadata: rescale/NAME -> the rescale under way (JSON)
STAGE = "rescale:"  #: the staging node's prefix (names never hold ':')
MOVING_WAIT_S = 30.0  #: how long a rescale waits for moves of its ranges under way
#: ``MILLWHEEL_CRASH_AT=rescale_staged|rescale_committed|rescale_copied``: the controller
#: kills itself -9 there (the crash tests); nothing otherwise.
crash = crash_hook_from_env()


def _tokens(store: StateStore, known: dict[tuple[str, int], int]) -> Callable[[str, int], int]:
    """A token per range, acquired once (fencing whoever wrote there before)."""
    def token(node: str, r: int) -> int:
        if (node, r) not in known:
            known[(node, r)] = store.acquire(node, r)
        return known[(node, r)]
    return token


def _journal(store: StateStore, name: str, entry: dict[str, Any] | None) -> None:
    store.put_meta(JOURNAL + name, None if entry is None else json.dumps(entry).encode())


def _resized(spec: ComputationSpec, n: int) -> ComputationSpec:
    return dataclasses.replace(spec, options=dataclasses.replace(spec.options, key_ranges=n))


def apply(store: StateStore, registry: Registry, name: str, entry: dict[str, Any],
          token: Callable[[str, int], int]) -> repartition.Moved:
    """Steps 4-5 of the module docstring, from a committed journal ``entry`` (redone
    whole by :func:`recover` after a crash: each step may run again)."""
    old, n, at_us = int(entry["from"]), int(entry["to"]), int(entry["at_us"])
    moved = repartition.Moved()
    if entry["phase"] == "commit":
        repartition.clear(store, name, range(max(old, n)), (old, n), token, at_us)
        moved = repartition.copy(store, STAGE + name, n, name, n, token, at_us, spread_ids=False)
        crash("rescale_copied")
        if entry.get("watermark") is not None:
            for r in range(old, n):
                store.report_watermark(name, r, token(name, r), int(entry["watermark"]))
        spec = registry.computation(name)
        if spec.options.key_ranges != n:
            new = _resized(spec, n)
            topology = Topology(tuple(new if c.name == name else c for c in registry.topology.computations),
                                registry.topology.injectors, registry.topology.log_streams)
            prev = registry.previous.get(name)  # a rollback target keeps working: same ranges
            registry.replace_computation(new, topology, registry.version_of(name) + 1,
                                         None if prev is None else _resized(prev, n))
        entry = {**entry, "phase": "cleanup"}
        _journal(store, name, entry)
    repartition.clear(store, STAGE + name, range(n), (n,), token, at_us)
    _journal(store, name, None)
    return moved


def recover(store: StateStore, registry: Registry, wms: Watermarks) -> None:
    """Finish or undo a rescale a dead controller left (before anything is assigned):
    a staged one is dropped (the old layout stands), a committed one is completed."""
    for key, raw in sorted(store.list_meta(JOURNAL).items()):
        name = key[len(JOURNAL):]
        entry = json.loads(raw)
        token = _tokens(store, {})
        if entry.get("phase") == "staging":
            repartition.clear(store, STAGE + name, range(int(entry["to"])), (int(entry["to"]),),
                              token, int(entry["at_us"]))
            _journal(store, name, None)
            log.warning("rescale of %r cut short before its commit: undone (it keeps %s key ranges)",
                        name, entry["from"])
        else:
            apply(store, registry, name, entry, token)
            if entry.get("watermark") is not None:
                wms.hold(name, int(entry["watermark"]), int(entry["to"]))
            log.warning("rescale of %r cut short after its commit: completed (%s -> %s key ranges)",
                        name, entry["from"], entry["to"])


class Rescaling:
    """The RescaleComputation RPC (a mixin of ControllerService)."""

    store: StateStore
    registry: Registry
    assigner: Assigner
    lock: threading.RLock
    clock: SystemClock
    wms: Watermarks
    _registry_changed: Callable[[], None]
    _info: Callable[[str], pb.ComputationInfo]

    def _finish_interrupted(self, registry: Registry) -> None:
        """On election, before anything is assigned (services/controller/ha.py)."""
        if self.store.list_meta(JOURNAL):
            recover(self.store, registry, self.wms)

    @rpc
    @leader_only
    def RescaleComputation(self, request: Any, context: grpc.ServicerContext) -> pb.RescaleComputationResponse:
        check(request)
        name, n = request.computation, request.key_ranges
        if not 1 <= n <= MAX_KEY_RANGES:
            raise InvalidSpecError(f"RescaleComputation: key_ranges {n} is outside 1..{MAX_KEY_RANGES}")
        deadline = time.monotonic() + MOVING_WAIT_S
        while True:
            with self.registry.changing, self.lock:
                spec = self._rescalable(name, n)
                old = spec.options.key_ranges
                if old == n:  # sent again after a lost answer, or nothing to do
                    return pb.RescaleComputationResponse(computation=self._info(name), previous_key_ranges=old,
                                                         changed=False)
                if not any(u[0] == name for u in self.assigner.moving):
                    return self._rescale(spec, n)
            if time.monotonic() > deadline:  # a move's token is being acquired off the lock
                raise UnavailableError(f"rescale of {name!r}: moves of its key ranges still under way after "
                                       f"{MOVING_WAIT_S:.0f} s (the store is slow?); nothing changed, try again")
            time.sleep(0.05)

    def _rescalable(self, name: str, n: int) -> ComputationSpec:
        """The computation, or why it cannot be rescaled (nothing changed). A rescale of
        it that failed after its commit (the store failing) is completed first."""
        if name.startswith("injector:") or self.registry.injector(name) is not None:
            raise PreconditionError(f"rescale of {name[:200]!r}: an injector has one key range (range 0) "
                                    "and cannot be rescaled; rescale the computations it feeds")
        spec = self.registry.computation(name)  # NOT_FOUND
        raw = self.store.get_meta(JOURNAL + name)
        if raw is not None:
            self._finish(name, json.loads(raw))
            spec = self.registry.computation(name)
        total = sum(self.registry.nodes().values()) - spec.options.key_ranges + n
        if total > MAX_TOTAL_KEY_RANGES:
            raise ResourceLimitError(f"rescale of {name!r} to {n} key ranges: {total} in the registry in all, "
                                     f"over the limit of {MAX_TOTAL_KEY_RANGES} (nothing changed)")
        return spec

    def _finish(self, name: str, entry: dict[str, Any]) -> None:
        """Complete (committed) or undo (staged) a rescale of ``name`` cut short by a
        store failure, then place its ranges again."""
        token = _tokens(self.store, {})
        if entry.get("phase") == "staging":
            repartition.clear(self.store, STAGE + name, range(int(entry["to"])), (int(entry["to"]),),
                              token, int(entry["at_us"]))
            _journal(self.store, name, None)
        else:
            apply(self.store, self.registry, name, entry, token)
        self.assigner.frozen.discard(name)
        self._registry_changed()

    def _rescale(self, spec: ComputationSpec, n: int) -> pb.RescaleComputationResponse:
        """Steps 1-6 of the module docstring; the caller holds both locks."""
        started = time.monotonic()
        name, old = spec.name, spec.options.key_ranges
        known: dict[tuple[str, int], int] = {}
        self.assigner.frozen.add(name)  # placed nowhere until done (also if a store call fails)
        entry: dict[str, Any] = {"phase": "staging", "from": old, "to": n, "at_us": self.clock.now_us()}
        try:
            for r in range(old):  # 1: nobody runs any of its ranges from here on
                known[(name, r)] = self.assigner.move_now((name, r), None)
            token = _tokens(self.store, known)
            at_us = entry["at_us"]
            _journal(self.store, name, entry)
            stage = STAGE + name
            repartition.clear(self.store, stage, range(n), (n,), token, at_us)  # left by an earlier attempt
            staged = repartition.copy(self.store, name, old, stage, n, token, at_us)  # 2
            wms = self.store.read_watermarks(name)
            floor = min(wms[r] for r in range(old)) if all(r in wms for r in range(old)) else None
            crash("rescale_staged")
        except Exception as exc:  # the store failed before the commit: the old layout stands
            try:
                self._finish(name, entry)
            except Exception as again:  # the journal stays: undone by the next call or leader
                log.warning("rescale of %r failed (%s); its undo failed too (%s): its ranges wait", name, exc, again)
            raise
        entry = {**entry, "phase": "commit", "watermark": floor}
        try:
            _journal(self.store, name, entry)  # 3: the commit
            crash("rescale_committed")
            apply(self.store, self.registry, name, entry, token)  # 4-5
        except Exception as exc:  # the journal says how far it got; the next call or leader goes on
            raise UnavailableError(f"rescale of {name!r} to {n} key ranges: the store failed at its commit or "
                                   f"after it ({exc}); its ranges run again once it is finished: send the "
                                   "rescale again (or the next controller finishes it at its election)") from exc
        self.assigner.frozen.discard(name)
        if floor is not None:
            self.wms.hold(name, floor, n)
        self._registry_changed()  # 6
        for w in self.assigner.workers.values():
            self.assigner.touch(w.worker_id)  # the lock held their heartbeats, not them
        pause_us = int((time.monotonic() - started) * 1e6)
        log.warning("computation %r rescaled: %d -> %d key ranges (%d keys, %d timers, %d pending productions, "
                    "%d consumed IDs written); its ranges paused %.3f s", name, old, n, staged.keys,
                    staged.timers, staged.productions, staged.ids, pause_us / 1e6)
        return pb.RescaleComputationResponse(
            computation=self._info(name), previous_key_ranges=old, changed=True, pause_us=pause_us,
            keys=staged.keys, timers=staged.timers, productions=staged.productions, consumed_ids=staged.ids)
