"""Backfill: recompute a computation's windows from the durable record log with Spark.

The input stream of the computation must be in the stream log (a sink, or listed in
``log_streams``). Backfill reads every logged record of its inputs, re-keys it with
the computation's key extractor, assigns it to windows exactly as the streaming stage
does, and computes every window that lies entirely inside ``[t_from, t_to)`` in one
Spark job. Results have the stage's output format and deterministic record IDs
derived from (computation, key, window), so writing them to a stream log twice adds
nothing the second time.

:func:`compare` sets the results beside what the streaming path emitted (its output
stream in the log; for a window corrected by late data, the last emission counts).
A difference usually means records the streaming path dropped as too late.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from millwheel.errors import InvalidSpecError
from millwheel.record import Record, derive_record_id
from millwheel.spark.aggregations import Aggregation, Group
from millwheel.spark.session import require_pyspark, run_job
from millwheel.state.protocol import StateStore
from millwheel.topology import ComputationSpec, Topology
from millwheel.windows import Windowing

WINDOWED_CODES = ("spark_aggregate", "window_aggregate")
PAGE = 10_000


@dataclass(frozen=True)
class WindowResult:
    key: str
    start: int
    end: int
    agg: str
    value: Any
    count: int

    def payload(self) -> dict[str, Any]:
        return {"key": self.key, "start": self.start, "end": self.end,
                "agg": self.agg, "value": self.value, "count": self.count}

    def to_record(self, computation: str) -> Record:
        rid = derive_record_id(computation, f"backfill\x1f{self.key}\x1f{self.start}", 0)
        return Record(self.key, json.dumps(self.payload()).encode(), self.end - 1, rid)


@dataclass
class Comparison:
    compared: int = 0
    missing_in_stream: list[WindowResult] = field(default_factory=list)
    missing_in_backfill: list[WindowResult] = field(default_factory=list)
    different: list[tuple[WindowResult, WindowResult]] = field(default_factory=list)  # (backfill, stream)

    @property
    def equal(self) -> bool:
        return not (self.missing_in_stream or self.missing_in_backfill or self.different)


def windowed_params(spec: ComputationSpec) -> tuple[Windowing, Aggregation, Mapping[str, Any]]:
    """The windowing and aggregation of a ``spark_aggregate``/``window_aggregate`` spec."""
    if spec.code.name not in WINDOWED_CODES:
        raise InvalidSpecError(
            f"computation {spec.name!r}: backfill needs a windowed aggregation "
            f"({' or '.join(WINDOWED_CODES)}), not {spec.code.name!r}"
        )
    p = dict(spec.code.params)
    if "size_us" not in p:
        raise InvalidSpecError(f"computation {spec.name!r}: code params lack 'size_us'")
    period = p.get("period_us")
    windowing = Windowing(int(p["size_us"]), int(period) if period else None)
    agg = Aggregation(str(p.get("aggregation", "count")), p.get("field"),
                      float(p.get("percentile", 0.5)), p.get("function"),
                      p=p.get("p"), k=p.get("k"), by=p.get("by"), operator=spec.code.name)
    return windowing, agg, p


def read_log(store: StateStore, stream: str) -> Iterator[tuple[int, Record]]:
    after = 0
    while True:
        page = store.read_log(stream, after, PAGE)
        yield from page
        if len(page) < PAGE:
            return
        after = page[-1][0]


def backfill(
    topology: Topology,
    computation: str,
    store: StateStore,
    t_from: int,
    t_to: int,
    *,
    master: str | None = None,
) -> list[WindowResult]:
    """Every window of ``computation`` inside ``[t_from, t_to)``, recomputed by Spark."""
    require_pyspark("millwheel backfill")
    if t_to <= t_from:
        raise InvalidSpecError(f"backfill: --to ({t_to}) must be after --from ({t_from})")
    spec = topology.computation(computation)
    windowing, agg, params = windowed_params(spec)
    logged = set(topology.logged_streams())
    groups: dict[tuple[str, int], list[tuple[int, Any]]] = {}
    for inp in spec.inputs:
        if inp.stream not in logged:
            raise InvalidSpecError(
                f"computation {computation!r}: input stream {inp.stream!r} is not in the stream "
                "log; add it to the topology's log_streams to backfill from it"
            )
        key_fn = inp.key_extractor.compile()
        for _seq, rec in read_log(store, inp.stream):
            if not t_from - windowing.size_us < rec.timestamp < t_to:
                continue
            starts = [s for s in windowing.assign(rec.timestamp)
                      if s >= t_from and windowing.end(s) <= t_to]
            if not starts:
                continue
            key, value = key_fn(rec), agg.extract(rec.value, rec.record_id)
            for start in starts:
                groups.setdefault((key, start), []).append((rec.timestamp, value))
    if not groups:
        return []
    group_list = [Group(k, s, windowing.end(s), recs) for (k, s), recs in groups.items()]
    values = run_job(lambda spark: agg.compute(spark, group_list),
                     master=params.get("master"), explicit_master=master, conf=params.get("spark_conf"))
    return sorted(
        (WindowResult(g.key, g.start, g.end, agg.label, values[(g.key, g.start)], len(g.records))
         for g in group_list if (g.key, g.start) in values),
        key=lambda r: (r.start, r.key),
    )


def streamed_results(
    topology: Topology, computation: str, store: StateStore, t_from: int, t_to: int
) -> dict[tuple[str, int], WindowResult]:
    """What the streaming path emitted for windows inside the range (last emission wins)."""
    spec = topology.computation(computation)
    output = str(dict(spec.code.params).get("output") or spec.outputs[0])
    if output not in topology.logged_streams():
        raise InvalidSpecError(
            f"computation {computation!r}: output stream {output!r} is not in the stream log; "
            "add it to log_streams (or make it a sink) to compare"
        )
    found: dict[tuple[str, int], WindowResult] = {}
    for _seq, rec in read_log(store, output):
        p = json.loads(rec.value)
        if p["start"] >= t_from and p["end"] <= t_to:
            found[(p["key"], p["start"])] = WindowResult(
                p["key"], p["start"], p["end"], p["agg"], p["value"], p["count"]
            )
    return found


def compare(results: list[WindowResult], streamed: Mapping[tuple[str, int], WindowResult]) -> Comparison:
    out = Comparison()
    mine = {(r.key, r.start): r for r in results}
    for k in sorted(set(mine) | set(streamed), key=lambda k: (k[1], k[0])):
        b, s = mine.get(k), streamed.get(k)
        if b is None:
            assert s is not None
            out.missing_in_backfill.append(s)
            continue
        if s is None:
            out.missing_in_stream.append(b)
            continue
        out.compared += 1
        if b.count != s.count or not _same(b.value, s.value):
            out.different.append((b, s))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return bool(a == b)
