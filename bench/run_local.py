"""Millwheel's local runner under the two loads of the suite.

* :func:`backlog_case`: the whole workload is available at once; records/s over the
  time the runner takes to drain it ("backlog throughput", the honest sustainable
  figure for a single-process runner: it is the rate at which the backlog shrinks).
* :func:`paced_case`: a :class:`~bench.pipelines.PacedSource` releases records at a
  fixed rate; we record, per record, its release time and when the count stage's
  checkpoint holding it committed (record latency), per window result when it appeared
  in the sink log against when the source watermark made it computable (result
  latency), and each node's output watermark after every step (watermark lag).

Every case checks its output against :func:`bench.workload.expected_counts`.
Each case is a plain function of picklable arguments, so the suite runs it in a
fresh process (peak RSS per case, no state carried between cases).
"""

from __future__ import annotations

import bisect
import resource
import time
from dataclasses import dataclass
from typing import Any, Sequence

from bench import pipelines, redis_memory
from bench.workload import DISORDER_US, WINDOW_US, Workload, check, generate
from millwheel.nodes import injector_node
from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.runtime.range_worker import RangeWorker
from millwheel.sensors import CountingSensors
from millwheel.state import open_store


@dataclass(frozen=True)
class WorkloadArgs:
    n: int
    keys: int
    distribution: str
    seed: int = 7
    density: int | None = None

    def build(self) -> Workload:
        return generate(self.n, self.keys, self.distribution, self.seed, density=self.density)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _runner(w: Workload, pipeline: str, store_url: str, source: Any, eo: bool, productions: str,
            batch_size: int, state_ttl_us: int | None = None,
            writer_process: bool = False) -> tuple[LocalRunner, CountingSensors]:
    store = open_store(store_url)
    sensors = CountingSensors()
    topo = pipelines.topology(pipeline, exactly_once=eo, productions=productions, state_ttl_us=state_ttl_us)
    runner = LocalRunner(topo, store, {"events": source}, sensors=sensors, batch_size=batch_size,
                         writer_process=writer_process)
    return runner, sensors


def _writer_cpu_s(runner: LocalRunner) -> float:
    """CPU seconds of the runner's writer process so far (0 without one; Linux /proc)."""
    child = getattr(runner.store, "_child", None)
    if child is None:
        return 0.0
    import os

    with open(f"/proc/{child.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _verdict(w: Workload, runner: LocalRunner, sensors: CountingSensors, pipeline: str) -> dict[str, Any]:
    observed = pipelines.read_counts(runner.store, pipeline)
    return check(w, observed, sensors.counts["late_drop:count"]).as_dict()


def backlog_case(wa: WorkloadArgs, pipeline: str, store_url: str, eo: bool = True,
                 productions: str = "strong", batch_size: int = 5000,
                 state_ttl_us: int | None = None, writer_process: bool = False) -> dict[str, Any]:
    w = wa.build()
    source = pipelines.BacklogSource(pipelines.injected(w.records, pipeline))
    runner, sensors = _runner(w, pipeline, store_url, source, eo, productions, batch_size, state_ttl_us,
                              writer_process)
    child_cpu_started = _writer_cpu_s(runner)
    memory = None
    paused = 0.0
    cpu_started = time.process_time()
    started = time.perf_counter()
    while True:  # LocalRunner.run, plus a Redis memory snapshot half-way (not timed)
        moved = runner.step()
        if memory is None and store_url.startswith("redis") and runner.processed >= w.size // 2:
            t = time.perf_counter()
            memory = redis_memory.snapshot(store_url)
            paused += time.perf_counter() - t
        if runner.finished():
            break
        if not moved:
            time.sleep(0.0005)
    runner.flush()  # the last group may still be in the writer process
    elapsed = time.perf_counter() - started - paused
    cpu = time.process_time() - cpu_started - paused
    writer_cpu = _writer_cpu_s(runner) - child_cpu_started
    result = {
        "records": w.size, "seconds": elapsed, "records_per_s": w.size / elapsed,
        "writer_cpu_s": writer_cpu, "runner_cpu_s": cpu,
        # Less sensitive to other load on the machine than wall time (this process only:
        # a Redis server's CPU is not in it).
        "records_per_cpu_s": w.size / cpu,
        "correct": _verdict(w, runner, sensors, pipeline), "peak_rss_mb": peak_rss_mb(),
        "record_bytes": w.record_bytes(), "checkpoints": sensors.counts["checkpoints:count"],
    }
    if store_url.startswith("redis"):
        result["redis_memory_midway"] = memory
        result["redis_memory_end"] = redis_memory.snapshot(store_url)
    runner.store.close()
    return result


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "n": 0}
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"p50": pct(0.50), "p95": pct(0.95), "p99": pct(0.99), "n": len(s)}


def _probe_commits(runner: LocalRunner, stage: str, committed: list[Sequence[Record]]) -> None:
    """Collect in ``committed`` the records of each checkpoint of ``stage``; the caller
    stamps them when the step that made it returned (``step()`` returns once its writes
    are applied, so the stamp is an upper bound of the commit time).

    The probe keeps references only: which record is which (its workload index, read
    from its value) is worked out after the run. Parsing every record's value inside the
    step cost ~23% of the runner's step time in a paced run (py-spy): work the backlog
    figure (no probe) does not include, so a run paced at "50%" of it loaded the runner
    more than that (docs/bench.md, "Speed round 2: latency")."""
    for worker in runner.workers[stage]:
        _wrap(worker, committed)


