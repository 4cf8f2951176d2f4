"""Sources and sinks where their ranges are owned (docs/connectors.md).

An injector whose spec names a ``source`` is pulled by the worker owning its range:
each batch read is checkpointed into the injector's outbox together with the source
position (the cursor) and the watermark, under the range's token, exactly as local
mode's :class:`~millwheel.runtime.injector.InjectorWorker` does; the pump sends the
outbox on. Reading pauses while the outbox holds ``--max-injector-outbox`` records
(backpressure). A sink's range (``sink:NAME``) is run by a
:class:`~millwheel.runtime.sink_runner.SinkRunner` under its token.

Two threads (one pulling every owned source, one writing every owned sink), so a slow
external system on one side never stalls the other, nor the worker's pump.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from millwheel.clock import SystemClock
from millwheel.connectors.files import FilesSource
from millwheel.connectors.own_store import refuse_own_store
from millwheel.connectors.pulled import PulledSource, open_source
from millwheel.connectors.spec import SinkSpec, SourcePaths
from millwheel.errors import FencedError, MillWheelError
from millwheel.nodes import is_sink, name_of, sink_node
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.runtime.injector import CURSOR_KEY, dead_letters
from millwheel.runtime.sink_runner import SinkRunner
from millwheel.state.protocol import Checkpoint, StateStore
from millwheel.topology import InjectorSpec

from ..metrics import PrometheusSensors
from .failing import RangeFailures
from .shared import Shared
from .units import INJ_WM_KEY, OwnedRange

log = logging.getLogger("millwheel.worker")
Unit = tuple[str, int]
IDLE_S = 0.02
#: Between passes while this worker owns no source (or no sink): a source or sink given
#: to it starts within this; not 50 passes a second over every range for nothing.
NONE_OWNED_S = 0.25
UNBUILT_RETRY_S = 30.0  #: how often a sink that could not be built is tried again


class Connectors:
    """The two threads and what they own. Constructed with what the worker's parts share
    (``shared``: the topology, router, units and the pump's wake-up), the store, the
    worker's limits, stop event and failing ranges, and two callables back into the worker process:
    ``fenced`` (a source's range fenced: dropped and reported) and ``report_fenced`` (a
    sink's range fenced: told to the controller with the next heartbeat)."""

    def __init__(self, shared: Shared, store: StateStore, sensors: PrometheusSensors, stopped: threading.Event,
                 *, batch_size: int, max_injector_outbox: int, fenced: Callable[[OwnedRange, FencedError], None],
                 report_fenced: Callable[[tuple[str, int, int]], None], failures: RangeFailures,
                 source_paths: SourcePaths | None = None) -> None:
        self.shared = shared
        #: where a files source may read here (--allow-source-path; none by default)
        self.source_paths = source_paths or SourcePaths()
        self.store = store
        self.failures = failures  #: the worker's failing ranges (a failing source's too)
        self.sensors = sensors
        self.stopped = stopped
        self.batch_size = batch_size
        self.max_injector_outbox = max_injector_outbox
        self._fenced_range = fenced
        self._report_fenced = report_fenced
        self.clock = SystemClock()
        self.sources: dict[Unit, tuple[int, PulledSource]] = {}
        self.sinks: dict[Unit, SinkRunner] = {}
        self._sinks_lock = threading.Lock()  # held briefly: never while a sink writes
        self.fenced: set[tuple[str, int, int]] = set()  # (node, range, token) a sink was fenced under
        #: sinks given to us that could not be built: unit -> (token, failing since, next try)
        self.unbuilt: dict[Unit, tuple[int, float, float]] = {}
        self.threads = [threading.Thread(target=self._source_loop, name="sources", daemon=True),
                        threading.Thread(target=self._sink_loop, name="sinks", daemon=True)]
        for t in self.threads:
            t.start()

    # -- sources ---------------------------------------------------------------------
    def _source_loop(self) -> None:
        while not self.stopped.is_set():
            moved = 0
            try:
                moved = self._pull_all()
            except Exception:
                log.exception("source pass failed")
                time.sleep(0.5)
            if not moved:
                time.sleep(IDLE_S if self.sources else NONE_OWNED_S)
        for _token, src in self.sources.values():
            src.close()

    def _pull_all(self) -> int:
        shared = self.shared
        wanted: dict[Unit, tuple[OwnedRange, InjectorSpec]] = {}
        for unit, owned in list(shared.units.items()):
            if owned.is_injector and not owned.dropped:
                spec = shared.topology.injector(name_of(owned.node))
                if spec is not None and spec.source is not None:
                    wanted[unit] = (owned, spec)
        for unit in [u for u in self.sources if u not in wanted or wanted[u][0].token != self.sources[u][0]]:
            self.sources.pop(unit)[1].close()
        moved = 0
        for unit, (owned, spec) in wanted.items():
            if not self.failures.due(unit):  # failing: backed off
                continue
            try:
                if unit not in self.sources:
                    assert spec.source is not None
                    # (the registry refuses it; this one was stored before it did: issue 34, item 5)
                    refuse_own_store([(f"injector {spec.name!r} source", spec.source.type, spec.source.settings)],
                                     self.store)
                    self.sources[unit] = (owned.token, self._open(spec))
                moved += self._pull(owned, spec, self.sources[unit][1])
            except Exception as exc:  # noqa: BLE001 - this source's failure alone (issue 34, item 2)
                # A source its connector cannot read (a Redis key that is not a stream, a bug):
                # its range is failing (heartbeat reports: status, console), retried with
                # back-off, reopened then; the sources after it in this pass go on.
                self.failures.failed(unit, "source", exc, origin="source")
                gone = self.sources.pop(unit, None)
                if gone is not None:
                    gone[1].close()
                continue
            self.failures.succeeded(unit, origin="source")
        return moved

    def _open(self, spec: InjectorSpec) -> PulledSource:
        """The injector's source; a files source confined to this worker's
        --allow-source-path before its first read, checked again here whatever the
        controller accepted (a registry restored or written before the check, a link
        swapped since): a refusal is this source's failure (PermissionDeniedError)."""
        assert spec.source is not None
        if spec.source.type == "files":
            self.source_paths.check_pattern(str(spec.source.settings.get("path", "")),
                                            f"injector {spec.name!r} source.path")
        source = open_source(spec.name, spec.source.settings, self.clock)
        if isinstance(source.connector, FilesSource):
            source.connector.confine(self.source_paths)
        return source

    def _pull(self, owned: OwnedRange, spec: InjectorSpec, source: PulledSource) -> int:
        """Read and checkpoint one batch of ``source`` into ``owned``'s outbox (unless the
        outbox is full: backpressure)."""
        assert owned.outbox is not None
        if owned.outbox.in_memory() >= self.max_injector_outbox or owned.injector_wm >= MAX_TIMESTAMP:
            return 0  # backpressure; or closed (a drain: services/controller/drain.py): read no more
        if owned.cursor is None:
            owned.cursor = self.store.read_state(owned.node, [CURSOR_KEY]).get(CURSOR_KEY) or b""
        cursor = owned.cursor
        batch = source.read(cursor, self.batch_size)
        if not batch.records and not batch.rejected and batch.cursor == cursor \
                and batch.watermark <= owned.injector_wm:
            return 0
        with owned.lock:
            if owned.dropped or owned.injector_wm >= MAX_TIMESTAMP:  # closed while it read
                return 0
            wm = max(owned.injector_wm, batch.watermark)
            cp = Checkpoint(computation=owned.node, range_id=0, token=owned.token, now_us=self.clock.now_us(),
                            state_writes={CURSOR_KEY: batch.cursor, INJ_WM_KEY: str(wm).encode()},
                            productions=self.shared.router.fan_out_many(spec.stream, batch.records))
            if batch.rejected:
                dead_letters(cp, spec, self.shared.router, batch.rejected)
            try:
                self.store.checkpoint(cp)
            except FencedError as exc:
                self._fenced_range(owned, exc)
                return 0
            owned.outbox.add(cp.productions)
            owned.cursor = batch.cursor
            owned.injector_wm = wm
            owned.changed()
        self.shared.wake.set()
        return len(batch.records) + len(batch.rejected)

    # -- sinks -----------------------------------------------------------------------
    def keep(self, mine: dict[Unit, int], fenced: set[tuple[str, int, int]]) -> None:
        """Take the sink ranges assigned to us and drop those that are not (any more),
        after a heartbeat answer."""
        specs = {sink_node(s.name): s for s in self.shared.topology.sinks}
        with self._sinks_lock:
            for unit in [u for u, (token, _s, _t) in self.unbuilt.items() if mine.get(u) != token]:
                del self.unbuilt[unit]  # no longer ours (or another token): forgotten
            for unit, runner in list(self.sinks.items()):
                if mine.get(unit) != runner.token or (unit[0], unit[1], runner.token) in fenced \
                        or unit[0] not in specs:
                    self._drop(unit, "moved to another worker")
            for unit, token in mine.items():
                if is_sink(unit[0]) and unit not in self.sinks and unit[0] in specs \
                        and (unit[0], unit[1], token) not in fenced | self.fenced:
                    self._take(unit, token, specs[unit[0]])

    def _take(self, unit: Unit, token: int, spec: SinkSpec) -> None:
        """Build the sink's runner. One that cannot be built (its connector refuses its
        settings, it names the store's own Redis, its client library is missing) is that sink's failure alone: shown as
        down (:meth:`down`), logged once per token, tried again every UNBUILT_RETRY_S; it
        never stops the heartbeat that gave it, nor the ranges given with it (issue 34)."""
        now = time.monotonic()
        failed = self.unbuilt.get(unit)
        if failed is not None and failed[0] == token and now < failed[2]:
            return
        try:
            refuse_own_store([(f"sink {spec.name!r}", spec.connector.type, spec.connector.settings)], self.store)
            runner = SinkRunner(spec, self.store, token, batch_size=self.batch_size)
        except Exception as exc:  # noqa: BLE001 - whatever the connector raises: this sink's failure
            since = failed[1] if failed is not None and failed[0] == token else now
            self.unbuilt[unit] = (token, since, now + UNBUILT_RETRY_S)
            if failed is None or failed[0] != token:
                log.error("sink %s (token %d) cannot be built here: %s; tried again every %.0f s",
                          unit[0], token, exc, UNBUILT_RETRY_S, exc_info=not isinstance(exc, MillWheelError))
            return
        self.unbuilt.pop(unit, None)
        self.sinks[unit] = runner
        log.info("took %s/%d (token %d)", unit[0], unit[1], token)

    def _drop(self, unit: Unit, reason: str) -> None:
        """Forget a sink range (under the lock); the sink thread closes it after any write
        in progress (a write of ours racing the new owner is refused by the token)."""
        runner = self.sinks.pop(unit, None)
        if runner is not None:
            runner.dropped = True
            log.info("dropped %s/%d (token %d): %s", unit[0], unit[1], runner.token, reason)

    def _sink_loop(self) -> None:
        while not self.stopped.is_set():
            moved = 0
            with self._sinks_lock:
                owned = list(self.sinks.items())
            for unit, runner in owned:
                try:
                    written = 0 if runner.dropped else runner.step(
                        self.shared.input_wms.get(unit[0], MIN_TIMESTAMP))
                    moved += written
                    down = runner.down_since
                    self.sensors.sink(runner.spec.name, 0.0 if down is None else time.monotonic() - down,
                                           written)
                except FencedError as exc:
                    with self._sinks_lock:
                        self.fenced.add((unit[0], unit[1], runner.token))
                        # told to the controller with the next heartbeat, which issues a
                        # fresh token if it still means us (as for any fenced range)
                        self._report_fenced((unit[0], unit[1], runner.token))
                        if self.sinks.get(unit) is runner:
                            self._drop(unit, str(exc))
                except Exception as exc:  # an error its connector does not map: this sink's failure alone
                    first = runner.down_since is None
                    runner.failed(exc, quiet=True)  # backed off like any failure, shown as down
                    if first:
                        log.exception("sink %s failed; retried with back-off until it writes again", unit[0])
                if runner.dropped:
                    runner.close()
            if not moved:
                time.sleep(IDLE_S if owned else NONE_OWNED_S)
        with self._sinks_lock:
            for runner in self.sinks.values():
                runner.close()
            self.sinks.clear()

    def down(self) -> dict[str, float]:
        """Sinks failing to write now -> seconds since (the heartbeat's ``sinks_down``)."""
        now = time.monotonic()
        down = {r.spec.name: now - r.down_since for r in list(self.sinks.values()) if r.down_since is not None}
        down.update({name_of(unit[0]): now - since for unit, (_t, since, _r) in list(self.unbuilt.items())})
        return down

    def watermarks(self) -> list[tuple[str, int, int, int]]:
        """(node, range, token, watermark) of each sink run here: what its external
        system is known to hold (SinkRunner.watermark), reported with the heartbeat as
        any range's watermark, so status shows a sink's progress, not -inf."""
        return [(unit[0], unit[1], r.token, r.watermark) for unit, r in list(self.sinks.items())
                if not r.dropped]

    def positions(self) -> dict[str, int]:
        """Sinks -> the last log position their external system committed (the
        heartbeat's ``sink_positions``: what a drain waits for). A runner's position is
        the highest its connector's ``open`` read back or a ``write_batch`` returned,
        each after the system's own commit, so it is never ahead of what the system
        holds (kept while the system is down); a runner never opened yet is left out."""
        return {r.spec.name: r.committed for r in list(self.sinks.values())
                if r.committed is not None and not r.dropped}
