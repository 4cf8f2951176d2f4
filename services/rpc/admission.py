"""Per-client admission on a client-facing gRPC server: bounded streams and calls, idle
streams ended.

How grpcio's sync server spends its threads (grpc/_server.py): one serving thread takes
each new call from the core, runs the interceptors (this one included) and submits
the handler to the server's thread pool; the pool thread then waits for the request
message (unary requests), runs the handler, and for a stream stays with the call until
it ends, blocking while it waits for a client message or while a response waits for
the client to read. A thread pool of N threads thus serves at most N calls at once and
queues the rest, whatever they are (heartbeats included, when they shared the pool).
``maximum_concurrent_rpcs`` refuses calls past a count on the serving thread, without
a pool thread, but with a fixed message ("Concurrent RPC limit exceeded!") and without
knowing the caller.

So admission is decided on a pool thread, first thing, before any request message is
read: every handler is re-shaped to take a request *stream* (a unary request is then
read by this module, under the idle clock), so a refused call takes a thread for
microseconds and never waits for its client. Admitted calls hold at most
``streams + calls`` threads; the pool has :data:`RESERVE_THREADS` more (see
:attr:`AdmissionLimits.threads`), so the decision, and the refusal, always find a
free thread. The caller is known only there (``context.peer()``: the interceptor
sees the method and metadata alone).

A **client** is the credential that names one (a named credential, ``millwheel
credentials create``, or a certificate mapped by ``--tls-role``): its limits are its
own, whatever address it calls from, so clients behind one proxy, ingress or sidecar
(one address) do not take each other's slots. Where no such credential is used (no
token, or a token every client shares: the client and operator tokens), a client is
the peer's host (IP address): the credential cannot tell clients apart, and a host is
what one misbehaving program cannot multiply cheaply. A call a standby controller
relays for a client (``millwheel-forwarded-for`` metadata, trusted only with the
cluster secret) counts for that client (the standby names it by :func:`client_key`).
Cluster calls (heartbeats) are not admitted here: they have a server
of their own (services/controller/cluster_port.py) and take the client port only for
a worker's first contact.

Limits (each refusal is RESOURCE_EXHAUSTED naming the limit and its flag): streams (any
call with a streaming request or response: Inject, Subscribe, health Watch,
reflection) and unary calls in flight, per client and in total. **Idle**: a stream (or
unary call) waiting for its client's next message, or a response waiting for its
client to read it, for ``idle_s`` is ended with DEADLINE_EXCEEDED saying so. A
follow-mode Subscribe waiting for new records is not idle (that is its purpose); it
holds a stream slot until its client leaves (a dead client is found by the server's
keepalive pings, services/rpc/server.py).
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc

from millwheel.errors import InvalidSpecError

from .auth import bearer_token, certificate_identity
from .roles import Identity
from .security import process

log = logging.getLogger("millwheel.admission")

#: Pool threads never taken by admitted calls: decisions, refusals, Cluster calls of a
#: worker's first contact, calls that outlive their slot for a moment.
RESERVE_THREADS = 8
#: Services never admitted here (cluster members only, and short: see the module doc).
EXEMPT_SERVICES = frozenset({"millwheel.v1.Cluster"})
#: A standby controller names the client it relays a call for (services/controller/ha.py).
FORWARDED_FOR = "millwheel-forwarded-for"
IDLE_FLAG = "--stream-idle-timeout"  # named by every idle end (clients recognise it)


def ended_idle(exc: grpc.RpcError) -> bool:
    """Whether a call failed because the controller ended it as idle: the client
    waited (or sent nothing) too long, nothing is wrong; go on in a new call."""
    try:
        return exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and IDLE_FLAG in (exc.details() or "")
    except Exception:  # noqa: BLE001 - an error that is not a finished call
        return False


@dataclass(frozen=True)
class AdmissionLimits:
    """Flags of ``millwheel controller`` (docs/service.md, Limits)."""

    client_streams: int = 32  #: --max-client-streams
    client_calls: int = 16  #: --max-client-calls
    streams: int = 128  #: --max-streams
    calls: int = 64  #: --max-calls
    idle_s: float = 60.0  #: --stream-idle-timeout

    def check(self) -> None:
        for flag, value in (("--max-client-streams", self.client_streams),
                            ("--max-client-calls", self.client_calls),
                            ("--max-streams", self.streams), ("--max-calls", self.calls)):
            if not 1 <= value <= 10_000:
                raise InvalidSpecError(f"{flag} must be 1..10000, got {value}")
        if self.client_streams > self.streams or self.client_calls > self.calls:
            raise InvalidSpecError("a per-client limit (--max-client-streams, --max-client-calls) "
                                   "cannot exceed its total (--max-streams, --max-calls)")
        if not (math.isfinite(self.idle_s) and 0.1 <= self.idle_s <= 86_400):
            raise InvalidSpecError(f"--stream-idle-timeout must be 0.1..86400 seconds, got {self.idle_s:g}")

    @property
    def threads(self) -> int:
        """The client pool's size: every admitted call, plus the reserve."""
        return self.streams + self.calls + RESERVE_THREADS


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.7:51234``, ``ipv6:%5B::1%5D:5123``)."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]") or rest
    return kind or peer  # unix sockets and the like: one client per kind


