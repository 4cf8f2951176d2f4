"""The pipeline the day-2 operation tests run (savepoints, drain, rescale, update) and
its records, in one place so that each test states only how its run differs.

    events --[tag: map, "'t:' + value", 3 ranges]--> tagged
    tagged --[counts: window_aggregate, 2 s tumbling count, 2 ranges]--> counts (sink)

Records: ``k0``..``k{keys-1}`` in turn, one every 50 ms of event time from ``T0``, each
with its own ID, so a window's count shows a record lost or counted twice.
"""

from __future__ import annotations

import json
from typing import Any

from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology

SECOND = 1_000_000
WINDOW = 2 * SECOND
T0 = 1_000 * SECOND


def tag_spec(tag: str = "t", key_ranges: int = 3) -> ComputationSpec:
    """``tag``: prefixes every value with ``tag:`` (update tests switch it by version)."""
    return ComputationSpec("tag", (InputSpec("events"),), ("tagged",),
                           CodeRef("map", {"value": f"'{tag}:' + value"}), Options(key_ranges=key_ranges))


def count_spec(size_us: int = WINDOW, stream: str = "tagged") -> ComputationSpec:
    """``counts``: a tumbling window count of ``stream``."""
    return ComputationSpec("counts", (InputSpec(stream),), ("counts",),
                           CodeRef("window_aggregate", {"size_us": size_us, "aggregation": "count"}),
                           Options(key_ranges=2))


def topology(extra: tuple[ComputationSpec, ...] = (), tag: str = "t",
             log_streams: tuple[str, ...] = ("counts",)) -> Topology:
    """tag -> counts fed by the ``events`` injector, with ``extra`` computations after them."""
    return Topology((tag_spec(tag), count_spec(), *extra), (InjectorSpec("events", "events"),), log_streams)


def records(n: int, keys: int = 7) -> list[Record]:
    return [Record(f"k{i % keys}", f"r{i}".encode(), T0 + i * 50_000, f"id{i}") for i in range(n)]


def counted(client: Any, keys: int = 7) -> int:
    """Records ``counts`` has taken so far: the counts of its open windows (each key's
    state) plus those of the windows it closed (its log stream). Equal to the records
    injected once none is in flight any more, which an update or rescale that drops
    open windows must wait for: a record still in flight is counted by the new version."""
    open_ = sum(v[0] for k in range(keys)
                for v in json.loads(client.state("counts", f"k{k}").state or b"{}").values())
    closed = sum(json.loads(r.value)["count"] for _seq, r in client.subscribe("counts"))
    return open_ + closed
