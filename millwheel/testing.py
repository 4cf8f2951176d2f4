"""Test a pipeline in virtual time, with crashes: no server, no ports, no files left.

:class:`PipelineTest` runs a :class:`~millwheel.topology.Topology` in-process through
the same runtime as ``millwheel run`` (:class:`~millwheel.runtime.local_runner.LocalRunner`
over a SQLite store in a temporary directory, removed at :meth:`PipelineTest.close`).
The test feeds each injector records and watermarks, moves processing time by hand
(:class:`~millwheel.clock.ManualClock`), runs until nothing moves, and reads what came
out, a key's state and its timers::

    with PipelineTest(topology) as t:
        t.add("clicks", [Record("ann", b"{}", 1_000_000, "c1"), Record("bob", b"{}", 2_000_000, "c2")])
        t.advance_watermark("clicks", 10_000_000)    # event time: windows up to 10 s close
        t.run()
        assert [r.key for r in t.output("counts")] == ["ann", "bob"]
        t.advance_processing_time(60_000_000)        # processing-time timers a minute on
        t.run()

**Crashes.** :meth:`PipelineTest.crash` drops the runner with everything it held in
memory, as a kill -9 would, and builds a new one over the same store: it resumes from
what was checkpointed, and consumers drop the records they had already taken (records
keep their IDs). :func:`every_crash` runs a test script once without crashing, then once
for every crash point of the exactly-once sequence and every visit of it (the Nth
``after_checkpoint``, ...), crashing there and recovering, and asserts every run's
outputs equal the uncrashed run's, record by record (as sets: the order in which a
stream's records were written may differ after a crash)::

    def script(t: PipelineTest) -> None:
        t.add("clicks", records)
        t.done("clicks")
        t.run()

    every_crash(topology, script, outputs=["counts"])   # raises AssertionError naming the crash

Records a test adds are kept by the test harness (not by the runner): after a crash the
injector reads them again from its checkpointed position, exactly as a source would be
replayed.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

from millwheel.clock import ManualClock
from millwheel.errors import InvalidSpecError
from millwheel.keys import key_range
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record, Timer
from millwheel.runtime.crash import POINTS, CrashSchedule, SimulatedCrash
from millwheel.runtime.local_runner import LocalRunner
from millwheel.sources import SourceBatch
from millwheel.state.protocol import StateStore
from millwheel.state.url import open_store
from millwheel.topology import Topology

MAX_STEPS = 100_000  #: steps of one run() before it says the pipeline never settles


@dataclass(frozen=True)
class _Event:
    records: tuple[Record, ...] = ()
    watermark: int | None = None
    done: bool = False


class ScriptedSource:
    """An injector's input as the test gives it: records, watermarks and done, in order.
    Its cursor (checkpointed with each batch the injector takes) is the index of the next
    event, so after a crash the injector reads on from there."""

    def __init__(self) -> None:
        self.events: list[_Event] = []

    def read(self, cursor: bytes | None, max_records: int) -> SourceBatch:
        state = json.loads(cursor) if cursor else {"i": 0, "wm": MIN_TIMESTAMP}
        i, wm = state["i"], state["wm"]
        if state.get("done"):  # read again after a crash: still done
            return SourceBatch([], cursor or b"", MAX_TIMESTAMP, True)
        records: list[Record] = []
        done = False
        while i < len(self.events) and not done:
            event = self.events[i]
            if event.records:
                if records and len(records) + len(event.records) > max_records:
                    break
                records += event.records
            if event.watermark is not None:
                wm = max(wm, event.watermark)
            done = event.done
            i += 1
            if event.watermark is not None or done:
                break  # a watermark is applied after the records before it, and alone
        return SourceBatch(records, json.dumps({"i": i, "wm": wm, "done": done}).encode(),
                           MAX_TIMESTAMP if done else wm, done)


class PipelineTest:
    """One topology under test (see the module docstring). ``start_us``: processing time
    at the start; ``batch_size``: records an injector takes per step."""

    def __init__(self, topology: Topology, *, start_us: int = 0, batch_size: int = 1000,
                 crash: Callable[[str], None] | None = None) -> None:
        produced = {s for c in topology.computations for s in c.all_outputs()}
        # Every stream a computation writes is logged, so the test can read any of them.
        self.topology = replace(topology, log_streams=tuple(sorted(set(topology.log_streams) | produced)))
        self.topology.validate()
        self.clock = ManualClock(start_us)
        self.sources = {inj.name: ScriptedSource() for inj in topology.injectors}
        self.batch_size = batch_size
        self._dir = tempfile.mkdtemp(prefix="millwheel-test-")
        self.store: StateStore = open_store(f"sqlite:///{Path(self._dir) / 'test.db'}")
        self._crash_hook = crash
        self.crashes = 0
        self.runner = self._runner()

    def _runner(self) -> LocalRunner:
        hook = self._crash_hook
        return LocalRunner(self.topology, self.store, self.sources, clock=self.clock,
                           batch_size=self.batch_size, crash=hook if hook is not None else _no_crash)

    def __enter__(self) -> PipelineTest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the store and remove its directory."""
        try:
            self.runner.stop_writer()
        except Exception:  # noqa: BLE001 - a crashed runner's held writes are gone anyway
            pass
        self.store.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- input ----------------------------------------------------------------------
    def _source(self, injector: str) -> ScriptedSource:
        source = self.sources.get(injector)
        if source is None:
            raise InvalidSpecError(f"no injector named {injector!r} (known: {', '.join(sorted(self.sources))})")
        if source.events and source.events[-1].done:
            raise InvalidSpecError(f"injector {injector!r} is done: it takes nothing more")
        return source

    def add(self, injector: str, records: Iterable[Record]) -> None:
        """Records for ``injector``, read at the next :meth:`run`. Give each an ID: it is
        how consumers recognise a record read again after a crash."""
        batch = tuple(records)
        for i, r in enumerate(batch):
            r.validate(f"{injector} record {i}")
        if batch:
            self._source(injector).events.append(_Event(records=batch))

    def advance_watermark(self, injector: str, watermark: int) -> None:
        """``injector`` promises no record older than ``watermark`` from now on."""
        self._source(injector).events.append(_Event(watermark=watermark))

    def done(self, injector: str | None = None) -> None:
        """``injector`` (every injector, if None) sends nothing more: its watermark is +inf."""
        for name in [injector] if injector is not None else sorted(self.sources):
            self._source(name).events.append(_Event(done=True))

    def advance_processing_time(self, delta_us: int) -> None:
        """Move processing time on (processing-time timers, record-ID retention)."""
        self.clock.advance(delta_us)

    # -- running --------------------------------------------------------------------
    def run(self) -> None:
        """Run until nothing moves: every record given so far processed, every timer due
        fired, every output written. With a crash hook, a crash recovers and goes on."""
        steps = 0
        while True:
            try:
                moved = self.runner.step()
                self.runner.flush()
            except SimulatedCrash:
                self.crash()
                moved = True
            if not moved:
                return
            steps += 1
            if steps > MAX_STEPS:
                raise RuntimeError(f"the pipeline did not settle within {MAX_STEPS} steps")

    def crash(self) -> None:
        """Drop the runner and what it held in memory (as kill -9 would) and start a new
        one over the same store; the next :meth:`run` goes on from the checkpoints."""
        self.crashes += 1
        self.runner = self._runner()

    # -- what came out --------------------------------------------------------------
    def output(self, stream: str) -> list[Record]:
        """Every record written to ``stream`` so far, in the order written."""
        return [r for _seq, r in self.store.read_log(stream, 0, 10**9)]

    def watermark(self, node: str) -> int:
        """A computation's (or ``injector:NAME``'s) output low watermark now."""
        return self.runner.watermark(node)

    def state(self, computation: str, key: str) -> bytes | None:
        spec = self.topology.computation(computation)
        rid = key_range(key, spec.options.key_ranges)
        return self.store.read_state(computation, [key], rid).get(key)

    def timers(self, computation: str, key: str) -> list[Timer]:
        spec = self.topology.computation(computation)
        return self.store.read_key_timers(computation, key, key_range(key, spec.options.key_ranges))