def client_key(context: grpc.ServicerContext,
               identify: Callable[[str | None], Identity | None] | None = None) -> str:
    """Whom a call counts for: ``credential NAME`` for a credential that names one client,
    else the peer's host. ``identify``: token -> credential (default: the process's)."""
    token = bearer_token(context.invocation_metadata() or ())
    sec = process()
    who = (identify or sec.identify)(token)
    if who is None and token is None and sec.cert_roles:
        who = certificate_identity(context, sec.roles_of_certificates())
    if who is not None and who.per_client:
        return f"credential {who.name}"
    return peer_host(context.peer())


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from another thread with ``code`` and ``details``. grpcio's servicer
    context has no public way (``abort`` only works in the handler's own thread and
    ``cancel`` says only CANCELLED): this cancels the core call with that status, which
    the client receives as such, and the handler's blocked read or send returns."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], details)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - another grpcio: end it without the message
        context.cancel()


class _Slot:
    """One admitted call: whose it is and where it waits (for the idle check)."""

    __slots__ = ("client", "stream", "method", "context", "waiting_since", "sending_since",
                 "executing", "ended", "released")

    def __init__(self, client: str, stream: bool, method: str, context: grpc.ServicerContext) -> None:
        self.client = client
        self.stream = stream
        self.method = method
        self.context = context
        self.waiting_since: float | None = None  # waiting for the client's next message
        self.sending_since: float | None = None  # a response waiting for the client to read it
        self.executing = True  # a pool thread is in the handler (it releases on the way out)
        self.ended = False  # the call is over (its callback ran)
        self.released = False


class _Requests:
    """The client's messages, with the idle clock running while one is awaited."""

    def __init__(self, requests: Iterator[Any], slot: _Slot) -> None:
        self._requests = requests
        self._slot = slot

    def __iter__(self) -> _Requests:
        return self

    def __next__(self) -> Any:
        self._slot.waiting_since = time.monotonic()
        try:
            return next(self._requests)
        finally:
            self._slot.waiting_since = None


