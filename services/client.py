"""The Python client of a millwheel service; the CLI is built on it.

    from millwheel import Record
    from millwheel_service.client import ControllerClient   # `services.client` in a checkout

    with ControllerClient("127.0.0.1:7070") as mw:          # token/TLS from the environment
        mw.register(topology)                              # a millwheel.Topology, all or nothing
        mw.inject_records("clicks", records, done=True)    # backpressure handled, nothing resent twice
        for seq, record in mw.subscribe("counts"):
            ...
        mw.watermarks(); mw.state("counts", "ann"); list(mw.keys("counts")); mw.status()

gRPC failures come back as millwheel errors of the matching class (via
:mod:`services.status`: NotFoundError, InvalidSpecError, PermissionDeniedError, ...)
with the server's message and the gRPC status in ``.status`` (a ``grpc.StatusCode``),
so callers handle one kind of error whether the failure was local or remote.
"""

from __future__ import annotations

import os
import random
import threading
import time
from functools import partial
from typing import Any, Callable, Iterable, Iterator, TypeVar, cast

import grpc

from millwheel.errors import MillWheelError
from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.topology import Topology

from .generated import millwheel_pb2 as pb
from .generated import millwheel_pb2_grpc as pb_grpc
from .grpc_server import channel
from .security import Security, client_security
from .status import UnavailableError, error_class

DEFAULT_CONTROLLER = "127.0.0.1:7070"
T = TypeVar("T")




def controller_address(given: str | None = None) -> str:
    return given or os.environ.get("MILLWHEEL_CONTROLLER") or DEFAULT_CONTROLLER


