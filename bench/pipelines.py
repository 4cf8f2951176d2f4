"""The two benchmark pipelines, their sources, and how their output is read back.

(a) ``single``: events --[count: window_aggregate 10 s tumbling, fired by event-time
    timers, late_policy drop]--> counts (sink)
(b) ``three``:  events (keyed by partition) --[parse: JSON -> re-key, framework dedup]-->
    parsed --[count: as in (a)]--> counts --[sink: format a row]--> rows (sink)

Sources replay a workload: :class:`BacklogSource` hands out everything at once (the
fixed backlog of the throughput figure); :class:`PacedSource` releases record ``i``
at ``t0 + i / rate`` of wall-clock time (the latency figures).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Iterable, Iterator, Sequence

from bench.workload import DISORDER_US, WINDOW_US
from millwheel.computation import Context
from millwheel.operators.aggregate import WindowedAggregate
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record
from millwheel.sources import SourceBatch
from millwheel.state.protocol import StateStore
from millwheel.topology import (
    CodeRef,
    ComputationSpec,
    InjectorSpec,
    InputSpec,
    LatePolicy,
    Options,
    Productions,
    Topology,
)

PARTITIONS = 64
PIPELINES = ("single", "three")


def options(exactly_once: bool = True, productions: str = "strong", key_ranges: int = 4,
            late_policy: LatePolicy = LatePolicy.PROCESS, state_ttl_us: int | None = None) -> Options:
    return Options(exactly_once=exactly_once, productions=Productions(productions),
                   late_policy=late_policy, key_ranges=key_ranges, state_ttl_us=state_ttl_us)


def topology(pipeline: str, *, exactly_once: bool = True, productions: str = "strong",
             key_ranges: int = 4, count_code: str = "window_aggregate",
             state_ttl_us: int | None = None) -> Topology:
    """``count_code`` may name a subclass of the built-in (the recovery probe);
    ``state_ttl_us`` is the count stage's state TTL (bench/cases/ttl.py)."""
    count_opts = options(exactly_once, productions, key_ranges, LatePolicy.DROP, state_ttl_us)
    count_params = {"size_us": WINDOW_US}
    if pipeline == "single":
        return Topology(
            computations=(ComputationSpec("count", (InputSpec("events"),), ("counts",),
                                          CodeRef(count_code, count_params), count_opts),),
            injectors=(InjectorSpec("events", "events"),),
        )
    if pipeline != "three":
        raise ValueError(f"pipeline must be one of {PIPELINES}, not {pipeline!r}")
    plain = options(exactly_once, productions, key_ranges)
    return Topology(
        computations=(
            ComputationSpec("parse", (InputSpec("events"),), ("parsed",),
                            CodeRef("map", {"function": "bench.pipelines:parse"}), plain),
            ComputationSpec("count", (InputSpec("parsed"),), ("counts",),
                            CodeRef(count_code, count_params), count_opts),
            ComputationSpec("sink", (InputSpec("counts"),), ("rows",),
                            CodeRef("map", {"function": "bench.pipelines:format_row"}), plain),
        ),
        injectors=(InjectorSpec("events", "events"),),
    )


def sink_stream(pipeline: str) -> str:
    return "counts" if pipeline == "single" else "rows"


def stage_names(pipeline: str) -> list[str]:
    return ["count"] if pipeline == "single" else ["parse", "count", "sink"]


def parse(record: Record) -> tuple[str, bytes, int]:
    """Stage 1 of (b): parse the JSON value, re-key by its ``k`` field and keep only the
    sequence number ``n`` (what the latency probes read)."""
    obj = json.loads(record.value)
    return obj["k"], str(obj["n"]).encode(), record.timestamp


def format_row(record: Record) -> tuple[str, bytes, int]:
    """Stage 3 of (b): a window result as a compact ``start,count`` row."""
    w = json.loads(record.value)
    return record.key, f"{w['start']},{w['count']}".encode(), record.timestamp


def injected(records: Sequence[Record], pipeline: str) -> list[Record]:
    """What the injector of ``pipeline`` sends: (b) keys records by source partition."""
    if pipeline == "single":
        return list(records)
    return [Record(f"p{i % PARTITIONS}", r.value, r.timestamp, r.record_id) for i, r in enumerate(records)]