class Admission(grpc.ServerInterceptor):
    """The interceptor (see the module doc); ``cluster_secret``: the token that makes
    a ``millwheel-forwarded-for`` name trusted."""

    def __init__(self, limits: AdmissionLimits, cluster_secret: str | None = None,
                 on_refused: Callable[[str, str], None] | None = None,
                 identify: Callable[[str | None], Identity | None] | None = None) -> None:
        """``identify``: a presented token -> its credential (default: the process's
        settings, services/rpc/security.py), to count a named credential's calls as its own."""
        limits.check()
        self.identify = identify
        self.on_refused = on_refused  # (limit's flag, method): the refusals metric
        self.limits = limits
        self.cluster_secret = cluster_secret
        self._lock = threading.Lock()
        self._open: dict[int, _Slot] = {}
        self._per_client: dict[tuple[bool, str], int] = {}
        self._total = {True: 0, False: 0}
        self.refused = 0
        self._last_log = 0.0
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="admission-idle", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        self._stop.set()

    # -- counting ---------------------------------------------------------------------
    def open_calls(self) -> dict[str, tuple[int, int]]:
        """client -> (streams, calls) open now (for status and tests)."""
        with self._lock:
            out: dict[str, tuple[int, int]] = {}
            for (stream, client), n in self._per_client.items():
                s, c = out.get(client, (0, 0))
                out[client] = (s + n, c) if stream else (s, c + n)
            return out

    def client_of(self, context: grpc.ServicerContext) -> str:
        if self.cluster_secret is not None:
            meta = context.invocation_metadata() or ()
            token = bearer_token(meta)
            if token is not None and hmac.compare_digest(token.encode(), self.cluster_secret.encode()):
                for key, value in meta:
                    if key == FORWARDED_FOR and isinstance(value, str) and value:
                        return value[:200]
        return client_key(context, self.identify)

    def _admit(self, stream: bool, method: str, context: grpc.ServicerContext) -> _Slot:
        client = self.client_of(context)
        what, unit = ("streams", "streams open") if stream else ("calls", "unary calls in flight")
        per_limit, total_limit = ((self.limits.client_streams, self.limits.streams) if stream
                                  else (self.limits.client_calls, self.limits.calls))
        with self._lock:
            mine = self._per_client.get((stream, client), 0)
            flag = ""
            if mine >= per_limit:
                flag = f"--max-client-{what}"
                refusal = (f"{method}: client {client} already has {mine} {unit}, the limit per "
                           f"client (--max-client-{what}={per_limit}); end one first, or raise the "
                           f"controller's --max-client-{what}")
            elif self._total[stream] >= total_limit:
                flag = f"--max-{what}"
                refusal = (f"{method}: the controller already has {self._total[stream]} {unit} "
                           f"from all clients, its limit (--max-{what}={total_limit}); retry later, "
                           f"or raise the controller's --max-{what}")
            else:
                refusal = ""
                self._per_client[(stream, client)] = mine + 1
                self._total[stream] += 1
                slot = _Slot(client, stream, method, context)
                self._open[id(slot)] = slot
        if refusal:
            self._note(refusal)
            if self.on_refused is not None:
                self.on_refused(flag, method)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        context.add_callback(lambda: self._ended(slot))
        return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            if slot.released:
                return
            slot.released = True
            self._open.pop(id(slot), None)
            key = (slot.stream, slot.client)
            left = self._per_client[key] - 1
            if left:
                self._per_client[key] = left
            else:
                del self._per_client[key]
            self._total[slot.stream] -= 1

    def _ended(self, slot: _Slot) -> None:
        """The call is over; its slot goes unless a thread is still inside its handler
        (that thread releases it on the way out)."""
        slot.ended = True
        if not slot.executing:
            self._release(slot)

    def _note(self, refusal: str) -> None:
        """Log refusals, at most one line every 10 s (a flood must not flood the log)."""
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_log < 10.0:
                return
            self._last_log = now
        log.warning("refused %d call(s) so far, latest: %s", self.refused, refusal)

    # -- idle -------------------------------------------------------------------------
    def _watch(self) -> None:
        idle = self.limits.idle_s
        while not self._stop.wait(min(1.0, max(0.05, idle / 4))):
            now = time.monotonic()
            with self._lock:
                slots = list(self._open.values())
            for slot in slots:
                waiting, sending = slot.waiting_since, slot.sending_since
                if waiting is not None and now - waiting > idle:
                    why = f"no message from the client for {idle:g} s"
                elif sending is not None and now - sending > idle:
                    why = f"the client read nothing for {idle:g} s"
                else:
                    continue
                slot.waiting_since = slot.sending_since = None
                log.info("ending an idle %s of client %s: %s", slot.method, slot.client, why)
                end_call(slot.context, grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"{slot.method}: {why}; the controller ends idle calls after "
                         f"{IDLE_FLAG}={idle:g} s (raise it there); send again on a new call")

    # -- the interceptor --------------------------------------------------------------
    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        method = str(details.method)
        service = method.split("/")[1] if method.count("/") >= 2 else ""
        if handler is None or service in EXEMPT_SERVICES:
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: Any, method: str) -> Any:
        """``handler`` re-shaped to take a request stream (so nothing is read before the
        decision), admitted, timed for idleness and released when it ends."""
        req_stream, resp_stream = bool(handler.request_streaming), bool(handler.response_streaming)
        inner: Callable[[Any, Any], Any] = {
            (False, False): handler.unary_unary, (False, True): handler.unary_stream,
            (True, False): handler.stream_unary, (True, True): handler.stream_stream,
        }[(req_stream, resp_stream)]

        def opened(requests: Iterator[Any], context: grpc.ServicerContext) -> tuple[_Slot, Any]:
            slot = self._admit(req_stream or resp_stream, method, context)
            reqs = _Requests(requests, slot)
            if req_stream:
                return slot, reqs
            try:
                request = next(reqs, None)
            except BaseException:  # ended meanwhile (gone, or idle)
                self._release(slot)
                raise
            if request is None:
                self._release(slot)
                context.abort(grpc.StatusCode.UNIMPLEMENTED,
                              f"{method} requires exactly one request message")
            return slot, request

        def unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            slot, arg = opened(requests, context)
            try:
                return inner(arg, context)
            finally:
                self._release(slot)

        def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            slot, arg = opened(requests, context)
            try:
                responses = iter(inner(arg, context))
                while True:
                    slot.executing = True
                    try:
                        response = next(responses)
                    except StopIteration:
                        return
                    finally:
                        slot.executing = False
                    if slot.ended:  # over meanwhile: no thread may come back for it
                        self._release(slot)
                    slot.sending_since = time.monotonic()
                    yield response
                    slot.sending_since = None
            finally:
                self._release(slot)

        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if resp_stream:
            return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
