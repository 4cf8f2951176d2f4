"""The controller's Inject path: validating each message, registering an injector on
first use, handing batches over to the worker owning the injector (kept-open Deliver
streams, a window of messages in flight, retries and backpressure) and counting what
was accepted.

:class:`Injection` is the part; :class:`WorkerLinks` the links it (and the dead-letter
replay) hands batches over on.
"""

from __future__ import annotations

import random
import secrets
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Iterator, cast

import grpc

from millwheel.errors import InvalidSpecError, MillWheelError, NotFoundError
from millwheel.nodes import injector_node
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.topology import InjectorSpec

from ..generated import millwheel_pb2 as pb
from ..inject_limits import InjectLimits
from ..rpc.server import check
from ..rpc.status import BusyError, PreconditionError, UnavailableError, code_for
from ..rpc.worker_link import LinkError, PeerLink
from .ha import Leadership
from .inject_split import split
from .plane import ControlPlane
from .replay import Replayer

Ctx = grpc.ServicerContext

INJECT_WINDOW = 4  # messages of one Inject call in flight to the injector's owner
BUSY_RETRY_MS = 500  # the retry hint of an Inject refused for backpressure
INJECT_BATCH = 5000  # larger Inject messages go to the injector's owner in pieces this big


class WorkerLinks:
    """The controller's kept-open links to workers (the Inject path's and the dead-letter
    replay's), guarded by the plane's lock."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.links: dict[str, PeerLink] = {}

    def link(self, address: str) -> PeerLink:
        """The kept-open link to ``address``. Opening one first closes the idle links
        to addresses no live worker has now: a worker restarted comes back at another
        port, so without this every address ever injected to would keep its channel
        and reader thread for the life of the controller."""
        p = self.plane
        with p.lock:
            link = self.links.get(address)
            if link is None:
                live = {w.address for w in p.assigner.workers.values() if w.alive}
                for old in [a for a, k in self.links.items() if a not in live and k.idle()]:
                    self.links.pop(old).close()
                    if p.sensors is not None:
                        p.sensors.forget_destination(old)
                link = self.links[address] = PeerLink(address, 32, p.sensors)
            return link


@dataclass(frozen=True)
class InjectSettings:
    """How the Inject path hands records over."""

    limits: InjectLimits  #: per-message limits (services/inject_limits.py)
    batch: int = INJECT_BATCH  #: larger messages go to the injector's owner in pieces this big
    timeout_s: float = 15.0  #: a hand-over retried (to whoever owns the injector) this long
    wait_s: float = 10.0  #: a message held under backpressure this long before BUSY


class Injection:
    """The Inject RPC and its hand-over to the injector's owner; the dead-letter replay,
    the other way records enter the service. Constructed with the plane, the leadership
    part (a standby forwards Inject), the links to workers and its settings."""

    def __init__(self, plane: ControlPlane, leadership: Leadership, links: WorkerLinks,
                 settings: InjectSettings) -> None:
        self.plane = plane
        self.leadership = leadership
        self.links = links
        self.settings = settings
        self.replayer = Replayer(plane, links.link)
        self._closed: set[str] = set()  # injectors seen closed (a watermark never goes back)

    def injector_for(self, msg: Any, where: str, key_ranges: int | None = None) -> InjectorSpec:
        """The injector ``msg.injector`` (its ``stream`` checked), registered on first use
        when ``msg.stream`` names a consumed stream, with ``key_ranges`` (None: 1 for
        ``Inject``; InjectRoutes asks for the most of its stream's consumers')."""
        if not msg.injector:
            raise InvalidSpecError(f"{where}: 'injector' (the injector name) is required")
        # Fast path without the controller's lock (heartbeats hold it): the registry's
        # topology is replaced whole on every change, so this reads one version of it.
        registry = self.plane.registry
        known = registry.injector(msg.injector)
        if known is not None and (not msg.stream or msg.stream == known.stream):
            return known
        with registry.changing:  # registry changes one at a time, never under the controller's lock
            existing = registry.injector(msg.injector)
            if existing is not None:
                if msg.stream and msg.stream != existing.stream:
                    raise InvalidSpecError(
                        f"{where}: injector {msg.injector!r} writes stream {existing.stream!r}, "
                        f"not {msg.stream!r}")
                return existing
            if not msg.stream:
                raise NotFoundError(
                    f"{where}: no injector named {msg.injector!r}; register it or name its 'stream'")
            topo = registry.topology
            consumers = topo.consumers(msg.stream)
            if not consumers:
                raise NotFoundError(
                    f"{where}: no registered computation consumes stream {msg.stream!r}")
            ranges = key_ranges or max(c.options.key_ranges for c, _ in consumers)
            spec = InjectorSpec(msg.injector, msg.stream, key_ranges=ranges)
            registry.register_injector(spec)
            self.plane.after_registration()
            return spec

    def _check_open(self, spec: InjectorSpec, msg: Any, index: int) -> None:
        """Records for an injector an earlier Inject closed (``done``: its watermark is
        +inf) would be late for every computation downstream: refused with
        FAILED_PRECONDITION, the message unsent. A message that itself says ``done`` is
        let through (the close, or a resend of it after a controller failover). The
        watermark read is the one the injector's owner last reported (within about a
        heartbeat of the close)."""
        if not msg.records or msg.done:
            return
        node = injector_node(spec.name)
        if node not in self._closed:
            stored = self.plane.store.read_watermarks(node)
            if len(stored) < spec.key_ranges or min(stored.values()) < MAX_TIMESTAMP:
                return
            self._closed.add(node)
        raise PreconditionError(
            f"inject message {index}: injector {spec.name!r} is closed: an earlier Inject said done, "
            "so its watermark is +inf and these records would be late for every computation; "
            "send them through an injector of another name")

    def _inject_batch(self, spec: InjectorSpec, msg: Any, index: int, session: str) -> pb.DeliverBatch:
        """Validate one message whole and make it the batch the worker owning the injector
        checkpoints into the injector's outbox (the range's only writer). Records without
        an ID get ``INJECTOR/MESSAGE/INDEX``: fixed before the first attempt, so a retried
        hand-over is deduplicated downstream. The records are forwarded as they came
        (validated in place, not rebuilt)."""
        missing = self.settings.limits.check_message(msg, index, self.plane.clock.now_us())
        batch = pb.DeliverBatch(computation=injector_node(spec.name), range_id=0,
                                topology_version=self.plane.registry.version,
                                inject_session=session, inject_seq=index + 1)
        batch.records.extend(msg.records)
        if missing:
            message_id = secrets.token_hex(8)
            for j in missing:
                batch.records[j].id = f"{spec.name}/{message_id}/{j}"
        if msg.HasField("watermark") or msg.done:
            batch.watermark = MAX_TIMESTAMP if msg.done else msg.watermark
        return batch

    def owner_address(self, node: str, range_id: int = 0) -> str | None:
        """The address of the live worker owning ``node``'s range ``range_id``, if any.
        Read without the lock (a stale owner answers NOT_OWNER and we retry)."""
        assigner = self.plane.assigner
        owner = assigner.units.get((node, range_id))
        worker = assigner.workers.get(owner.worker_id or "") if owner else None
        return worker.address if worker is not None and worker.alive else None

    def hand_over(self, node: str, batch: pb.DeliverBatch) -> pb.DeliverAck:
        """One batch to the owner of ``node``'s range ``batch.range_id`` over a kept-open Deliver stream,
        retried (to whoever owns it by then) until acked or ``inject_timeout_s``. Sent
        alone, after every earlier message of its call was acked: it resyncs the
        worker's ordering of the call."""
        batch.inject_resync = True
        sensors, stop, settings = self.plane.sensors, self.plane.stop, self.settings
        deadline = time.monotonic() + settings.timeout_s
        problem = "no live worker owns it yet"
        busy_since: float | None = None
        busy_waits = 0
        while True:
            address = self.owner_address(node, batch.range_id)
            if address:
                link = self.links.link(address)
                fut = link.send(batch, wait_s=10)
                try:
                    if fut is None:
                        problem = f"worker {address}: too many injections in flight"
                    else:
                        ack = fut.result(timeout=10)
                        if ack.status == pb.DeliverAck.OK:
                            if busy_since is not None and sensors is not None:
                                sensors.backpressure(node, time.monotonic() - busy_since)
                            return ack
                        if ack.status == pb.DeliverAck.BUSY:
                            # Backpressure: hold the message (and so the client's stream)
                            # until the outbox drains, then give up with a retry hint.
                            now = time.monotonic()
                            busy_since = now if busy_since is None else busy_since
                            if now - busy_since >= settings.wait_s or stop.is_set():
                                if sensors is not None:
                                    sensors.backpressure(node, now - busy_since)
                                raise BusyError(f"{ack.message}; retry later", BUSY_RETRY_MS)
                            busy_waits += 1
                            time.sleep(min(0.2, 0.005 * 2 ** min(busy_waits, 6)) * random.uniform(0.5, 1.0))
                            deadline = time.monotonic() + settings.timeout_s
                            continue
                        problem = f"worker {address}: {ack.message}"
                except LinkError as exc:
                    problem = f"worker {address}: {exc}"
                except FutureTimeout:
                    link.reset("an injection is overdue")
                    problem = f"worker {address}: no answer within 10 s"
            if time.monotonic() > deadline or stop.is_set():
                raise UnavailableError(f"cannot inject into {node}: {problem}")
            time.sleep(0.05)

    def inject(self, request_iterator: Iterator[Any], context: Ctx) -> pb.InjectResponse:
        """Each message is validated whole before it is sent (a bad message adds nothing)
        and checkpointed into the injector's outbox before it counts as accepted. Up to
        ``INJECT_WINDOW`` messages are in flight at once on one ordered stream; the worker
        takes a message only after its predecessor, so after any refusal the rest are
        handed over one by one from the first refused message, in order. A standby
        forwards the call to the leader as it comes (services/controller/ha.py)."""
        p = self.plane
        if not p.leading():
            try:
                return cast(pb.InjectResponse, self.leadership.forward_stream("Inject", request_iterator, context))
            except MillWheelError as exc:
                context.abort(code_for(exc), str(exc))
        call = _InjectCall(self, secrets.token_hex(8))
        try:
            for index, msg in enumerate(request_iterator):
                check(msg)
                self.settings.limits.check_names(msg, index)
                if p.assigner.stopped:  # services/controller/savepoint.py
                    raise PreconditionError(f"inject message {index}: this service was stopped with a savepoint "
                                            "and takes no more records; restore the savepoint elsewhere")
                if p.assigner.draining:  # services/controller/drain.py
                    raise PreconditionError(f"inject message {index}: this service is draining (savepoint "
                                            "create --drain): it takes no more records, and its injectors "
                                            "are closed")
                spec = self.injector_for(msg, f"inject message {index}", key_ranges=1)
                self._check_open(spec, msg, index)
                call.send(spec, self._inject_batch(spec, msg, index, call.session))
            call.settle(0)
        except MillWheelError as exc:
            try:
                call.settle(0)  # what was in flight before the bad message may still get in
            except MillWheelError:
                pass
            note = f" ({call.accepted} records of earlier messages were accepted)" if call.accepted else ""
            if isinstance(exc, BusyError):
                context.set_trailing_metadata((("retry-after-ms", str(exc.retry_after_ms)),
                                               ("accepted-messages", str(call.messages))))
            context.abort(code_for(exc), f"{exc}{note}")
        return pb.InjectResponse(accepted=call.accepted, watermark=call.watermark)


    def replay_dead_letters(self, request: Any, context: Ctx) -> pb.ReplayDeadLettersResponse:
        """The dead letters of a computation handed to its ranges again
        (services/controller/replay.py); refused once the service takes no more records."""
        check(request)
        self.refuse_when_closed("ReplayDeadLetters")  # its records would come after the end
        return self.replayer.replay(request.computation, context)

    def refuse_when_closed(self, where: str) -> None:
        """FAILED_PRECONDITION once the service takes no more records (stopped with a
        savepoint, or draining): for the ways records enter besides Inject, whose
        refusals say more about each (services/controller/writers.py too)."""
        assigner = self.plane.assigner
        if assigner.stopped or assigner.draining:
            raise PreconditionError(f"{where}: this service is stopped with a savepoint or draining "
                                    "(savepoint create --drain) and takes no more records")


