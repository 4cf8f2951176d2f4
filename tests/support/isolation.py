"""What the isolation tests (issue 22) share: a window count made slow to copy or to
read by ballast keys, next to a canary pipeline that must keep flowing meanwhile.

    events --[counts: window_aggregate, 2 s count, 2 ranges]--> counts (sink)
    pings  --[canary: map, "'pong:' + value", 2 ranges]--> pongs (sink)

Used by tests/integration/test_service_rescale_isolation.py (a rescale's copy) and
test_service_savepoint_isolation.py (a savepoint's read).
"""

from __future__ import annotations

from millwheel.keys import key_range
from millwheel.record import Record
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.controller.registry import Registry
from tests.support.tagged_counts import SECOND, count_spec


def topology() -> Topology:
    canary = ComputationSpec("canary", (InputSpec("pings"),), ("pongs",),
                             CodeRef("map", {"value": "'pong:' + value"}), Options(key_ranges=2))
    return Topology((count_spec(stream="events"), canary),
                    (InjectorSpec("events", "events"), InjectorSpec("pings", "pings")), ("counts", "pongs"))


def pings() -> list[Record]:
    """The canary's records: 3,000, on 7 keys, in event time far after the events'."""
    return [Record(f"p{i % 7}", f"{i}".encode(), 2_000 * SECOND + i * 1000, f"ping{i}") for i in range(3000)]


def write_ballast(url: str, topo: Topology, keys: int, chunk: int) -> None:
    """``topo`` registered and ``keys`` keys of counts written (state and as many
    consumed IDs, no timers, so no output of theirs), ``chunk`` keys a checkpoint,
    before any process runs: what makes the copy or the read last seconds."""
    store = open_store(url)
    try:
        Registry(store).register_topology(list(topo.computations), list(topo.injectors), list(topo.log_streams))
        by_range: dict[int, list[str]] = {}
        for i in range(keys):
            k = f"ballast-{i:06d}"
            by_range.setdefault(key_range(k, 2), []).append(k)
        for r, names in by_range.items():
            token = store.acquire("counts", r)
            for j in range(0, len(names), chunk):
                part = names[j:j + chunk]
                store.checkpoint(Checkpoint("counts", r, token, 1, state_writes={k: b"x" * 64 for k in part},
                                            consumed_ids=[f"ballast-id-{k}" for k in part]))
    finally:
        store.close()
