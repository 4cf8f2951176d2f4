"""A small multi-stage topology and workload shared by the recovery tests.

    events --[parse: map, re-key by JSON field "user"]--> parsed
    parsed --[counts: window_aggregate, 10 s tumbling count]--> counts
    counts --[totals: RunningTotal, cumulative per key]--> totals (sink)
    counts is also a sink (logged)

``RunningTotal`` makes double processing visible: a record counted twice changes
every later total of its key, not just one output.
"""

from __future__ import annotations

import json
import random
from typing import Any

from millwheel.computation import Computation, Context
from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.sources import ListSource
from millwheel.state.protocol import StateStore
from millwheel.topology import (
    CodeRef,
    ComputationSpec,
    InjectorSpec,
    InputSpec,
    Options,
    Topology,
)

SECOND = 1_000_000


class RunningTotal(Computation):
    def process_record(self, ctx: Context, record: Record) -> None:
        window = json.loads(record.value)
        total = int(ctx.state or b"0") + int(window["count"])
        ctx.set_state(str(total).encode())
        ctx.produce(
            "totals", ctx.key, json.dumps({"through": window["end"], "total": total}).encode(), record.timestamp
        )


def topology(options: Options | None = None, key_ranges: int = 3) -> Topology:
    opts = options or Options(key_ranges=key_ranges)
    return Topology(
        computations=(
            ComputationSpec(
                "parse", (InputSpec("events"),), ("parsed",), CodeRef("map", {"key": "json['user']"}), opts
            ),
            ComputationSpec(
                "counts",
                (InputSpec("parsed"),),
                ("counts",),
                CodeRef("window_aggregate", {"size_us": 10 * SECOND}),
                opts,
            ),
            ComputationSpec(
                "totals", (InputSpec("counts"),), ("totals",), CodeRef("tests.support.pipelines:RunningTotal"), opts
            ),
        ),
        injectors=(InjectorSpec("events", "events"),),
        log_streams=("counts",),
    )


def workload(n: int = 1500, users: int = 12, seed: int = 3, disorder_us: int = 2 * SECOND) -> list[Record]:
    """Events one user each, ~20 per second of event time, bounded disorder."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        ts = 1_000 * SECOND + i * 50_000
        items.append((ts + rng.randrange(disorder_us), ts, f"u{rng.randrange(users)}"))
    items.sort()
    return [
        Record("raw", json.dumps({"user": u, "n": i}).encode(), ts, f"ev-{i}") for i, (_o, ts, u) in enumerate(items)
    ]


def sources(records: list[Record], disorder_us: int = 2 * SECOND) -> dict[str, Any]:
    return {"events": ListSource(records, disorder_us)}


def outputs(
    store: StateStore, streams: tuple[str, ...] = ("counts", "totals")
) -> dict[str, list[tuple[str, bytes, int, str]]]:
    """Each sink stream's records as sorted (key, value, timestamp, id) tuples."""
    return {
        s: sorted((r.key, r.value, r.timestamp, r.record_id) for _seq, r in store.read_log(s, 0, 10**9))
        for s in streams
    }


def final_state(store: StateStore, computation: str) -> dict[str, bytes]:
    keys = store.list_keys(computation, None, 10**6)
    return store.read_state(computation, keys)


def key_extractor(spec: str) -> KeyExtractor:
    return KeyExtractor(spec)