def _no_crash(point: str) -> None:
    return None


def every_crash(topology: Topology, script: Callable[[PipelineTest], None], outputs: Sequence[str],
                *, points: Sequence[str] = POINTS, max_visits: int = 50, start_us: int = 0,
                batch_size: int = 1000) -> int:
    """Run ``script`` without a crash, then once per crash point and visit (up to
    ``max_visits`` visits of each point), crashing there and recovering; assert each
    run's ``outputs`` streams equal the uncrashed run's, record by record. Returns how
    many crashed runs were checked."""
    counter = CrashSchedule(points[0], 0)  # never fires (visits count from 1): counts every visit
    with PipelineTest(topology, start_us=start_us, batch_size=batch_size, crash=counter) as t:
        script(t)
        want = {s: _sorted(t.output(s)) for s in outputs}
    checked = 0
    for point in points:
        for n in range(1, min(counter.visits[point], max_visits) + 1):
            hook = CrashSchedule(point, n)
            with PipelineTest(topology, start_us=start_us, batch_size=batch_size, crash=hook) as t:
                script(t)
                t.run()  # a crash in the script's last run is recovered and run on
                for s in outputs:
                    got = _sorted(t.output(s))
                    if got != want[s]:
                        raise AssertionError(
                            f"crash at {point} #{n}: stream {s!r} has {len(got)} records, the run without a "
                            f"crash {len(want[s])}; first difference at {_first_difference(got, want[s])}")
            checked += 1
    return checked


def _sorted(records: list[Record]) -> list[Record]:
    """A stream's records in a fixed order: after a crash the same records may be
    written in another order (a batch delivered again alongside newer ones)."""
    return sorted(records, key=lambda r: (r.record_id, r.key, r.timestamp, r.value))


def _first_difference(got: list[Record], want: list[Record]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"#{i}: {a} != {b}"
    return f"#{min(len(got), len(want))}"
