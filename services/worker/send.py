"""The worker's sending side: the pump loop that fires due timers and sends each owned
range's outbox in slices (stream-log entries appended, consumer ranges owned here
processed in place, others sent to their owner over a
:class:`~services.rpc.worker_link.PeerLink`), and deletes entries (``outbox.ack``) only
once the consumer has checkpointed them.

:class:`Sender` is a part of :class:`services.worker.service.WorkerProcess`, which hands
it the state shared by its parts (:class:`~services.worker.shared.Shared`) and, as plain
callables, what it asks of the receiving side (:mod:`services.worker.receive`: process a
batch in place, checkpoint fired timers, rebuild a range) and of range ownership
(a fenced range is dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from millwheel.errors import FencedError, UserCodeError
from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.runtime.context import RangeTransaction
from millwheel.runtime.range_worker import CrashHook
from millwheel.state.protocol import Production, StateStore

from ..generated import millwheel_pb2 as pb
from ..metrics import PrometheusSensors
from . import delivery, overruns
from .delivery import PeerLinks
from .failing import RangeFailures
from .parking import UNKNOWN, plan
from .progress import NoProgress, ProgressBlock
from .shared import Shared
from .units import OwnedRange, Slice

log = logging.getLogger("millwheel.worker")
Unit = tuple[str, int]
LINK_SWEEP_S = 10.0  # how often links to addresses that own nothing are closed


class Sender:
    """The pump and delivery of outboxes."""

    def __init__(
        self, shared: Shared, peers: PeerLinks, store: StateStore, failures: RangeFailures, *,
        sensors: PrometheusSensors, crash: CrashHook, progress: ProgressBlock | NoProgress, watched: bool,
        stopped: threading.Event, batch_size: int, max_slices: int, max_injector_outbox: int,
        delivery_timeout_s: float,
        process: Callable[[str, int, list[Record], Sequence[str], Sequence[int]], pb.DeliverAck],
        commit: Callable[[OwnedRange, RangeTransaction], None],
        rebuild: Callable[[OwnedRange], None],
        fenced: Callable[[OwnedRange, FencedError], None],
    ) -> None:
        """``watched``: user code runs under the watchdog's deadline (services/worker/watchdog.py);
        ``process``, ``commit`` and ``rebuild``: the receiving side's; ``fenced``: range
        ownership's, in services/worker/service.py."""
        self.shared = shared
        self.peers = peers
        self.store = store
        self.failures = failures
        self.sensors = sensors
        self.crash = crash
        self.progress = progress
        self.watched = watched
        self.stopped = stopped
        self.batch_size = batch_size
        self.max_slices = max_slices
        self.max_injector_outbox = max_injector_outbox
        self.delivery_timeout_s = delivery_timeout_s
        self._process = process
        self._commit = commit
        self._rebuild = rebuild
        self._fenced = fenced

    def pump_loop(self) -> None:
        swept = time.monotonic()
        while not self.stopped.is_set():
            self.shared.wake.clear()
            moved = 0
            if time.monotonic() - swept >= LINK_SWEEP_S:
                swept = time.monotonic()
                self.sweep_links()
            for owned in list(self.shared.units.values()):
                unit = (owned.node, owned.range_id)
                if unit in self.failures and not self.failures.due(unit):
                    continue  # failing: tried again once its backoff is over
                try:
                    done = self._pump(owned)
                    if done:
                        self.failures.succeeded(unit, origin="pump")
                    moved += done
                except FencedError as exc:
                    self._fenced(owned, exc)
                except UserCodeError:
                    pass  # on_error fail: logged by the policy, retried after its backoff
                except Exception as exc:  # noqa: BLE001 - its store (or a bug): the range's failure
                    self.failures.failed(unit, "checkpoint", exc, origin="pump")
                    with owned.lock:
                        self._rebuild(owned)  # timers may have been taken, state changed
                        owned.reset_slices()
                        owned.backoff()
            if not moved:
                # Acks, deliveries and heartbeats wake us; the timeout covers
                # processing-time timers and retry deadlines.
                self.shared.wake.wait(0.01)

    def _pump(self, owned: OwnedRange) -> int:
        moved = 0
        planned: list[Slice] = []
        with owned.lock:
            if owned.dropped:
                return 0
            for s in [s for s in owned.slices if s.ready()]:
                moved += self._finish(owned, s)
            self._check_overdue(owned)
            rw = owned.worker
            if rw is not None:
                deadline = rw.spec.options.max_batch_seconds
                seen = owned.fresh_overruns(0.5) if self.watched else owned.overruns
                if overruns.fire_timers(rw, seen, lambda ids: self.progress.batch(
                        owned.node, owned.range_id, owned.token, deadline, ids=ids),  # noqa: B023 - called at once
                        self.shared.input_wms.get(owned.node, MIN_TIMESTAMP), lambda txn: self._commit(owned, txn)):
                    self.shared.hb_wake.set()
                    moved += 1
                rw.expire_record_ids()
            while len(owned.slices) < self.max_slices and time.monotonic() >= owned.retry_at:
                assert owned.outbox is not None
                entries = plan(owned.outbox, owned.consumers, self.batch_size, self.shared.unit_of,
                               keep=self.batch_size, chunk=max(self.batch_size, self.max_injector_outbox // 2))
                if not entries:
                    break
                s = Slice(time.monotonic(), entries)
                owned.slices.append(s)
                planned.append(s)
        # Sent without the range's lock: deliveries into this range, injection and
        # heartbeats go on meanwhile; only this thread finishes the slices.
        for s in planned:
            moved += self._send(owned, s)
        return moved

    def sweep_links(self) -> list[str]:
        """Close the links to addresses that own no range now and wait for no ack
        (:meth:`~services.worker.delivery.PeerLinks.sweep`); returns those addresses."""
        return self.peers.sweep(self.shared.owners.values())

    def _send(self, owned: OwnedRange, s: Slice) -> int:
        """Deliver a planned slice: batches for other workers first, to their owner's
        link if it has room (else they are released for a later slice), so those
        workers process them while this one appends stream-log entries and processes
        the consumer ranges owned here in place. Returns the entries delivered or sent."""
        logs, groups, released = delivery.route(self.shared.topology, s.entries)
        for consumer in {p.consumer for p in released}:  # not registered: held, then parked
            owned.consumers.failed((consumer, UNKNOWN), "not a registered computation")
        busy = set().union(*(other.busy() for other in owned.slices if other is not s))
        blocked = owned.consumers.blocked(time.monotonic())  # failed since this slice was planned
        owners = self.shared.owners
        local: list[tuple[str, int, list[Production]]] = []
        for (consumer, range_id), items in groups.items():
            if (consumer, range_id) in blocked:
                released += items
                continue
            owner = owners.get((consumer, range_id))
            if owner is None or not owner.worker_id:  # that range alone waits for an owner
                owned.consumers.failed((consumer, range_id), "no owner")
                continue
            if (consumer, range_id) in busy:
                released += items  # one batch in flight per consumer range: keeps order
                continue
            if owner.worker_id == self.shared.worker_id:
                local.append((consumer, range_id, items))
                continue
            fut = self.peers.link(owner.address).try_send(
                delivery.batch(owned.node, consumer, range_id, items, self.shared.version))
            if fut is None:
                released += items  # no room at that destination: a later slice takes them
                continue
            fut.add_done_callback(lambda _f: self.shared.wake.set())
            s.remote.append((fut, items, owner.address, (consumer, range_id)))
            s.units.add((consumer, range_id))
        for stream, log_items in logs.items():
            self.store.append_log(stream, [p.record for p in log_items])  # idempotent by record id
            s.done_now += [(p.consumer, p.record.record_id) for p in log_items]
            self.sensors.delivered(owned.node, log_items)  # the console's edge rates
        for consumer, range_id, items in local:
            ack = self._process(consumer, range_id, [p.record for p in items], *delivery.inputs(items))
            if ack.status == pb.DeliverAck.OK:
                self.sensors.delivered(owned.node, items)
                s.done_now += [(p.consumer, p.record.record_id) for p in items]
                owned.consumers.succeeded((consumer, range_id))
            else:
                owned.consumers.failed((consumer, range_id), ack.message)
        if released:
            keys = {(p.consumer, p.record.record_id) for p in released}
            with owned.lock:
                s.entries = [p for p in s.entries if (p.consumer, p.record.record_id) not in keys]
                assert owned.outbox is not None
                owned.outbox.release(keys)
        s.sent = True
        return len(s.done_now) + sum(len(items) for _, items, _, _ in s.remote)

    def _check_overdue(self, owned: OwnedRange) -> None:
        now = time.monotonic()
        for s in owned.slices:
            if now - s.started > self.delivery_timeout_s:
                for fut, _, address, _ in s.remote:
                    if not fut.done():
                        self.peers.link(address).reset("a batch is overdue")

    def _finish(self, owned: OwnedRange, s: Slice) -> int:
        assert owned.outbox is not None
        acked = list(s.done_now)
        for fut, items, address, unit in s.remote:
            exc = fut.exception()
            if exc is None and fut.result().status == pb.DeliverAck.OK:
                acked += [(p.consumer, p.record.record_id) for p in items]
                self.sensors.delivered(owned.node, items)  # the console's edge rates
                owned.consumers.succeeded(unit)
            else:  # that consumer range alone backs off (services/worker/parking.py)
                message = str(exc) if exc is not None else fut.result().message
                owned.consumers.failed(unit, message)
                self.sensors.retry(address)
                log.debug("delivery to %s of %s/%d failed: %s", address, unit[0], unit[1], message)
        owned.slices.remove(s)
        if acked:
            owned.outbox.ack(owned.token, acked)  # no longer taken either
        if len(acked) < len(s.entries):  # what was not acked is sent again (if the ack failed: reset_slices)
            owned.outbox.release(s.keys())
        if acked:
            owned.changed()
            self.crash("after_ack")
            self.shared.hb_wake.set()
            owned.succeeded()  # the range-wide backoff after a pump failure is over
        return len(acked)