class ControllerClient:
    def __init__(self, address: str | None = None, timeout_s: float = 30.0,
                 security: Security | None = None) -> None:
        """``security``: token and TLS settings (default: from the environment, see
        :func:`services.security.client_security`)."""
        self.address = controller_address(address)
        self.timeout_s = timeout_s
        self.security = security or client_security()
        self._channel = channel(self.address, self.security, self.security.client_token)
        self.stub = pb_grpc.ControllerStub(self._channel)
        self.busy_retries = 0  # Inject calls resent after a backpressure refusal

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as exc:
            raise self.error(exc) from None

    def error(self, exc: grpc.RpcError) -> MillWheelError:
        code = exc.code()
        err: MillWheelError
        if code == grpc.StatusCode.UNAVAILABLE:
            err = UnavailableError(f"controller {self.address}: {exc.details()} [UNAVAILABLE]")
        else:
            err = error_class(code)(f"{exc.details()} [{code.name}]")
        err.status = code  # type: ignore[attr-defined]
        return err

    # -- core types in, core types out ---------------------------------------------------
    def register(self, topology: Topology) -> pb.RegisterTopologyResponse:
        """Register a :class:`~millwheel.topology.Topology` (computations, injectors and
        log streams) all or nothing."""
        from .convert import spec_to_proto

        return self.register_topology([spec_to_proto(c) for c in topology.computations],
                                      [(i.name, i.stream) for i in topology.injectors],
                                      topology.log_streams)

    def inject_records(self, injector: str, records: Iterable[Record], *, stream: str = "",
                       batch: int = 500, max_disorder_us: int | None = 0, done: bool = False
                       ) -> pb.InjectResponse:
        """Inject core :class:`~millwheel.record.Record` objects through ``injector``
        (``stream`` registers it if new). The injector watermark follows the largest
        timestamp minus ``max_disorder_us`` (None: never moved); ``done`` closes it."""
        return self.inject(inject_messages(injector, stream, records, batch, max_disorder_us, done))

    # -- calls ---------------------------------------------------------------------------
    def register_computation(self, spec: pb.ComputationSpec, log_streams: Iterable[str] = ()
                             ) -> pb.RegisterComputationResponse:
        req = pb.RegisterComputationRequest(spec=spec, log_streams=list(log_streams))
        return self.call(lambda: self.stub.RegisterComputation(req, timeout=self.timeout_s))

    def register_topology(self, computations: Iterable[pb.ComputationSpec],
                          injectors: Iterable[tuple[str, str]], log_streams: Iterable[str] = ()
                          ) -> pb.RegisterTopologyResponse:
        """Register all of it or nothing (``injectors`` as ``(name, stream)``)."""
        req = pb.RegisterTopologyRequest(
            computations=list(computations), log_streams=list(log_streams),
            injectors=[pb.InjectorSpec(name=n, stream=s) for n, s in injectors])
        return self.call(lambda: self.stub.RegisterTopology(req, timeout=self.timeout_s))

    def register_injector(self, name: str, stream: str) -> pb.RegisterInjectorResponse:
        req = pb.RegisterInjectorRequest(spec=pb.InjectorSpec(name=name, stream=stream))
        return self.call(lambda: self.stub.RegisterInjector(req, timeout=self.timeout_s))

    def unregister(self, name: str) -> None:
        req = pb.UnregisterComputationRequest(name=name)
        self.call(lambda: self.stub.UnregisterComputation(req, timeout=self.timeout_s))

    def computations(self) -> pb.ListComputationsResponse:
        return self.call(lambda: self.stub.ListComputations(pb.ListComputationsRequest(),
                                                            timeout=self.timeout_s))

    def describe(self, computation: str) -> pb.ComputationInfo:
        req = pb.DescribeComputationRequest(name=computation)
        return self.call(lambda: self.stub.DescribeComputation(req, timeout=self.timeout_s))

    def replay_dead_letters(self, computation: str) -> pb.ReplayDeadLettersResponse:
        req = pb.ReplayDeadLettersRequest(computation=computation)
        return self.call(lambda: self.stub.ReplayDeadLetters(req, timeout=max(self.timeout_s, 120)))

    def watermarks(self, node: str = "") -> list[pb.NodeWatermark]:
        req = pb.GetWatermarkRequest(computation=node)
        return list(self.call(lambda: self.stub.GetWatermark(req, timeout=self.timeout_s)).watermarks)

    def state(self, computation: str, key: str) -> pb.GetStateResponse:
        req = pb.GetStateRequest(computation=computation, key=key)
        return self.call(lambda: self.stub.GetState(req, timeout=self.timeout_s))

    def keys(self, computation: str, page_size: int = 1000) -> Iterator[str]:
        token = ""
        while True:
            req = pb.ListKeysRequest(computation=computation, page_token=token, page_size=page_size)
            resp = self.call(partial(self.stub.ListKeys, req, timeout=self.timeout_s))
            yield from resp.keys
            token = resp.next_page_token
            if not token:
                return

    def status(self) -> pb.ClusterStatusResponse:
        return self.call(lambda: self.stub.ClusterStatus(pb.ClusterStatusRequest(),
                                                         timeout=self.timeout_s))

    def inject(self, messages: Iterable[pb.InjectRequest], *, busy_retry_s: float = 600.0,
               messages_per_call: int = 64) -> pb.InjectResponse:
        """Stream ``messages`` (each sent as soon as it is produced) in calls of up to
        ``messages_per_call`` messages.

        A call refused for backpressure (RESOURCE_EXHAUSTED with a ``retry-after-ms``
        hint: the injector's outbox is full) is resent from its first message not yet
        accepted, after the hint grown exponentially with jitter, for up to
        ``busy_retry_s``; nothing is lost or sent twice. An error raised while producing
        the messages (a bad input line) is raised as itself."""
        accepted = 0
        watermark = MIN_TIMESTAMP
        source = iter(messages)
        while True:
            feed = _CallFeed(source, messages_per_call)
            try:
                resp = self._inject_call(feed.messages(), feed.sent, busy_retry_s)
            except BaseException:
                feed.stop()
                if feed.failed is not None:
                    raise feed.failed from None
                raise
            accepted += resp.accepted
            if feed.sent:
                watermark = resp.watermark
            if feed.ended:
                return pb.InjectResponse(accepted=accepted, watermark=watermark)

    def _inject_call(self, first: Iterator[pb.InjectRequest], sent: list[pb.InjectRequest],
                     busy_retry_s: float) -> pb.InjectResponse:
        """One call fed by ``first`` (which appends what it yields to ``sent``); after a
        backpressure refusal, the messages not accepted are resent."""
        deadline = time.monotonic() + busy_retry_s
        accepted = 0
        attempt = 0
        requests, current = first, sent
        while True:
            try:
                resp = self.stub.Inject(requests, timeout=None)
                return pb.InjectResponse(accepted=accepted + resp.accepted, watermark=resp.watermark)
            except grpc.RpcError as exc:
                meta: dict[str, Any] = dict(cast(Any, exc.trailing_metadata()) or ())
                hint = meta.get("retry-after-ms")
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or hint is None \
                        or time.monotonic() > deadline:
                    raise self.error(exc) from None
                k = int(meta.get("accepted-messages", "0"))
                for _ in first:  # what the refused call had not consumed yet joins the resend
                    pass
                accepted += sum(len(m.records) for m in current[:k])
                current = current[k:]
                requests = iter(current)
                attempt = 0 if k else attempt + 1
                self.busy_retries += 1
                time.sleep(min(10.0, int(hint) / 1000 * 2 ** min(attempt, 4)) * random.uniform(0.5, 1.0))

    def subscribe(self, stream: str, after_seq: int = 0, follow: bool = False
                  ) -> Iterator[tuple[int, Record]]:
        req = pb.SubscribeRequest(stream=stream, after_seq=after_seq, follow=follow)
        try:
            for resp in self.stub.Subscribe(req):
                r = resp.record
                yield resp.seq, Record(r.key, bytes(r.value), r.timestamp, r.id)
        except grpc.RpcError as exc:
            raise self.error(exc) from None


