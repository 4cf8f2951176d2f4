"""``--on-open-windows flush``: an update's open windows fired with the old parameters.

When a built-in ``window_aggregate``'s size or period changes (or it becomes other code)
while windows are open (services/controller/compat.py), "flush" emits each open window's
result as the old operator's end timer would produce it, from the records the window
holds at the switch, then deletes the window (its state and timers), so the new code
starts with no window of the old shape.

**Partial results, on purpose.** A window whose end the watermark has not passed gets
an early, partial result: the records it holds so far, stamped ``end - 1`` with the old
end. The alternative, waiting for the watermark to pass each open window's end, would
need the old code to keep running for those windows beside the new code for new
records (two versions of one key's state at once), or the update to wait for windows
that new records keep opening. A partial result is the window semantic's own answer for
"the window closes now", and a record arriving later for such a window goes to the new
windows (it is counted once, in a new-parameter window).

**Exactly once.** The controller does it (the worker never runs both versions), under
its lock, after every range of the computation got its fresh token
(services/controller/update.py step 1): for each range one checkpoint under that token
deletes the windows' state and timers and puts their results in the range's outbox
(pending productions), atomically. The new owner sends them on as any pending
production (consumers and logs deduplicate by record ID, which is derived from the
window, so a resend is dropped); a worker killed meanwhile is a range move. The results
hold the computation's watermark at their timestamps as any pending production does,
and are never late downstream: an open window's end timer held it there.

The controller never imports user code, so it routes the results itself only when every
consumer of the output stream keys them by ``key`` or ``json:FIELD``; a consumer keying
by an ``import:`` function makes "flush" FAILED_PRECONDITION before anything changes.
"""

from __future__ import annotations

from millwheel.operators.aggregate import WindowedAggregate
from millwheel.operators.buildable import bound_outputs, with_defaults
from millwheel.record import derive_record_id
from millwheel.runtime.routing import Router, record_of
from millwheel.state.protocol import Checkpoint, StateStore
from millwheel.topology import ComputationSpec, Topology

from ..rpc.status import PreconditionError
from .compat import WINDOW_TAGS


def operator(spec: ComputationSpec) -> WindowedAggregate:
    """The old computation's operator, built as a worker builds it (a built-in: nothing
    imported)."""
    op = WindowedAggregate(**with_defaults(spec, spec.code.params))
    op.bind_outputs(bound_outputs(spec))
    return op


def router(topology: Topology, spec: ComputationSpec) -> tuple[Router, str]:
    """A router for the window results of ``spec`` (and their stream), over the consumers
    of that stream alone; PreconditionError if one keys them by user code."""
    stream = operator(spec).output
    assert stream is not None
    consumers = tuple(c for c in topology.computations if any(i.stream == stream for i in c.inputs))
    for c in consumers:
        for inp in c.inputs:
            if inp.stream == stream and inp.key_extractor.import_paths():
                raise PreconditionError(
                    f"update of computation {spec.name!r}: on_open_windows 'flush' routes the open "
                    f"windows' results itself, and computation {c.name!r} keys stream {stream!r} by "
                    f"user code ({inp.key_extractor.spec[:200]!r}), which the controller never runs; "
                    "use 'drop', or update once the windows have closed")
    logged = tuple(s for s in topology.logged_streams() if s == stream)
    return Router(Topology(consumers, (), logged)), stream


def flush_windows(store: StateStore, topology: Topology, spec: ComputationSpec, version: int,
                  units: list[tuple[str, int]], token_of: dict[tuple[str, int], int], now_us: int) -> int:
    """Fire every open window of ``spec`` (the old window_aggregate) into its outbox and
    delete its windows: one checkpoint per range under ``token_of[unit]``. Returns how
    many windows produced a result."""
    op = operator(spec)
    route, stream = router(topology, spec)
    flushed = 0
    for unit in units:
        timers = [t for t in store.read_timers(*unit) if t.tag.startswith(WINDOW_TAGS)]
        if not timers:
            continue
        keys = sorted({t.key for t in timers})
        states = store.read_state(unit[0], keys)
        productions = []
        for key in keys:
            for start, value, ts in op.unfired_results(key, states.get(key)):
                # Derived from the window and the version it closes: the same on any retry.
                rid = derive_record_id(spec.name, f"flush\x1f{version}\x1f{key}\x1f{start}", 0)
                productions.extend(route.fan_out(stream, record_of(key, value, ts, rid)))
                flushed += 1
        store.checkpoint(Checkpoint(
            computation=unit[0], range_id=unit[1], token=token_of[unit], now_us=now_us,
            state_writes={k: None for k in keys}, timer_clears=[(t.key, t.tag) for t in timers],
            productions=productions))
    return flushed
