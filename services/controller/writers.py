"""Parallel ingestion's control side: routes to an injector's key ranges, and the
watermarks of its writers (docs/service.md, "Parallel ingestion").

Writers send records straight to the workers owning the injector's ranges
(services/worker/ingest.py); the controller stays off that path. It answers where the
ranges are (``InjectRoutes``) and keeps one low watermark per writer
(``WriterWatermark``): MillWheel's injectors run as many processes, and an injector's
watermark must hold for every one of them.

**The watermark rule.** An injector's writers' watermark is the least of its *live*
writers' watermarks, where

* a writer joins at ``InjectRoutes`` (naming itself) at the injector's watermark then
  (it cannot pull it back: its records below it are late, as any late record);
* a writer's watermark only rises; ``done`` sets it to +inf (for itself alone);
* a writer silent (no ``WriterWatermark``, which doubles as its keep-alive) for
  ``expiry_s`` is dropped: it no longer holds the injector back. If it speaks again it
  rejoins from then on; records it wrote below the watermark meanwhile are late;
* the injector closes (+inf) once every live writer is done;
* the writers' names (and which are done) are kept in the store, written when one joins,
  is done or expires: a controller taking over loads them, each holding the injector at
  its watermark then until it speaks again or expires (``expiry_s`` after the takeover).

When it rises (at a ``WriterWatermark``, answered once it is in, or an expiry) it is
pushed to every range of the injector as a watermark-only hand-over,
checkpointed by the range's owner under its token (the range's watermark is then its
own durable state, as with ``Inject``): each range reports the least of that watermark
and its outbox's oldest record, and the injector's watermark is the least over its
ranges. A writer sends its watermark only after every record below it was acked, so a
record is in a range's outbox (holding it) before the watermark passes it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from millwheel.errors import InvalidSpecError, NotFoundError, ResourceLimitError
from millwheel.limits import check_name
from millwheel.nodes import injector_node
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.topology import InjectorSpec

from ..generated import millwheel_pb2 as pb
from ..rpc.server import check
from .inject import Injection
from .plane import ControlPlane

log = logging.getLogger("millwheel.controller")
Ctx = grpc.ServicerContext

META_PREFIX = "writers/"  #: + injector name: JSON {writer: done}
WRITER_EXPIRY_S = 30.0  #: a writer silent this long no longer holds its injector's watermark
MAX_WRITERS = 1024  #: live writers per injector


@dataclass
class Writer:
    watermark: int
    seen: float  # time.monotonic() of its last call
    done: bool = False


class Writers:
    """InjectRoutes and WriterWatermark; the writers' table, and the thread that moves an
    injector's watermark on when a writer expires. Constructed with the plane and the injection
    part (its registration on first use and its hand-over to a range's owner)."""

    def __init__(self, plane: ControlPlane, injection: Injection, expiry_s: float = WRITER_EXPIRY_S) -> None:
        self.plane = plane
        self.injection = injection
        self.expiry_s = expiry_s
        self._lock = threading.Lock()  # the table; never held across a hand-over
        self._table: dict[str, dict[str, Writer]] = {}  # injector -> writer -> its state
        self._pushed: dict[str, int] = {}  # injector -> watermark handed to every range
        self._epoch: int | None = None  # the leader epoch the table belongs to
        self._pushers: dict[str, threading.Lock] = {}  # injector -> one push at a time
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._push_loop, name="writer-watermarks", daemon=True)
        self._thread.start()

    # -- the table ----------------------------------------------------------------------
    def _current(self) -> None:
        """Under ``_lock``: a new leader epoch loads the writers kept in the store, each at
        the least watermark (it holds the injector where it is) and seen now."""
        epoch = self.plane.led_epoch
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self._table.clear()
        self._pushed.clear()
        now = time.monotonic()
        for key, raw in self.plane.store.list_meta(META_PREFIX).items():
            try:
                kept = json.loads(raw)
            except ValueError:
                continue
            self._table[key[len(META_PREFIX):]] = {
                name: Writer(MAX_TIMESTAMP if done else MIN_TIMESTAMP, now, bool(done))
                for name, done in kept.items()}

    def _keep(self, injector: str) -> None:
        """Under ``_lock``: the writer set of ``injector`` into the store (a join, a done,
        an expiry: not every watermark)."""
        writers = self._table.get(injector, {})
        self.plane.store.put_meta(META_PREFIX + injector,
                                  json.dumps({n: w.done for n, w in writers.items()}).encode())

    def _expire(self, injector: str, now: float) -> dict[str, Writer]:
        """Under ``_lock``: ``injector``'s writers, those silent past the expiry dropped
        (and the set kept in the store if any was)."""
        writers = self._table.setdefault(injector, {})
        expired = [n for n, w in writers.items() if not w.done and now - w.seen > self.expiry_s]
        for name in expired:
            log.info("writer %r of injector %r silent for %.0f s: it no longer holds the watermark",
                     name, injector, now - writers[name].seen)
            del writers[name]
        if expired:
            self._keep(injector)
        return writers

    def _writer(self, injector: str, name: str, joins_at: int, now: float, where: str) -> Writer:
        """Under ``_lock``: writer ``name`` of ``injector``, seen now; one not (or no longer)
        known joins at ``joins_at`` (refused past MAX_WRITERS live writers)."""
        self._current()
        writers = self._expire(injector, now)
        w = writers.get(name)
        if w is None:
            if len(writers) >= MAX_WRITERS:
                raise ResourceLimitError(f"{where}: injector {injector!r} has {len(writers)} live "
                                         f"writers, the most it takes ({MAX_WRITERS})")
            w = writers[name] = Writer(joins_at, now)
            self._keep(injector)
        w.seen = now
        return w

    def _target(self, injector: str, now: float) -> int | None:
        """Under ``_lock``: the least watermark of the live writers (expired ones dropped),
        or None while it may not move (no live writer)."""
        writers = self._expire(injector, now) if injector in self._table else None
        return min(w.watermark for w in writers.values()) if writers else None

    def least(self, injector: str) -> tuple[str, int, float] | None:
        """(name, watermark, seconds since heard) of ``injector``'s least live writer
        that is not done, if any (what holds its watermark: services/controller/held_by.py).
        Read without the store: a table from another leader epoch counts as empty."""
        now = time.monotonic()
        with self._lock:
            if self._epoch != self.plane.led_epoch:
                return None
            live = [(n, w) for n, w in self._table.get(injector, {}).items()
                    if not w.done and now - w.seen <= self.expiry_s]
        if not live:
            return None
        name, w = min(live, key=lambda item: item[1].watermark)
        return name, w.watermark, now - w.seen

    # -- RPCs ---------------------------------------------------------------------------
    def routes(self, request: Any, context: Ctx) -> pb.InjectRoutesResponse:
        check(request)
        where = "InjectRoutes"
        if not request.injector:
            raise InvalidSpecError(f"{where}: 'injector' (the injector name) is required")
        check_name(request.injector, f"{where}: injector")
        if request.stream:
            check_name(request.stream, f"{where}: stream")
        if request.writer:
            check_name(request.writer, f"{where}: writer")
        p = self.plane
        self.injection.refuse_when_closed(where)
        spec = self.injection.injector_for(request, where, key_ranges=request.key_ranges or None)
        node = injector_node(spec.name)
        watermark = self._node_watermark(spec)
        if request.writer:
            with self._lock:
                self._writer(spec.name, request.writer, watermark, time.monotonic(), where)
        assigner = p.assigner
        ranges = []
        for r in range(spec.key_ranges):
            owner = assigner.units.get((node, r))
            worker = assigner.workers.get(owner.worker_id or "") if owner is not None else None
            if worker is not None and worker.alive and owner is not None:
                ranges.append(pb.RangeOwner(node=node, range_id=r, worker_id=worker.worker_id,
                                            worker_address=worker.ingest_address or worker.address,
                                            token=owner.token))
            else:
                ranges.append(pb.RangeOwner(node=node, range_id=r))
        return pb.InjectRoutesResponse(
            injector=spec.name, key_ranges=spec.key_ranges, ranges=ranges,
            routing_version=assigner.version, writer_expiry_us=int(self.expiry_s * 1e6),
            watermark=watermark)

    def watermark(self, request: Any, context: Ctx) -> pb.WriterWatermarkResponse:
        check(request)
        where = "WriterWatermark"
        if not request.writer:
            raise InvalidSpecError(f"{where}: 'writer' (the writer's name, as in InjectRoutes) is required")
        check_name(request.writer, f"{where}: writer")
        check_name(request.injector, f"{where}: injector")
        spec = self.plane.registry.injector(request.injector)
        if spec is None:
            raise NotFoundError(f"{where}: no injector named {request.injector!r}; InjectRoutes registers it")
        value: int | None = None
        if request.done:
            value = MAX_TIMESTAMP
        elif request.HasField("watermark"):
            value = request.watermark
            self.injection.settings.limits.check_watermark(
                value, where, self.plane.clock.now_us(), "to say this writer is done send done=true")
        now = time.monotonic()
        with self._lock:
            # new here (after a failover or its expiry): it joins now, at what it says
            w = self._writer(spec.name, request.writer, MIN_TIMESTAMP if value is None else value, now, where)
            writers = self._table[spec.name]
            if value is not None:
                w.watermark = max(w.watermark, value)
            if request.done and not w.done:
                w.done = True
                self._keep(spec.name)
            live = sum(1 for x in writers.values() if not x.done)
        pushed = self.push_due(spec.name)  # in every range before the answer: the writer may rely on it
        return pb.WriterWatermarkResponse(watermark=pushed, live_writers=live)

    def _node_watermark(self, spec: InjectorSpec) -> int:
        p = self.plane
        with p.lock:
            return p.wms.node(injector_node(spec.name), spec.key_ranges)

    # -- pushing ------------------------------------------------------------------------
    def _push_loop(self) -> None:
        """Expiries (each second, or when woken): an injector whose least live writer
        expired moves on without it."""
        p = self.plane
        while not p.stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if not p.leading():
                continue
            with self._lock:
                self._current()
                names = list(self._table)
            for name in names:
                try:
                    self.push_due(name)
                except Exception as exc:  # noqa: BLE001 - pushed again on the next pass
                    log.info("watermark of injector %r not pushed yet: %s", name, exc)

    def push_due(self, name: str) -> int:
        """Hand the writers' watermark of injector ``name`` to every range if it rose (one
        push at a time per injector); returns the watermark pushed."""
        with self._lock:
            pusher = self._pushers.setdefault(name, threading.Lock())
        with pusher:
            with self._lock:
                self._current()
                target = self._target(name, time.monotonic())
                pushed = self._pushed.get(name, MIN_TIMESTAMP)
            if target is None or target <= pushed:
                return pushed
            spec = self.plane.registry.injector(name)
            if spec is None:
                return pushed
            node = injector_node(name)
            for r in range(spec.key_ranges):
                batch = pb.DeliverBatch(computation=node, range_id=r, watermark=target,
                                        topology_version=self.plane.registry.version)
                self.injection.hand_over(node, batch)
            with self._lock:
                self._pushed[name] = pushed = max(self._pushed.get(name, MIN_TIMESTAMP), target)
            return pushed