class _CallFeed:
    """Feeds one Inject call from ``source``, up to ``limit`` messages, keeping what it
    yielded (for a resend) and whether the source ended or failed.

    gRPC pulls the messages on a thread of its own. After a failed call, :meth:`stop`
    makes that thread read nothing more and waits until it is out of ``source``: a
    process that exits while that thread holds stdin's buffer lock aborts at
    interpreter shutdown (``Fatal Python error: _enter_buffered_busy``)."""

    _END = object()

    def __init__(self, source: Iterator[pb.InjectRequest], limit: int) -> None:
        self.source = source
        self.limit = limit
        self.sent: list[pb.InjectRequest] = []
        self.failed: BaseException | None = None
        self.ended = False
        self._stopped = False
        self._idle = threading.Event()
        self._idle.set()

    def messages(self) -> Iterator[pb.InjectRequest]:
        while len(self.sent) < self.limit:
            self._idle.clear()
            try:
                if self._stopped:
                    return
                msg = next(self.source, self._END)
            except BaseException as exc:
                self.failed = exc
                raise
            finally:
                self._idle.set()
            if msg is self._END:
                self.ended = True
                return
            self.sent.append(cast(pb.InjectRequest, msg))
            yield cast(pb.InjectRequest, msg)

    def stop(self, wait_s: float = 5.0) -> None:
        self._stopped = True
        self._idle.wait(wait_s)


def inject_messages(
    injector: str, stream: str, records: Iterable[Record], batch: int = 500,
    max_disorder_us: int | None = 0, done: bool = False,
) -> Iterator[pb.InjectRequest]:
    """Batches of records as Inject messages. Each message carries the watermark
    ``max timestamp so far - max_disorder_us`` (none if ``max_disorder_us`` is None);
    ``done`` ends with ``done=true`` (no more records, ever: the injector is closed)."""
    max_seen = MIN_TIMESTAMP
    buf: list[pb.Record] = []

    def message(final: bool) -> pb.InjectRequest:
        msg = pb.InjectRequest(injector=injector, stream=stream, records=buf)
        if final and done:
            msg.done = True
        elif max_disorder_us is not None and max_seen > MIN_TIMESTAMP:
            msg.watermark = max_seen - max_disorder_us
        return msg

    for rec in records:
        buf.append(pb.Record(key=rec.key, value=rec.value, timestamp=rec.timestamp,
                             id=rec.record_id))
        max_seen = max(max_seen, rec.timestamp)
        if len(buf) >= batch:
            yield message(False)
            buf = []
    yield message(True)