def read_counts(store: StateStore, pipeline: str) -> Counter[tuple[str, int]]:
    """(key, window start) -> count, from the pipeline's sink stream log."""
    out: Counter[tuple[str, int]] = Counter()
    after = 0
    while True:
        page = store.read_log(sink_stream(pipeline), after, 50_000)
        if not page:
            return out
        for seq, rec in page:
            after = seq
            out.update({row_window(pipeline, rec): row_count(pipeline, rec)})


def row_window(pipeline: str, rec: Record) -> tuple[str, int]:
    if pipeline == "single":
        return rec.key, int(json.loads(rec.value)["start"])
    return rec.key, int(rec.value.split(b",", 1)[0])


def row_count(pipeline: str, rec: Record) -> int:
    if pipeline == "single":
        return int(json.loads(rec.value)["count"])
    return int(rec.value.split(b",", 1)[1])


def sequence_number(record: Record) -> int:
    """The workload index of a record reaching the count stage, in either pipeline."""
    value = record.value
    if value[:1] == b"{":
        return int(json.loads(value)["n"])
    return int(value)


class _Replay:
    """A replayable source over a list; cursor ``{"i", "max"}``; 2 s disorder bound."""

    def __init__(self, records: Sequence[Record]) -> None:
        self.records = list(records)

    def available(self) -> int:
        return len(self.records)

    def read(self, cursor: bytes | None, max_records: int) -> SourceBatch:
        state = json.loads(cursor) if cursor else {"i": 0, "max": MIN_TIMESTAMP}
        i, max_seen = state["i"], state["max"]
        end = min(i + max_records, self.available())
        batch = self.records[i:end] if end > i else []
        for r in batch:
            if r.timestamp > max_seen:
                max_seen = r.timestamp
        done = end >= len(self.records)
        wm = MAX_TIMESTAMP if done else (MIN_TIMESTAMP if max_seen == MIN_TIMESTAMP else max_seen - DISORDER_US)
        return SourceBatch(batch, json.dumps({"i": max(i, end), "max": max_seen}).encode(), wm, done)


class BacklogSource(_Replay):
    """Everything is available at once: the fixed backlog of the throughput figure."""


class PacedSource(_Replay):
    """Record ``i`` becomes readable at ``t0 + i / rate`` (wall clock, ``time.time()``)."""

    def __init__(self, records: Sequence[Record], rate: float, t0: float | None = None) -> None:
        super().__init__(records)
        self.rate = rate
        self.t0 = t0

    def available(self) -> int:
        if self.t0 is None:
            self.t0 = time.time()
        return min(len(self.records), int((time.time() - self.t0) * self.rate) + 1)

    def release_time(self, index: int) -> float:
        assert self.t0 is not None
        return self.t0 + index / self.rate


class ProbedCount(WindowedAggregate):
    """The built-in windowed count, plus a probe for the recovery figure: every ~20 ms
    of processing it appends ``wall_time lag_s`` to ``$BENCH_PROBE`` (lag = now minus
    the paced release time of the record just processed)."""

    def __init__(self, **params: object) -> None:
        import os

        super().__init__(**params)  # type: ignore[arg-type]
        spec = json.loads(os.environ.get("BENCH_RECOVERY", "{}"))
        self._t0 = float(spec.get("t0", 0.0))
        self._rate = float(spec.get("rate", 1.0))
        self._fh = open(spec["probe"], "a", buffering=1) if "probe" in spec else None  # noqa: SIM115
        self._last = 0.0

    def process_records(self, ctx: Context, records: Iterable[Record]) -> None:
        last: list[Record] = []

        def tracked() -> Iterator[Record]:
            for record in records:
                last[:] = [record]
                yield record

        super().process_records(ctx, tracked())
        if self._fh is None or not last:
            return
        now = time.time()
        if now - self._last >= 0.02:
            self._last = now
            lag = now - (self._t0 + sequence_number(last[0]) / self._rate)
            self._fh.write(f"{now:.4f} {lag:.4f}\n")
