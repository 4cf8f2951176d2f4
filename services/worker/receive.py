"""The worker's receiving side: the Worker service's Deliver servicer, the ordering of
injection messages (an Inject session's messages are applied in order), injecting into
an injector's outbox, and processing a batch for an owned range (steps 1-3 of the
exactly-once sequence; the ack is step 4), weak productions included.

:class:`Receiver` is a part of :class:`services.worker.service.WorkerProcess`, which
hands it the state shared by its parts (:class:`~services.worker.shared.Shared`) and the
calls back into range ownership (fencing, dropping and building a range); the sending
side, :mod:`services.worker.send`, is handed this part's ``process``, ``commit`` and
``rebuild``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import grpc

from millwheel.clock import SystemClock
from millwheel.errors import FencedError, UserCodeError
from millwheel.keys import misrouted
from millwheel.nodes import is_injector, name_of
from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.runtime import poison
from millwheel.runtime.context import RangeTransaction
from millwheel.runtime.range_worker import CrashHook, RangeWorker
from millwheel.state.protocol import Production, StateStore
from millwheel.topology import Productions

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from ..rpc.server import Malformed
from . import delivery, overruns
from .delivery import PeerLinks
from .failing import RangeFailures
from .parking import park_failing
from .progress import NoProgress, ProgressBlock
from .shared import Shared
from .units import OwnedRange

log = logging.getLogger("millwheel.worker")
Unit = tuple[str, int]


class Receiver:
    """Inject and Deliver into the ranges this worker owns."""

    def __init__(
        self, shared: Shared, peers: PeerLinks, store: StateStore, failures: RangeFailures, *,
        clock: SystemClock, crash: CrashHook, progress: ProgressBlock | NoProgress, watched: bool,
        batch_size: int, max_injector_outbox: int, weak_wait_s: float,
        fenced: Callable[[OwnedRange, FencedError], None], drop: Callable[[OwnedRange, str], None],
        new_range_worker: Callable[[str, int, int], RangeWorker],
    ) -> None:
        """``watched``: user code runs under the watchdog's deadline (services/worker/watchdog.py);
        ``fenced``, ``drop`` and ``new_range_worker``: range ownership's, in services/worker/service.py."""
        self.shared = shared
        self.peers = peers
        self.store = store
        self.failures = failures
        self.clock = clock
        self.crash = crash
        self.progress = progress
        self.watched = watched
        self.batch_size = batch_size
        self.max_injector_outbox = max_injector_outbox
        self.weak_wait_s = weak_wait_s
        self._fenced = fenced
        self._drop = drop
        self._new_range_worker = new_range_worker
        # (injector node, range, Inject session) -> last message accepted, for in-order injection
        self._inject_seqs: OrderedDict[tuple[str, int, str], int] = OrderedDict()

    def inject_order(self, batch: pb.DeliverBatch) -> pb.DeliverAck | None:
        """A refusal if this injection message's predecessor was not accepted here (the
        controller then resends from the first refused one, one at a time)."""
        key = (batch.computation, batch.range_id, batch.inject_session)
        with self.shared.units_lock:
            last = self._inject_seqs.get(key)
            if last is None or batch.inject_resync:
                last = self._inject_seqs[key] = batch.inject_seq - 1
                self._inject_seqs.move_to_end(key)
                while len(self._inject_seqs) > 4096:
                    self._inject_seqs.popitem(last=False)
        if batch.inject_seq > last + 1:
            return pb.DeliverAck(status=pb.DeliverAck.FAILED,
                                 message=f"injection message {batch.inject_seq} is out of order "
                                         f"(last accepted {last})")
        return None

    def injected_in_order(self, batch: pb.DeliverBatch) -> None:
        key = (batch.computation, batch.range_id, batch.inject_session)
        with self.shared.units_lock:
            self._inject_seqs[key] = max(self._inject_seqs.get(key, 0), batch.inject_seq)

    def inject(self, node: str, range_id: int, records: list[Record], watermark: int | None) -> pb.DeliverAck:
        """Injected records (from the controller, or a client writing straight to this
        worker: services/worker/ingest.py) to their consumers: delivered at once when the
        range's outbox is empty, and what was not acked in time checkpointed into the
        outbox of the injector's range ``range_id`` (with the watermark) before the ack."""
        owned = self.shared.units.get((node, range_id))
        name = name_of(node)
        spec = self.shared.topology.injector(name)
        stream = spec.stream if spec is not None else None
        if owned is None or not owned.is_injector or stream is None:
            return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER,
                                 message=f"{self.shared.worker_id} does not own {node}/{range_id}")
        with owned.lock:
            if owned.dropped:
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER,
                                     message=f"range moved{self._fenced_note((node, range_id))}")
            outbox = owned.outbox
            assert outbox is not None
            if outbox.in_memory() >= self.max_injector_outbox:
                # A failing consumer's share waits in the store (services/worker/parking.py);
                # then the limit counts what the healthy consumers have not taken yet.
                park_failing(outbox, owned.consumers, self.shared.unit_of, self.batch_size)
            if outbox.in_memory() >= self.max_injector_outbox:
                # Backpressure: the pipeline drains this outbox slower than it fills.
                return pb.DeliverAck(
                    status=pb.DeliverAck.BUSY, watermark=owned.injector_wm,
                    message=f"injector {name!r} is busy: {outbox.in_memory()} records wait in its "
                            f"outbox for its consumers (limit {self.max_injector_outbox})")
            productions = [p for r in records for p in self.shared.router.fan_out(stream, r)]
            if productions and not len(outbox):
                # Delivered now, as weak productions are (commit, below): the sender holds
                # the records until this ack, so only what no consumer acked in time needs
                # the outbox (a store write and delete a record saved). A crash before the
                # ack makes the sender resend; consumers drop the IDs they have.
                productions = self._deliver_weak(node, productions)
            try:
                owned.inject(productions, watermark, self.clock.now_us())
            except FencedError as exc:
                self._fenced(owned, exc)
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message=str(exc))
            self.crash("after_inject")
            self.shared.wake.set()
            if watermark is not None:
                self.shared.hb_wake.set()
            return pb.DeliverAck(status=pb.DeliverAck.OK, watermark=owned.injector_wm)

    def commit(self, owned: OwnedRange, txn: RangeTransaction) -> None:
        """Step 3. With weak productions the outputs are sent first and only those not
        acked within ``weak_wait_s`` are checkpointed (into the outbox, resent by the
        pump); the caller holds the range's lock throughout, so the range's watermark
        report waits until the outputs are delivered or checkpointed. A crash before
        the checkpoint makes the sender resend the input: the code runs again and its
        outputs, under the same derived IDs, are dropped downstream as duplicates.
        While older outputs wait in the outbox, newer ones are checkpointed behind them
        (as strong productions), so consumers see them in production order."""
        rw = owned.worker
        assert rw is not None
        assert owned.outbox is not None
        if txn.productions and rw.spec.options.productions is Productions.WEAK and not len(owned.outbox):
            txn.productions = self._deliver_weak(owned.node, txn.productions)
            self.crash("after_weak_send")
        rw.commit(txn)
        owned.changed()

    def _deliver_weak(self, producer: str, productions: list[Production]) -> list[Production]:
        """Deliver ``productions`` now; returns those not acked in time (to checkpoint)."""
        logs, groups, slow = delivery.route(self.shared.topology, productions)
        for stream, items in logs.items():
            self.store.append_log(stream, [p.record for p in items])
            self.peers.sensors.delivered(producer, items)  # the console's edge rates
        waiting = []
        deadline = time.monotonic() + self.weak_wait_s
        for (consumer, range_id), items in groups.items():
            owner = self.shared.owners.get((consumer, range_id))
            if owner is None or not owner.worker_id:
                slow += items
            elif owner.worker_id == self.shared.worker_id:
                ack = self.process(consumer, range_id, [p.record for p in items], *delivery.inputs(items))
                if ack.status != pb.DeliverAck.OK:
                    slow += items
                else:
                    self.peers.sensors.delivered(producer, items)
            else:
                message = delivery.batch(producer, consumer, range_id, items, self.shared.version)
                fut = self.peers.link(owner.address).send(message, max(0.0, deadline - time.monotonic()))
                if fut is None:
                    slow += items
                else:
                    waiting.append((fut, items))
        for fut, items in waiting:
            try:
                ack = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                if ack.status != pb.DeliverAck.OK:
                    slow += items
                else:
                    self.peers.sensors.delivered(producer, items)
            except Exception:  # a timeout or a broken link: slow to be acked
                slow += items
        return slow

    def _fenced_note(self, unit: Unit) -> str:
        """Why a range is no longer ours, when its store writes were fenced: a sender (or
        an operator reading the ack) learns that a newer owner holds it, not just that we
        do not (a zombie's refusal reads the same whichever of its threads hit the fence
        first: the pump's checkpoint or this batch's)."""
        tokens = [t for n, r, t in self.shared.fenced_tokens if (n, r) == unit]
        return f": fenced (its token {max(tokens)} was superseded: the range moved)" if tokens else ""

    def process(self, computation: str, range_id: int, records: list[Record],
                streams: Sequence[str] = (), stream_of: Sequence[int] = ()) -> pb.DeliverAck:
        """Steps 1-3 for a batch addressed to one of our ranges; the ack is step 4.
        ``streams`` and ``stream_of``: the input streams the records came on, as
        ``DeliverBatch`` carries them (:func:`services.worker.delivery.inputs`); the
        batch is processed in one part per stream, its late records counted under it."""
        unit = (computation, range_id)
        owned = self.shared.units.get(unit)
        if owned is None or owned.worker is None:
            f = self.failures.get(unit)  # one of ours that cannot be built: say why
            return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message=(
                f"{self.shared.worker_id} does not own {computation}/{range_id}{self._fenced_note(unit)}"
                if f is None else
                f"{computation}/{range_id} is failing on {self.shared.worker_id} ({f.stage}): {f.message}"))
        if unit in self.failures and not self.failures.due(unit):
            f = self.failures.get(unit)  # retried after its backoff, not at every sender's pace
            return pb.DeliverAck(status=pb.DeliverAck.FAILED, message=(
                f"{computation}/{range_id} is failing ({f.stage}): {f.message}" if f else "failing"))
        with owned.lock:
            if owned.dropped or owned.worker is None:
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message=f"range moved{self._fenced_note(unit)}")
            rw = owned.worker
            stray = misrouted(records, range_id, rw.spec.options.key_ranges)
            if stray is not None:  # routed under another key-range count (a rescale): not taken here
                current = self.store.current_token(computation, range_id)
                if current != owned.token:  # a zombie says so, as its checkpoint would
                    self._fenced(owned, FencedError(computation, range_id, owned.token, current))
                    return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER,
                                         message=f"range moved{self._fenced_note(unit)}")
                return pb.DeliverAck(status=pb.DeliverAck.FAILED, message=(
                    f"{computation}/{range_id}: {stray}; the sender's registry is older or newer than "
                    f"{self.shared.worker_id}'s (version {self.shared.version}): sent again once both have the same"))
            try:
                # Records that overran their deadline before run alone; see services/worker/overruns.py.
                seen = owned.fresh_overruns() if self.watched else owned.overruns
                segments, refused = overruns.plan(records, seen) if seen else ([records], [])
                if refused:  # overran alone: the error policy gives them up without running
                    refused = overruns.hand_to_policy(rw, refused, seen)
                    if not refused:  # they go in line with the rest; suspects still run alone
                        segments = overruns.plan(records, {i: v for i, v in seen.items() if not v["alone"]})[0]
                wm = self.shared.input_wms.get(computation, MIN_TIMESTAMP)
                inputs = delivery.Inputs(records, streams, stream_of, {i.stream for i in rw.spec.inputs})
                for segment in segments:  # the error policy isolates failing records (fail: raises)
                    for stream, part in inputs.split(segment):
                        with self.progress.batch(computation, range_id, owned.token,
                                                 rw.spec.options.max_batch_seconds, part):
                            poison.process_batch(rw, part, wm, lambda txn: self.commit(owned, txn), stream)
                if refused:  # on_error "fail": refused, visibly, never run again
                    raise overruns.exceeded(computation, range_id, refused[0], seen)
            except FencedError as exc:
                self._fenced(owned, exc)
                return pb.DeliverAck(status=pb.DeliverAck.NOT_OWNER, message=str(exc))
            except UserCodeError as exc:  # logged (rate-limited) and rolled back by the policy
                return pb.DeliverAck(status=pb.DeliverAck.FAILED, message=str(exc))
            except Exception as exc:  # noqa: BLE001 - the store, or a bug: this range's failure
                self.failures.failed(unit, "checkpoint", exc)
                self.rebuild(owned)
                return pb.DeliverAck(status=pb.DeliverAck.FAILED, message=str(exc))
        self.failures.succeeded(unit)
        self.shared.wake.set()
        return pb.DeliverAck(status=pb.DeliverAck.OK)

    def rebuild(self, owned: OwnedRange) -> None:
        """After a failure outside user code the in-memory cache may hold half a batch
        (timers popped, state changed): rebuild the range from the store. If even that
        fails, let the range go here; it is taken again once its retry is due (the
        caller holds its lock)."""
        if owned.worker is None:
            return
        unit = (owned.node, owned.range_id)
        try:
            owned.worker = self._new_range_worker(owned.node, owned.range_id, owned.token)
        except Exception as exc:  # noqa: BLE001 - its store: the range's failure
            self.failures.failed(unit, "build", exc)
            self._drop(owned, f"cannot be rebuilt from the store: {exc}")
            return
        owned.outbox = owned.worker.outbox
        owned.consumers.parked_under = None
        owned.reset_slices()
        owned.changed()


