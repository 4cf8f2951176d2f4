"""Why a node's low watermark is where it is: one line a person can act on.

A watermark that does not move is the question users of every stream processor ask
(an idle source, a stuck partition, one slow writer holding a whole stage back). The
controller knows the answer from what it already keeps, without a store call: each
range's stored watermark (services/controller/watermarks.py), the owners and their
failures, each range's pending count, the registry's edges and, for an injector fed by
writers, the writers' watermarks (services/controller/writers.py). The rule, in order:

1. done (+inf): nothing holds it;
2. a range that has not reported a watermark yet holds it at -inf: which, and why (no
   owner, its owner failing to build it, not taken yet);
3. otherwise the least range holds it; if that range is failing, that is the reason;
4. a computation range at its input watermark is held by its input: the upstream node
   with the least watermark (``millwheel watermark --why`` follows the chain);
5. a computation range below its input is held by its own pending work, as its owner
   names it (``WatermarkReport.held``, kept in memory by services/controller/watermarks.py):
   its earliest timer (time, key, tag) not yet fired, else its oldest production not yet
   acked downstream (time, key, stream, consumer); else the pending count;
6. an injector: its least live writer (parallel ingestion), else the records still in
   its least range's outbox, else its watermark as set (nothing has advanced it since;
   nothing injected yet at -inf).

The caller holds the plane's lock.
"""

from __future__ import annotations

from typing import Callable

from millwheel.errors import InvalidSpecError
from millwheel.nodes import NodeKind, kind_of, name_of
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, event_time

from .plane import ControlPlane

#: (writer, its watermark, seconds since it was heard) of an injector's least live writer
LeastWriter = Callable[[str], "tuple[str, int, float] | None"]


def held_by(plane: ControlPlane, node: str, out: dict[str, int], inputs: dict[str, int],
            least_writer: LeastWriter | None = None) -> str:
    wm = out.get(node, MIN_TIMESTAMP)
    if wm >= MAX_TIMESTAMP:
        return ""
    ranges = plane.registry.nodes().get(node, 0)
    stored = plane.wms.of(node)
    assigner = plane.assigner
    def failing(r: int) -> str | None:
        owner = assigner.units.get((node, r))
        failure = plane.failing.of((node, r), owner)
        if owner is None or failure is None:
            return None
        return f"range {r} is failing on {owner.worker_id} ({failure.stage}): {failure.message[:200]}"

    for r in range(ranges):
        if r not in stored:
            owner = assigner.units.get((node, r))
            if owner is None or not owner.worker_id:
                return f"range {r} has no owner yet (no live worker may run it)"
            return failing(r) or f"range {r} has not reported a watermark yet (owner {owner.worker_id})"
    if not ranges:
        return "no key ranges"
    r = min(range(ranges), key=lambda i: stored[i])
    said = failing(r)
    if said is not None:
        return said
    pending = plane.pending.get((node, r), 0)
    if kind_of(node) is NodeKind.INJECTOR:
        writer = least_writer(name_of(node)) if least_writer is not None else None
        held = f"writer {writer[0]!r} at {event_time(writer[1])} (heard {writer[2]:.1f} s ago)" if writer else None
        if held is not None and writer is not None and writer[1] <= stored[r]:
            return held
        if pending:
            return f"range {r}: {pending} records in its outbox not yet taken by every consumer"
        if held is not None:
            return held
        if stored[r] <= MIN_TIMESTAMP:
            return "nothing injected yet: no Inject or writer has set its watermark"
        return (f"its watermark as set ({event_time(stored[r])}): nothing has advanced it further "
                "(Inject's watermark or done)")
    try:
        upstream = plane.registry.topology.upstream(node)
    except InvalidSpecError:
        upstream = []
    input_wm = inputs.get(node, MIN_TIMESTAMP)
    if stored[r] >= input_wm and upstream:
        least = min(upstream, key=lambda u: out.get(u, MIN_TIMESTAMP))
        return f"input: {least}"
    said = plane.wms.reason(node, r)
    if said:
        return f"range {r}: {said}" + (f" ({pending} productions pending)" if pending else "")
    what = f"{pending} pending" if pending else "timers not yet fired or productions not yet acked"
    return f"range {r}: its own pending work ({what})"