def _wrap(worker: RangeWorker, committed: list[Sequence[Record]]) -> None:
    process, commit = worker.process_records, worker.commit
    pending: dict[int, Sequence[Record]] = {}

    def process_records(records: Sequence[Record], input_watermark: int, input: str = "") -> Any:
        txn = process(records, input_watermark, input)
        pending[id(txn)] = records
        return txn

    def commit_(txn: Any, include_productions: bool = True) -> None:
        commit(txn, include_productions)
        records = pending.pop(id(txn), None)
        if records:
            committed.append(records)

    worker.process_records = process_records  # type: ignore[method-assign]
    worker.commit = commit_  # type: ignore[method-assign]


def _computable_times(records: list[Record], source: pipelines.PacedSource) -> list[tuple[int, float]]:
    """(watermark value X, wall time the source released enough records for its
    watermark to reach X), at every step up of the running maximum timestamp."""
    out: list[tuple[int, float]] = []
    max_seen = None
    for i, r in enumerate(records):
        if max_seen is None or r.timestamp > max_seen:
            max_seen = r.timestamp
            out.append((max_seen - DISORDER_US, source.release_time(i)))
    return out


def _first_time(samples: list[tuple[float, int]], x: int) -> float | None:
    for t, wm in samples:
        if wm >= x:
            return t
    return None


def paced_case(wa: WorkloadArgs, pipeline: str, store_url: str, rate: float, eo: bool = True,
               productions: str = "strong", batch_size: int = 5000) -> dict[str, Any]:
    w = wa.build()
    records = pipelines.injected(w.records, pipeline)
    source = pipelines.PacedSource(records, rate)
    runner, sensors = _runner(w, pipeline, store_url, source, eo, productions, batch_size)
    stamps: list[tuple[float, list[Sequence[Record]]]] = []  # (step returned, records it committed)
    committed: list[Sequence[Record]] = []
    _probe_commits(runner, "count", committed)
    nodes = [injector_node("events"), *pipelines.stage_names(pipeline)]
    samples: dict[str, list[tuple[float, int]]] = {n: [] for n in nodes}
    sink = pipelines.sink_stream(pipeline)
    seen_rows: list[tuple[int, float]] = []  # (window end, wall time seen in the log)
    after = 0
    source.t0 = time.time()
    started = time.perf_counter()
    while True:
        moved = runner.step()  # returns when its writes are applied
        now = time.time()
        if committed:
            stamps.append((now, committed[:]))
            committed.clear()
        for n in nodes:
            samples[n].append((now, runner.watermark(n)))
        for seq, rec in runner.store.read_log(sink, after, 100_000):
            after = seq
            seen_rows.append((pipelines.row_window(pipeline, rec)[1] + WINDOW_US, now))
        if runner.finished():
            break
        if not moved:
            time.sleep(0.0005)
    elapsed = time.perf_counter() - started
    done_at: dict[int, float] = {}
    for now, batches in stamps:
        for batch in batches:
            for record in batch:
                done_at.setdefault(pipelines.sequence_number(record), now)
    # Record latency: release -> checkpoint in the count stage.
    rec_lat = [(done_at[i] - source.release_time(i)) * 1000 for i in range(w.size) if i in done_at
               and w.records[i].record_id not in w.late_ids]
    # Result latency: the source watermark made the window computable -> row in the sink.
    comp = _computable_times(records, source)
    xs = [x for x, _ in comp]

    def computable(x: int) -> float | None:
        j = bisect.bisect_left(xs, x)
        return comp[j][1] if j < len(comp) else None

    last_release = source.release_time(w.size - 1)
    res_lat = []
    for end, t_seen in seen_rows:
        t_c = computable(end)
        if t_c is not None and t_c < last_release:  # windows closed by end-of-input excluded
            res_lat.append((t_seen - t_c) * 1000)
    # Watermark lag: for each window end X, when each node's output watermark reached it.
    ends = sorted({e for e, _ in seen_rows})
    added: dict[str, list[float]] = {n: [] for n in nodes}
    for x in ends:
        t_prev = computable(x)
        if t_prev is None or t_prev >= last_release:
            continue
        for n in nodes:
            t_n = _first_time(samples[n], x)
            if t_n is None or samples[n][-1][1] >= MAX_TIMESTAMP and t_n == samples[n][-1][0]:
                break
            added[n].append((t_n - t_prev) * 1000)
            t_prev = t_n
    result = {
        "rate": rate, "records": w.size, "seconds": elapsed,
        "achieved_per_s": w.size / elapsed,
        "record_latency_ms": _percentiles(rec_lat),
        "result_latency_ms": _percentiles(res_lat),
        "watermark_lag_added_ms": {n: _percentiles(v) for n, v in added.items()},
        "correct": _verdict(w, runner, sensors, pipeline), "peak_rss_mb": peak_rss_mb(),
    }
    runner.store.close()
    return result
