"""Runs a whole topology in one process over one store: millwheel's local mode.

The runner owns every key range (it acquires every token at start, fencing any older
runner of the same store) and loops:

1. Injectors read a batch from their source and checkpoint it into their outbox.
2. For each node, upstream first: send its outbox to the consumers. Each consumer
   range dedups, runs user code and checkpoints (steps 1-3 of the exactly-once
   sequence); then the sender acks, deleting the entries (step 4). Records for the
   stream log (sinks) are appended idempotently by record ID, then acked.
3. Recompute watermarks; fire due timers of each computation, one checkpoint per
   range.
4. Periodically report per-range watermarks to the store, expire old record IDs and
   trim the stream logs to their retention (millwheel.runtime.retention).

A crash anywhere loses only in-memory work: a new runner on the same store resumes
from the outboxes, timers and cursors, and consumers drop the records they already
checkpointed.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, cast

from millwheel.clock import Clock, SystemClock
from millwheel.errors import FencedError, InvalidSpecError, UserCodeError
from millwheel.keys import key_range
from millwheel.nodes import injector_node, sink_node
from millwheel.operators import build_computation
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record
from millwheel.runtime import poison
from millwheel.runtime.context import RangeTransaction
from millwheel.runtime.injector import InjectorWorker
from millwheel.runtime.outbox import Outbox
from millwheel.runtime.range_worker import CrashHook, RangeWorker, no_crash
from millwheel.runtime.retention import LogTrimmer, retention_of
from millwheel.runtime.routing import LOG_PREFIX, Router
from millwheel.runtime.sink_runner import SinkRunner
from millwheel.runtime.writer_process import PipelinedStore, make_pipe
from millwheel.sensors import NullSensors, Sensors
from millwheel.sources import Source
from millwheel.state.protocol import Production, StateStore
from millwheel.topology import Productions, Topology
from millwheel.watermark_manager import WatermarkManager

YOUNG_GC_THRESHOLD = 50_000
RETENTION_EVERY_US = 1_000_000


def relax_young_gc(threshold: int = YOUNG_GC_THRESHOLD) -> None:
    """Raise CPython's generation-0 collection threshold (700 by default) to ``threshold``.

    A runner allocates a few objects per record (records, outbox entries, contexts)
    and keeps many alive (outbox mirrors, state caches, timer heaps); every 700
    allocations the collector traversed the young ones again: ~15% of the CPU of a
    three-stage run (docs/bench.md). Young collections still run, 70x less often;
    only reference cycles wait longer to be freed. Never lowers a higher setting.
    """
    young, middle, old = gc.get_threshold()
    if 0 < young < threshold:
        gc.set_threshold(threshold, middle, old)


@dataclass
class Progress:
    injected: int
    processed: int
    pending: int
    watermarks: dict[str, int]
    elapsed_s: float
    done: bool


def print_progress(p: Progress) -> None:
    """The progress line local runs print to stderr."""
    rate = p.processed / p.elapsed_s if p.elapsed_s > 0 else 0.0
    print(f"  {p.elapsed_s:6.1f}s  injected {p.injected:>9,}  processed {p.processed:>9,}"
          f"  ({rate:,.0f}/s)  pending {p.pending:>7,}", file=sys.stderr, flush=True)


class LocalRunner:
    def __init__(
        self,
        topology: Topology,
        store: StateStore,
        sources: Mapping[str, Source],
        *,
        clock: Clock | None = None,
        sensors: Sensors | None = None,
        crash: CrashHook = no_crash,
        batch_size: int = 5000,
        max_pending: int = 20_000,
        watermark_report_interval_us: int = 200_000,
        writer_process: bool = False,
    ) -> None:
        topology.validate()
        relax_young_gc()
        for inj in topology.injectors:
            if inj.name not in sources:
                raise InvalidSpecError(f"injector {inj.name!r} has no source")
        self.topology = topology
        # A step's writes are applied together at its end (runtime/grouped.py), by a
        # child process while the next step runs if asked for (runtime/writer_process.py).
        self._pipe = make_pipe(store, writer_process)
        self.store = cast(StateStore, self._pipe)
        store = self.store
        self.clock = clock or SystemClock()
        self.sensors = sensors or NullSensors()
        self.crash = crash
        self.batch_size = batch_size
        self.max_pending = max_pending
        self.router = Router(topology)
        self._report_interval = watermark_report_interval_us
        self._last_report = MIN_TIMESTAMP
        self.processed = 0
        self.workers: dict[str, list[RangeWorker]] = {}
        for spec in topology.computations:
            code = build_computation(spec)
            self.workers[spec.name] = [
                RangeWorker(spec, r, store, code, self.router, self.clock, self.sensors, crash)
                for r in range(spec.options.key_ranges)
            ]
        self.injectors = {
            injector_node(inj.name): InjectorWorker(
                inj, sources[inj.name], store, self.router, self.clock, crash
            )
            for inj in topology.injectors
        }
        # Sinks follow their stream's log once each step's writes are applied.
        self.sinks = [SinkRunner(s, self._pipe.inner, store.acquire(sink_node(s.name), 0), batch_size=batch_size)
                      for s in topology.sinks]
        # Log retention between steps, on the store itself (not the step's group), a few
        # small batches at most once per RETENTION_EVERY_US of processing time.
        self.trimmer = LogTrimmer(self._pipe.inner, self.clock)
        self._retention = retention_of(topology)
        self._last_trim = MIN_TIMESTAMP
        restored = {node: self._stored_watermark(node) for node in self._nodes()}
        self.watermarks = WatermarkManager(topology, restored)
        self._update_watermarks()

    # -- helpers -------------------------------------------------------------
    def _nodes(self) -> list[str]:
        return [*self.injectors, *self.workers]

    def _stored_watermark(self, node: str) -> int:
        stored = self.store.read_watermarks(node)
        ranges = 1 if node in self.injectors else len(self.workers[node])
        if len(stored) < ranges:
            return MIN_TIMESTAMP
        return min(stored.values())

    def _holds(self) -> dict[str, int]:
        holds = {node: inj.hold() for node, inj in self.injectors.items()}
        for name, workers in self.workers.items():
            holds[name] = min(w.hold() for w in workers)
        return holds

    def _update_watermarks(self) -> dict[str, int]:
        reports = {node: inj.watermark for node, inj in self.injectors.items()}
        return self.watermarks.update(reports, self._holds())

    def _outboxes(self, node: str) -> list[tuple[Outbox, int, Callable[[], int]]]:
        if node in self.injectors:
            inj = self.injectors[node]
            return [(inj.outbox, 0, lambda: inj.token)]
        return [(w.outbox, w.range_id, (lambda w=w: w.token)) for w in self.workers[node]]  # type: ignore[misc]

    # -- step 2: send and ack ------------------------------------------------
    def _deliver(self, productions: list[Production]) -> None:
        """Hand productions to their consumers, one checkpoint per consumer range; on
        return every one of them is checkpointed downstream (safe to ack)."""
        by_consumer: dict[str, list[Production]] = defaultdict(list)
        for p in productions:
            by_consumer[p.consumer].append(p)
        for consumer, items in by_consumer.items():
            if consumer.startswith(LOG_PREFIX):
                self.store.append_log(consumer[len(LOG_PREFIX) :], [p.record for p in items])
            else:
                workers = self.workers[consumer]
                # one batch per range and input stream: late records are counted per input
                by_range: dict[tuple[int, str], list[Record]] = defaultdict(list)
                for p in items:
                    by_range[(key_range(p.record.key, len(workers)), p.stream)].append(p.record)
                input_wm = self.watermarks.input_watermark(consumer)
                for (range_id, stream), records in by_range.items():
                    worker = workers[range_id]
                    poison.process_batch(worker, records, input_wm,
                                         lambda txn, w=worker: self._commit(w, txn),  # type: ignore[misc]
                                         stream)
                    self.processed += len(records)

    def _commit(self, worker: RangeWorker, txn: RangeTransaction) -> None:
        """Step 3; with weak productions, send first and checkpoint only what could not be
        delivered (here: what a fenced or failing consumer did not take)."""
        if worker.spec.options.productions is Productions.WEAK and txn.productions:
            try:
                self._deliver(txn.productions)
            except UserCodeError:
                raise
            except FencedError:
                worker.commit(txn, include_productions=True)
                return
            worker.commit(txn, include_productions=False)
        else:
            worker.commit(txn)

    def _send(self, node: str) -> int:
        """Send ``node``'s outboxes downstream, up to ``batch_size`` entries at a time taken
        across all its ranges, so each consumer range checkpoints them together; then
        each producing range acks its part (fenced by its own token)."""
        sent = 0
        outboxes = self._outboxes(node)
        while True:
            parts: list[tuple[Outbox, Callable[[], int], list[Production]]] = []
            room = self.batch_size
            for outbox, _range_id, token in outboxes:
                if room > 0 and len(outbox):
                    part = outbox.pending(room)
                    parts.append((outbox, token, part))
                    room -= len(part)
            if not parts:
                return sent
            batch = parts[0][2] if len(parts) == 1 else [p for part in parts for p in part[2]]
            self._deliver(batch)
            for outbox, token, part in parts:
                outbox.ack(token(), [(p.consumer, p.record.record_id) for p in part])
                self.crash("after_ack")
            sent += len(batch)
            if sent >= self.max_pending:
                return sent

    def _fire_timers(self, name: str) -> int:
        fired = 0
        input_wm = self.watermarks.input_watermark(name)
        for worker in self.workers[name]:
            if poison.fire_timers(worker, input_wm, lambda txn, w=worker: self._commit(w, txn)):  # type: ignore[misc]
                fired += 1
        return fired

    def _report_watermarks(self, force: bool = False) -> None:
        now = self.clock.now_us()
        if not force and now - self._last_report < self._report_interval:
            return
        self._last_report = now
        report = self._pipe.inner.report_watermark
        submit = self._pipe.submit
        for node, inj in self.injectors.items():
            wm = self.watermarks.output_watermark(node)
            submit(functools.partial(report, node, 0, inj.token, wm))
            self.sensors.watermark(node, wm, now - wm)
        for name, workers in self.workers.items():
            input_wm = self.watermarks.input_watermark(name)
            for w in workers:
                submit(functools.partial(report, name, w.range_id, w.token, min(input_wm, w.hold())))
            wm = self.watermarks.output_watermark(name)
            self.sensors.watermark(name, wm, now - wm)
            for w in workers:
                w.expire_record_ids()
        self.crash("after_watermark")

    # -- the loop --------------------------------------------------------------
    def step(self) -> bool:
        """One pass of steps 1-4; True if anything moved. Its store writes are held and
        applied together, in order, before it returns (runtime/grouped.py), or handed to
        the writer process, which applies them while the next step runs."""
        with self._pipe.deferring():
            moved = self._step()
        self._pipe.end_step()
        if self.sinks:
            self._pipe.flush()
            for sink in self.sinks:
                moved = sink.step() > 0 or moved
        return moved

    def flush(self) -> None:
        """Apply every store write held so far (raises the first that failed)."""
        self._pipe.flush()

    def stop_writer(self) -> None:
        """Apply every held write and stop the writer process, if there is one."""
        if isinstance(self._pipe, PipelinedStore):
            self._pipe.stop()
        else:
            self._pipe.flush()

    def _step(self) -> bool:
        moved = 0
        for inj in self.injectors.values():  # 1
            moved += inj.pull(self.batch_size, self.max_pending)
        self._update_watermarks()
        for node in self.watermarks.order:  # 2 and 3, upstream first
            moved += self._send(node)
            if node in self.workers:
                self._update_watermarks()
                fired = self._fire_timers(node)
                if fired:  # their productions go downstream in this step (and its write group)
                    moved += fired + self._send(node)
        self._update_watermarks()
        self._report_watermarks()  # 4
        now = self.clock.now_us()
        if now - self._last_trim >= RETENTION_EVERY_US:
            self._last_trim = now
            self.trimmer.run(self._retention)
        return moved > 0

    def finished(self) -> bool:
        return (
            all(inj.done and not len(inj.outbox) for inj in self.injectors.values())
            and all(not len(w.outbox) for ws in self.workers.values() for w in ws)
            and all(w.timers.hold() == MAX_TIMESTAMP for ws in self.workers.values() for w in ws)
            and all(s.caught_up for s in self.sinks)
        )

    def run(
        self,
        *,
        until_finished: bool = True,
        on_progress: Callable[[Progress], None] | None = None,
        progress_every_s: float = 0.5,
        idle_sleep_s: float = 0.01,
    ) -> Progress:
        """Loop until every source is done and all work has drained (or forever)."""
        started = last = time.monotonic()
        while True:
            moved = self.step()
            now = time.monotonic()
            done = self.finished()
            if on_progress is not None and (now - last >= progress_every_s or done):
                last = now
                on_progress(self.progress(now - started, done))
            if done and until_finished:
                break
            if not moved:
                time.sleep(idle_sleep_s)
        self._report_watermarks(force=True)
        self.trimmer.save(force=True)  # the next run resumes from these marks
        for sink in self.sinks:
            sink.close()
        return self.progress(time.monotonic() - started, True)

    def progress(self, elapsed_s: float, done: bool) -> Progress:
        pending = sum(len(inj.outbox) for inj in self.injectors.values())
        pending += sum(len(w.outbox) for ws in self.workers.values() for w in ws)
        wms = {n: self.watermarks.output_watermark(n) for n in self._nodes()}
        injected = sum(inj.injected for inj in self.injectors.values())
        return Progress(injected, self.processed, pending, wms, elapsed_s, done)

    def watermark(self, node: str) -> int:
        wm = self.watermarks.output_watermark(node)
        return MAX_TIMESTAMP if wm >= MAX_TIMESTAMP else wm