class DeliverServicer:
    """The Worker service: batches in on a bidirectional stream, one ack per batch."""

    def __init__(self, receiver: Receiver, shared: Shared) -> None:
        self.receiver = receiver
        self.shared = shared

    def Deliver(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.DeliverAck]:
        for batch in request_iterator:
            if isinstance(batch, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"malformed {batch.what} message: {batch.error}")
            if batch.inject_session:
                refusal = self.receiver.inject_order(batch)
                if refusal is not None:
                    refusal.batch_id = batch.batch_id
                    yield refusal
                    continue
            if batch.topology_version > self.shared.version:
                yield pb.DeliverAck(batch_id=batch.batch_id, status=pb.DeliverAck.FAILED,
                                    message=f"registry version {batch.topology_version} not yet "
                                            f"known here (have {self.shared.version})")
                continue
            records = convert.records_from_proto(batch.records)
            if is_injector(batch.computation):
                wm = batch.watermark if batch.HasField("watermark") else None
                ack = self.receiver.inject(batch.computation, batch.range_id, records, wm)
                if batch.inject_session and ack.status == pb.DeliverAck.OK:
                    self.receiver.injected_in_order(batch)
            else:
                ack = self.receiver.process(batch.computation, batch.range_id, records,
                                            batch.streams, batch.stream_of)
            ack.batch_id = batch.batch_id
            yield ack
