"""The Python client of a millwheel service; the CLI is built on it.

    from millwheel import Record
    from millwheel_service.client import ControllerClient   # `services.client` in a checkout

    with ControllerClient("10.0.0.1:7070,10.0.0.2:7070") as mw:  # token/TLS from the environment
        mw.register(topology)                              # a millwheel.Topology, all or nothing
        mw.inject_records("clicks", records, done=True)    # backpressure handled, nothing resent twice
        for seq, record in mw.subscribe("counts"):
            ...
        mw.watermarks(); mw.state("counts", "ann"); list(mw.keys("counts")); mw.status()

``watermarks()`` and ``state()`` answer with :mod:`millwheel.queries`' dataclasses;
the registry and status calls with the protocol's messages (docs/api.md).

gRPC failures come back as millwheel errors of the matching class (via
:mod:`services.rpc.status`: NotFoundError, InvalidSpecError, PermissionDeniedError, ...)
with the server's message and the gRPC status in ``.status`` (a ``grpc.StatusCode``),
so callers handle one kind of error whether the failure was local or remote.

Several controllers (``"a:7070,b:7070"``, as ``--controller`` and
``$MILLWHEEL_CONTROLLER`` take them): a call that fails with UNAVAILABLE or
DEADLINE_EXCEEDED, or that a controller does not even start within 1.5 s (a stopped
process), goes to the leader the failed controller named, else to the next address
(:mod:`services.rpc.controller_link`), for up to ``failover_s``; then an UnavailableError
names every address tried. Subscribe resumes after the last record it yielded; Inject
resends the messages of the broken call (see :meth:`ControllerClient.inject`). With a
single address and no leader named, a failure is raised at once, as it always was.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, Callable, Iterable, Iterator, TypeVar, cast

import grpc

from millwheel.connectors.spec import SinkSpec
from millwheel.errors import MillWheelError, NotFoundError
from millwheel.queries import KeyState, NodeWatermark
from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.topology import InjectorSpec, Topology

from .generated import millwheel_pb2 as pb
from .generated import millwheel_pb2_grpc as pb_grpc
from .inject_feed import CallFeed
from .inject_feed import inject_messages as inject_messages  # part of this module's API
from .rpc.admission import ended_idle
from .rpc.controller_link import SEVERAL_DEADLINE_S, ControllerLink, Tried, await_start, fails_over, leader_hint
from .rpc.convert import (
    injector_request_to_proto,
    key_state_from_proto,
    records_from_proto,
    sink_to_proto,
    spec_to_proto,
    watermark_from_proto,
)
from .rpc.security import Security, client_security
from .rpc.status import UnavailableError, error_class

DEFAULT_CONTROLLER = "127.0.0.1:7070"
SUBSCRIBE_BATCH = 5000  #: records a Subscribe message may carry, as the client asks (the controller caps it)
#: ``--controller`` of every command that calls a controller (clients and workers).
CONTROLLER_METAVAR = "HOST:PORT[,HOST:PORT...]"
CONTROLLER_HELP = ("the controller's address, or several comma-separated (a:7070,b:7070): calls "
                   "that find one down, stopped or a standby go to the leader it names, else the "
                   "next address (default $MILLWHEEL_CONTROLLER, which takes the same list, else "
                   f"{DEFAULT_CONTROLLER})")
T = TypeVar("T")


def controller_address(given: str | None = None) -> str:
    return given or os.environ.get("MILLWHEEL_CONTROLLER") or DEFAULT_CONTROLLER


class ControllerClient:
    def __init__(self, address: str | None = None, timeout_s: float = 30.0,
                 security: Security | None = None, failover_s: float = 30.0,
                 answer_s: float = SEVERAL_DEADLINE_S) -> None:
        """``address``: one controller or several, comma-separated (default
        ``$MILLWHEEL_CONTROLLER``, else 127.0.0.1:7070). ``security``: token and TLS
        settings (default: from the environment, see
        :func:`services.rpc.security.client_security`). ``failover_s``: how long a call
        keeps going from controller to controller before it gives up; ``answer_s``: with
        several addresses, how long a controller may take to start a call before the
        client moves on (a stopped controller accepts connections and answers nothing)."""
        self.security = security or client_security()
        self.link = ControllerLink(controller_address(address), self.security,
                                   self.security.client_token)
        self.addresses = self.link.addresses
        self.timeout_s = timeout_s
        self.failover_s = failover_s
        self.answer_s = answer_s
        self.busy_retries = 0  # Inject calls resent after a backpressure refusal
        self.failovers = 0  # calls (or streams) moved to another controller

    @property
    def address(self) -> str:
        """The controller calls go to now."""
        return self.link.current

    @property
    def stub(self) -> pb_grpc.ControllerStub:
        """The Controller stub of the current controller (one attempt, no failover)."""
        return self.link.stub(pb_grpc.ControllerStub)

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` (which calls ``self.stub``), moved to another controller and
        retried while it fails with UNAVAILABLE or DEADLINE_EXCEEDED and there is
        another to try, for up to ``failover_s``; other errors are raised at once."""
        return self._retrying(lambda _address: fn())

    def _retrying(self, fn: Callable[[str], T]) -> T:
        """:meth:`call` of ``fn(address)``, which calls the controller at ``address``."""
        tried = Tried(self.failover_s)
        while True:
            address = self.address
            try:
                result = fn(address)
            except grpc.RpcError as exc:
                self._fail_over(address, exc, tried)
                continue
            self.link.succeeded(address)
            return result

    def _fail_over(self, address: str, exc: grpc.RpcError, tried: Tried) -> None:
        """Switch to the next controller after ``exc`` on ``address``, or raise it (as a
        millwheel error) if it is not a failover status, there is nowhere to go, or
        the time is up."""
        hint = leader_hint(exc)
        if not fails_over(exc):
            raise self.error(exc) from None  # an answer (NOT_FOUND, ...), whoever gave it
        if not self.link.may_fail_over(address, hint):
            raise self.error(exc, tried) from None
        tried.add(address, exc)
        if tried.expired():
            raise self.error(exc, tried) from None
        self.failovers += 1
        _, wait = self.link.choose(address, hint)
        time.sleep(min(wait, tried.left()))

    def _unary(self, method: str, request: Any, timeout: float | None, gone_ok: bool = False) -> Any:
        """One unary call with failover; with several controllers, one that does not
        start it within ``answer_s`` is left for the next. ``gone_ok``: a NOT_FOUND
        after an attempt that failed over means an earlier attempt did it (None)."""
        uncertain = False

        def attempt(address: str) -> Any:
            nonlocal uncertain
            fn = getattr(self.link.stub(pb_grpc.ControllerStub, address), method)
            try:
                if not self.link.several:
                    return fn(request, timeout=timeout)
                fut = fn.future(request, timeout=timeout)
                await_start(fut, address, self.answer_s)
                return fut.result()
            except grpc.RpcError as exc:
                uncertain = uncertain or fails_over(exc)
                raise
        try:
            return self._retrying(attempt)
        except NotFoundError:
            if gone_ok and uncertain:
                return None
            raise

    def error(self, exc: grpc.RpcError, tried: Tried | None = None) -> MillWheelError:
        code = exc.code()
        err: MillWheelError
        if tried is not None and tried.failures:
            err = UnavailableError(f"{tried.describe(self.addresses)} [{code.name}]")
            code = grpc.StatusCode.UNAVAILABLE
        elif code == grpc.StatusCode.UNAVAILABLE:
            err = UnavailableError(f"controller {self.address}: {exc.details()} [UNAVAILABLE]")
        else:
            err = error_class(code)(f"{exc.details()} [{code.name}]")
        err.status = code  # type: ignore[attr-defined]
        return err

    # -- core types in, core types out ---------------------------------------------------
    def register(self, topology: Topology) -> pb.RegisterTopologyResponse:
        """Register a :class:`~millwheel.topology.Topology` (computations, injectors and
        log streams) all or nothing."""
        return self.register_topology([spec_to_proto(c) for c in topology.computations],
                                      list(topology.injectors), topology.log_streams, topology.sinks)

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
        return cast(pb.RegisterComputationResponse, self._unary("RegisterComputation", req, self.timeout_s))

    def register_topology(self, computations: Iterable[pb.ComputationSpec],
                          injectors: Iterable[tuple[str, str] | InjectorSpec], log_streams: Iterable[str] = (),
                          sinks: Iterable[SinkSpec] = ()) -> pb.RegisterTopologyResponse:
        """Register all of it or nothing (``injectors`` as ``(name, stream)`` or specs,
        the latter with their sources)."""
        injs = [injector_request_to_proto(InjectorSpec(*i) if isinstance(i, tuple) else i) for i in injectors]
        req = pb.RegisterTopologyRequest(
            computations=list(computations), log_streams=list(log_streams), injectors=injs,
            sinks=[sink_to_proto(s) for s in sinks])
        return cast(pb.RegisterTopologyResponse, self._unary("RegisterTopology", req, self.timeout_s))

    def register_injector(self, name: str, stream: str, key_ranges: int = 1) -> pb.RegisterInjectorResponse:
        req = pb.RegisterInjectorRequest(spec=pb.InjectorSpec(name=name, stream=stream, key_ranges=key_ranges))
        return cast(pb.RegisterInjectorResponse, self._unary("RegisterInjector", req, self.timeout_s))

    def unregister(self, name: str) -> None:
        """Unregister computation ``name``. NotFoundError if there is none; except when an
        earlier attempt of this call failed over (its answer lost: it may have taken
        effect), then NOT_FOUND is the state asked for and the call succeeds."""
        req = pb.UnregisterComputationRequest(name=name)
        self._unary("UnregisterComputation", req, self.timeout_s, gone_ok=True)

    def update(self, spec: pb.ComputationSpec | None, on_open_windows: str = "", rollback: str = "",
               reload: bool = False) -> pb.UpdateComputationResponse:
        """Change a running computation to ``spec`` (or roll ``rollback`` back to its
        previous version). Sending the running spec again changes nothing (a retry after
        a lost answer is safe); a rollback sent twice is refused the second time.
        ``reload``: the workers import the computation's user modules again, also for
        the running spec (a new version each time)."""
        req = pb.UpdateComputationRequest(on_open_windows=on_open_windows, rollback=rollback, reload=reload)
        if spec is not None:
            req.spec.CopyFrom(spec)
        return cast(pb.UpdateComputationResponse, self._unary("UpdateComputation", req, self.timeout_s))

    def rescale(self, computation: str, key_ranges: int) -> pb.RescaleComputationResponse:
        """Change ``computation``'s key-range count while it runs. Sending the same count
        again changes nothing (a retry after a lost answer is safe)."""
        req = pb.RescaleComputationRequest(computation=computation, key_ranges=key_ranges)
        return cast(pb.RescaleComputationResponse, self._unary("RescaleComputation", req, self.timeout_s))

    def computations(self) -> pb.ListComputationsResponse:
        return cast(pb.ListComputationsResponse,
                    self._unary("ListComputations", pb.ListComputationsRequest(), self.timeout_s))

    def describe(self, computation: str) -> pb.ComputationInfo:
        req = pb.DescribeComputationRequest(name=computation)
        return cast(pb.ComputationInfo, self._unary("DescribeComputation", req, self.timeout_s))

    def replay_dead_letters(self, computation: str, timeout_s: float | None = None
                            ) -> pb.ReplayDeadLettersResponse:
        """Replay the dead letters present now; the controller stops at ``timeout_s``
        (default the larger of the client's timeout and 120 s) and says how many remain."""
        req = pb.ReplayDeadLettersRequest(computation=computation)
        timeout = max(self.timeout_s, 120) if timeout_s is None else timeout_s
        return cast(pb.ReplayDeadLettersResponse, self._unary("ReplayDeadLetters", req, timeout))

    def watermarks(self, node: str = "") -> list[NodeWatermark]:
        req = pb.GetWatermarkRequest(computation=node)
        return [watermark_from_proto(w) for w in self._unary("GetWatermark", req, self.timeout_s).watermarks]

    def state(self, computation: str, key: str) -> KeyState:
        req = pb.GetStateRequest(computation=computation, key=key)
        return key_state_from_proto(computation, key, self._unary("GetState", req, self.timeout_s))

    def keys(self, computation: str, page_size: int = 1000) -> Iterator[str]:
        token = ""
        while True:
            req = pb.ListKeysRequest(computation=computation, page_token=token, page_size=page_size)
            resp = self._unary("ListKeys", req, self.timeout_s)
            yield from resp.keys
            token = resp.next_page_token
            if not token:
                return

    def inject_routes(self, request: pb.InjectRoutesRequest) -> pb.InjectRoutesResponse:
        """Where each key range of an injector is written (parallel ingestion:
        services/inject_writer.py)."""
        return cast(pb.InjectRoutesResponse, self._unary("InjectRoutes", request, self.timeout_s))

    def writer_watermark(self, request: pb.WriterWatermarkRequest) -> pb.WriterWatermarkResponse:
        """A writer's watermark, done, or keep-alive (services/inject_writer.py)."""
        return cast(pb.WriterWatermarkResponse, self._unary("WriterWatermark", request, self.timeout_s))

    def status(self) -> pb.ClusterStatusResponse:
        return cast(pb.ClusterStatusResponse,
                    self._unary("ClusterStatus", pb.ClusterStatusRequest(), self.timeout_s))

    def inject(self, messages: Iterable[pb.InjectRequest], *, busy_retry_s: float = 600.0,
               messages_per_call: int = 64) -> pb.InjectResponse:
        """Stream ``messages`` (each sent as soon as it is produced) in calls of up to
        ``messages_per_call`` messages.

        A call refused for backpressure (RESOURCE_EXHAUSTED with a ``retry-after-ms``
        hint: the injector's outbox is full) is resent from its first message not yet
        accepted, after the hint grown exponentially with jitter, for up to
        ``busy_retry_s``; nothing is lost or sent twice. A call broken by its controller
        (UNAVAILABLE, DEADLINE_EXCEEDED, or not started: killed, restarting, stopped) is
        resent to the next controller, every message of it not known to be accepted, for
        up to ``failover_s``: a message the broken controller had taken is then sent
        twice, which is a no-op downstream only because its records carry IDs (consumers
        drop a record ID they have seen). :func:`inject_messages` gives every record
        an ID before the first send; messages built otherwise should carry IDs too. A call
        the controller ended as idle (the messages came slower than its
        ``--stream-idle-timeout``: a quiet ``tail -f``) goes on in a new call the same way.
        An error raised while producing the messages (a bad input line) is raised as itself."""
        accepted = 0
        watermark = MIN_TIMESTAMP
        source = iter(messages)
        while True:
            feed = CallFeed(source, messages_per_call)
            try:
                resp = self._inject_call(feed, busy_retry_s)
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

    def _inject_call(self, feed: CallFeed, busy_retry_s: float) -> pb.InjectResponse:
        """One call fed by ``feed``; after a backpressure refusal, the messages not
        accepted are resent; after a failed controller, those not known to be accepted
        are resent to the next one."""
        busy_deadline = time.monotonic() + busy_retry_s
        tried = Tried(self.failover_s)
        accepted = 0
        attempt = 0
        done = 0  # messages of feed.sent known to be accepted
        requests: Iterator[pb.InjectRequest] = feed
        while True:
            address = self.address
            try:
                call = self.link.stub(pb_grpc.ControllerStub, address).Inject.future(requests, timeout=None)
                if self.link.several:
                    await_start(call, address, self.answer_s)
                resp = call.result()
                self.link.succeeded(address)
                return pb.InjectResponse(accepted=accepted + resp.accepted, watermark=resp.watermark)
            except grpc.RpcError as exc:
                if feed.failed is not None:
                    raise
                if ended_idle(exc):  # the source was quiet: go on in a new call
                    requests = feed.resume(done)
                    continue
                meta: dict[str, Any] = dict(cast(Any, exc.trailing_metadata()) or ())
                hint = meta.get("retry-after-ms")
                busy = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and hint is not None
                if not busy:
                    self._fail_over(address, exc, tried)  # raises unless another may serve it
                elif time.monotonic() > busy_deadline:
                    raise self.error(exc) from None
                feed.finish()  # what the failed call had not consumed yet joins the resend
                k = int(meta.get("accepted-messages", "0"))
                accepted += sum(len(m.records) for m in feed.sent[done:done + k])
                done += k
                requests = iter(feed.sent[done:])
                if busy:
                    attempt = 0 if k else attempt + 1
                    self.busy_retries += 1
                    time.sleep(min(10.0, int(cast(str, hint)) / 1000 * 2 ** min(attempt, 4)) * random.uniform(0.5, 1.0))

    def subscribe(self, stream: str, after_seq: int = 0, follow: bool = False, from_oldest: bool = False
                  ) -> Iterator[tuple[int, Record]]:
        """(seq, record) of ``stream`` after ``after_seq``. A stream broken by its
        controller (UNAVAILABLE), or one a controller does not start, goes on from the
        next controller after the last record yielded: none twice, none skipped (the
        positions are the store's, the same on every controller). So does one the
        controller ended because nothing was read from it for its ``--stream-idle-timeout``.
        A position removed by retention raises LogTrimmedError (OUT_OF_RANGE), unless
        ``from_oldest``."""
        for batch in self.subscribe_batches(stream, after_seq, follow, from_oldest):
            yield from batch

    def subscribe_batches(self, stream: str, after_seq: int = 0, follow: bool = False,
                          from_oldest: bool = False, max_batch: int = SUBSCRIBE_BATCH
                          ) -> Iterator[list[tuple[int, Record]]]:
        """:meth:`subscribe` a batch at a time, as the controller sends them (up to
        ``max_batch`` records; a batch is never held back to fill it): what a reader that
        writes its output a batch at a time wants (``millwheel subscribe``)."""
        after = after_seq
        tried = Tried(self.failover_s)
        while True:
            address = self.address
            began, got = time.monotonic(), False
            stub = self.link.stub(pb_grpc.ControllerStub, address)
            call = stub.Subscribe(pb.SubscribeRequest(stream=stream, after_seq=after, follow=follow,
                                                      from_oldest=from_oldest, max_batch=max_batch))
            try:
                if self.link.several:
                    await_start(call, address, self.answer_s)
                for resp in call:
                    if resp.seqs:  # a batch (SubscribeRequest.max_batch)
                        batch = list(zip(resp.seqs, records_from_proto(resp.records), strict=True))
                    else:  # one record: a controller from before max_batch
                        r = resp.record
                        batch = [(resp.seq, Record(r.key, bytes(r.value), r.timestamp, r.id))]
                    after, got = batch[-1][0], True
                    yield batch
                self.link.succeeded(address)
                return
            except grpc.RpcError as exc:
                if ended_idle(exc):  # we read nothing for a while: go on from the last record
                    continue
                if got or time.monotonic() - began > self.answer_s:
                    tried = Tried(self.failover_s)  # it worked for a while: a fresh failure
                self._fail_over(address, exc, tried)
            finally:
                call.cancel()

