"""UpdateComputation: change a running computation's code, params or options in place.

How the switch is exactly once. Under the controller's lock (no heartbeat is answered
meanwhile), after every check has passed (services/controller/compat.py):

1. every key range of the computation gets a fresh sequencer token, for the same owner
   (:meth:`~services.controller.assign.Assigner.reissue_now`: acquired at once, under
   the lock, where range moves acquire theirs off it). From that store write on, a
   batch the old code is still running on that range fails its checkpoint (fenced) and
   is not acked: its records are sent again;
2. under "drop", the open windows of each range are deleted (state and timers) in one
   checkpoint per range under the new token; under "flush", the same checkpoint also
   puts each open window's result, made by the old operator, in the range's outbox
   (services/controller/flush.py);
3. the registry is stored with the new spec, the computation's version + 1 and the old
   spec kept as the rollback target (none after a rollback) (one store write);
4. the lock is released: each owner's next heartbeat answer carries the new registry
   *and* the new token together (the registry is applied first), so the owner drops the
   range it ran under the old token and builds it again, from the store, with the new
   code (services/worker/service.py ``_apply``).

So each range switches at a checkpoint boundary: every checkpoint under the old token
was made by the old code, every one under the new token by the new; a record's effects
(state, timers, productions, its consumed ID) are in exactly one of them, and what was
checkpointed (state, timers, pending productions, consumed IDs) is what the new code
starts from. This is the machinery of a range moving between workers, which the crash
suites prove; a worker killed during the switch is the ordinary case of a move.

A crash of the controller between 1 and 3 leaves the old spec with the new tokens (the
update did not happen; the client saw no answer and may send it again); after 3, the
new spec: a new leader reassigns whatever tokens it finds (services/controller/assign.py).
Under "drop" and "flush", windows dropped or flushed in 2 stay so if the controller dies
before 3 (the old spec runs on without them; sending the update again finishes it).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from millwheel.errors import InvalidSpecError
from millwheel.state.protocol import Checkpoint
from millwheel.topology import ComputationSpec

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from ..rpc.server import check
from ..rpc.status import PreconditionError
from . import views
from .compat import WINDOW_TAGS, candidate, check_directive, code_modules, refuse_open_windows, window_change
from .flush import flush_windows, router
from .plane import ControlPlane
from .rescale_journal import check_not_copying

log = logging.getLogger("millwheel.controller")


class Updates:
    """The UpdateComputation RPC, on the plane it is constructed with."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def update(self, request: Any, context: grpc.ServicerContext) -> pb.UpdateComputationResponse:
        check(request)
        directive = check_directive(request.on_open_windows)
        if request.rollback and request.HasField("spec"):
            raise InvalidSpecError("UpdateComputation: give either 'spec' or 'rollback', not both")
        if not request.rollback and not request.HasField("spec"):
            raise InvalidSpecError("UpdateComputation: 'spec' (or 'rollback') is required")
        # The registry's lock first (as every registry change takes it): an update asked for
        # during a savepoint's cut waits for it (services/controller/savepoint.py).
        p = self.plane
        with p.registry.changing, p.lock:
            registry = p.registry
            if request.rollback:
                old = registry.computation(request.rollback)  # NOT_FOUND first
                new = registry.previous.get(old.name)
                if new is None:
                    raise PreconditionError(f"rollback of computation {old.name!r}: it has no previous "
                                            f"version (it is at version {registry.version_of(old.name)}, "
                                            "never updated since it was registered)")
            else:
                new = convert.spec_from_proto(request.spec)
                old = registry.computation(new.name)
            check_not_copying(p.assigner, old.name, "rollback" if request.rollback else "update")
            return self._update(old, new, directive, bool(request.rollback), request.reload)

    def _update(self, old: ComputationSpec, new: ComputationSpec, directive: str,
                rollback: bool, reload: bool = False) -> pb.UpdateComputationResponse:
        """Check, then switch (see the module docstring); the caller holds the lock."""
        p = self.plane
        registry, assigner, store = p.registry, p.assigner, p.store
        version = registry.version_of(old.name)
        topology, keyed = candidate(registry.topology, new, p.allow_code, registry.keyed.get(old.name))
        modules = code_modules(new)
        if reload and not modules:
            raise PreconditionError(
                f"reload of computation {new.name!r}: it names no user code (code {new.code.name!r} is "
                "built in, with no 'function' of the user's): there is nothing to load again")
        if new == old and not reload:  # sent again (a retry after a lost answer): nothing to do
            return pb.UpdateComputationResponse(computation=views.info(p, old.name),
                                                previous_version=version, changed=False,
                                                reload_modules=modules)
        if directive == "flush" and window_change(old, new) is not None:
            router(registry.topology, old)  # flush's own refusal, before anything changes
        refuse_open_windows(store, old, new, directive)  # early, before anything changes
        units = [(old.name, r) for r in range(old.options.key_ranges)]
        for unit in units:
            assigner.reissue_now(unit)  # 1: the old code's later checkpoints are fenced
        # Again with every range fenced: a window opened since the first look counts.
        change = refuse_open_windows(store, old, new, directive)
        dropped = flushed = 0
        if change is not None and directive == "flush":
            flushed = flush_windows(store, registry.topology, old, version, units,
                                    {u: assigner.units[u].token for u in units}, p.clock.now_us())
        elif change is not None:
            dropped = self._drop_windows(old, units)
        # 3. A rollback keeps no target of its own: rolling back twice (or a rollback sent
        # again after a lost answer) is refused rather than undoing the rollback.
        # A reload of the running spec keeps the rollback target it had (rolling back to
        # the same spec would only reload again).
        target = None if rollback else registry.previous.get(old.name) if new == old else old
        registry.replace_computation(new, topology, version + 1, target, keyed=keyed)
        p.registry_changed()
        log.info("computation %r %s: version %d -> %d%s", new.name,
                 "rolled back" if rollback else "reloaded" if new == old else "updated",
                 version, version + 1, f" ({dropped} open windows dropped: {change})" if dropped else
                 f" ({flushed} open windows flushed: {change})" if flushed else "")
        return pb.UpdateComputationResponse(computation=views.info(p, new.name), previous_version=version,
                                            changed=True, dropped_windows=dropped, flushed_windows=flushed,
                                            reload_modules=modules)

    def _drop_windows(self, spec: ComputationSpec, units: list[tuple[str, int]]) -> int:
        """Delete every open window of ``spec`` (a window_aggregate): its timers and the
        state of the keys holding them (that state is the windows alone), one fenced
        checkpoint per range under the token just issued."""
        dropped = 0
        p = self.plane
        for unit in units:
            timers = [t for t in p.store.read_timers(*unit) if t.tag.startswith(WINDOW_TAGS)]
            if not timers:
                continue
            dropped += sum(1 for t in timers if t.tag.startswith("end:"))
            p.store.checkpoint(Checkpoint(
                computation=unit[0], range_id=unit[1], token=p.assigner.units[unit].token,
                now_us=p.clock.now_us(), state_writes={t.key: None for t in timers},
                timer_clears=[(t.key, t.tag) for t in timers]))
        return dropped