class _InjectCall:
    """The messages of one Inject call in flight to the injector's owner, in order."""

    def __init__(self, controller: Injection, session: str) -> None:
        self.controller = controller
        self.session = session
        self.accepted = 0  # records of the messages accepted, a prefix of the call
        self.messages = 0  # whole messages accepted (a large one goes in several pieces)
        self.seqs: dict[tuple[str, int], int] = {}  # (injector, range) -> pieces sent: taken in this order
        self._piece_records = 0
        self.watermark = MIN_TIMESTAMP
        self.inflight: deque[tuple[str, pb.DeliverBatch, Future[Any], bool]] = deque()

    def send(self, spec: InjectorSpec, message: pb.DeliverBatch) -> None:
        node = injector_node(spec.name)
        for batch, ends in split(message, self.controller.settings.batch, spec.key_ranges):
            unit = (node, batch.range_id)
            self.seqs[unit] = batch.inject_seq = self.seqs.get(unit, 0) + 1
            address = self.controller.owner_address(node, batch.range_id)
            fut = self.controller.links.link(address).try_send(batch) if address else None
            if fut is None:  # no owner yet, or no room: the careful path
                self.settle(0)
                self._count(batch, self.controller.hand_over(node, batch), ends)
                continue
            self.inflight.append((node, batch, fut, ends))
            self.settle(INJECT_WINDOW - 1)

    def settle(self, limit: int) -> None:
        """Take acks in order until at most ``limit`` messages are in flight (and any
        already answered); after a refusal, hand the rest over one by one."""
        while self.inflight and (len(self.inflight) > limit or self.inflight[0][2].done()):
            node, batch, fut, ends = self.inflight[0]
            try:
                ack = fut.result(timeout=10)
            except (LinkError, FutureTimeout):
                ack = None
            if ack is not None and ack.status == pb.DeliverAck.OK:
                self.inflight.popleft()
                self._count(batch, ack, ends)
                continue
            rest = list(self.inflight)
            self.inflight.clear()
            for _, _, later, _ in rest:  # the worker refuses those after a refused one
                try:
                    later.result(timeout=10)
                except Exception:  # noqa: BLE001 - resent below in any case
                    pass
            for n, b, _, e in rest:
                self._count(b, self.controller.hand_over(n, b), e)

    def _count(self, batch: pb.DeliverBatch, ack: pb.DeliverAck, ends_message: bool) -> None:
        self._piece_records += len(batch.records)
        self.watermark = ack.watermark
        if ends_message:  # only whole client messages count as accepted
            self.accepted += self._piece_records
            self.messages += 1
            self._piece_records = 0
