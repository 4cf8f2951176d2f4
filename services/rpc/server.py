"""One way to start a gRPC server for every millwheel process.

Every server gets standard health checking and server reflection (v1 and v1alpha), so
any stock gRPC client can discover and call it. Servers and channels take their TLS and
tokens from :mod:`services.rpc.security` (the process's settings unless given). Requests
are parsed leniently: a malformed protobuf reaches the servicer as :class:`Malformed`
and is answered INVALID_ARGUMENT (grpcio would otherwise answer INTERNAL), with a
message naming the method.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from millwheel import __version__
from millwheel.errors import InvalidSpecError, MillWheelError

from ..generated import millwheel_pb2 as pb
from . import reflection
from .admission import Admission
from .security import Security, process

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ListenError(MillWheelError):
    """A server could not bind its address."""


@dataclass(frozen=True)
class Malformed:
    """A request that did not parse as its protobuf message type."""

    what: str
    error: str

    def raise_(self) -> None:
        raise InvalidSpecError(f"malformed {self.what} message: {self.error}")


def check(request: Any) -> Any:
    """Raise INVALID_ARGUMENT (via InvalidSpecError) for a malformed request."""
    if isinstance(request, Malformed):
        request.raise_()
    return request


def checked(requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        yield check(request)


def _lenient(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Malformed(cls.DESCRIPTOR.full_name, str(exc) or exc.__class__.__name__)

    return parse


VERSION_METADATA = (("millwheel-version", __version__),)


def _versioned(fn: Callable[[Any, Any], Any], streaming: bool) -> Callable[[Any, Any], Any]:
    """``fn`` answering with the server's version in its initial metadata
    (``millwheel-version``), so any client can tell what it talks to."""
    if streaming:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            context.send_initial_metadata(VERSION_METADATA)
            yield from fn(request, context)
        return stream

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        context.send_initial_metadata(VERSION_METADATA)
        return fn(request, context)
    return unary


def add_service(server: grpc.Server, service_name: str, servicer: Any) -> str:
    """Register ``servicer`` for ``millwheel.v1.<service_name>`` with lenient parsing."""
    service = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        req_cls = getattr(pb, method.input_type.name)
        resp_cls = getattr(pb, method.output_type.name)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            _versioned(getattr(servicer, method.name), method.server_streaming),
            request_deserializer=_lenient(req_cls),
            response_serializer=resp_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    return str(service.full_name)


#: The server pings a silent client this often and drops the connection (ending its
#: calls) when a ping goes unanswered this long: a client that vanished without a reset
#: (a host gone, a cable pulled) must not hold a follow-mode Subscribe forever.
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 60, 20


def start_server(
    address: str, services: dict[str, Any], max_workers: int = 16, security: Security | None = None,
    *, admission: Admission | None = None, probes: bool = True, pool_name: str = "grpc",
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Start a server on ``address`` (``host:0`` picks a free port) with the given
    millwheel services plus (``probes``) health, reflection and the ``--health-port``
    listener, authenticated and over TLS as ``security`` (default: the process's) says.
    ``admission``: admit client calls (services/rpc/admission.py); the pool then has
    its size, and grpc-core refuses calls past twice that (its fixed message; the
    admission's own refusals come first). Returns (server, port, health)."""
    sec = security or process()
    interceptors: list[grpc.ServerInterceptor] = list(sec.server_interceptors())
    limit: int | None = None
    if admission is not None:
        interceptors.append(admission)  # inside the token check: a refused token never counts
        max_workers = admission.limits.threads
        limit = 2 * max_workers
    server = grpc.server(
        interceptors=interceptors,
        thread_pool=futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=pool_name),
        maximum_concurrent_rpcs=limit,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # Peers that send keepalive pings (a standby's forwards to the leader: a
            # partitioned leader must not hold a forwarded call forever) are welcome.
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
        ],
    )
    names = [add_service(server, name, servicer) for name, servicer in services.items()]
    health_servicer = health.HealthServicer()
    if probes:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        names = reflection.enable(server, names)
    creds = sec.server_credentials()
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ListenError(f"cannot listen on {address}: address in use or not local"
                          + (", or --tls-cert/--tls-key are not a matching pair" if creds else ""))
    server.start()
    if probes and sec.health_port is not None:
        _health_only(server, address.rpartition(":")[0], sec.health_port, health_servicer)
    serving = health_pb2.HealthCheckResponse.SERVING
    health_servicer.set("", serving)
    for name in names:
        health_servicer.set(name, serving)
    return server, port, health_servicer


PROBE_THREADS = 4


class _CheckOnly(health_pb2_grpc.HealthServicer):
    """gRPC health for the plaintext probe port: ``Check`` only. That port takes no
    credential, so a ``Watch`` (a stream that lasts as long as the caller likes) would
    let anyone who reaches it hold its few threads and fail every probe after; probes
    (Kubernetes' ``grpc:``) call ``Check``. ``Watch`` stays on the main port, under
    the client admission limits."""

    def __init__(self, servicer: health.HealthServicer) -> None:
        self._servicer = servicer

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC's name
        return self._servicer.Check(request, context)

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - gRPC's name
        context.abort(grpc.StatusCode.UNIMPLEMENTED,
                      "the plaintext health port (--health-port) answers Check only; Watch on the main port")


def _health_only(main: grpc.Server, host: str, port: int, servicer: health.HealthServicer) -> None:
    """A plaintext server answering only gRPC health for ``main`` (the same servicer, so
    both always answer alike), for probes that cannot do TLS; stopped with ``main``."""
    probe = grpc.server(futures.ThreadPoolExecutor(max_workers=PROBE_THREADS, thread_name_prefix="health"),
                        options=[("grpc.so_reuseport", 0)], maximum_concurrent_rpcs=PROBE_THREADS * 4)
    health_pb2_grpc.add_HealthServicer_to_server(_CheckOnly(servicer), probe)
    try:
        bound = probe.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ListenError(f"cannot listen on {host}:{port} (--health-port): address in use or not local")
    probe.start()
    stop = main.stop
    main.stop = lambda grace: (probe.stop(grace), stop(grace))[1]  # type: ignore[method-assign]


def channel(address: str, security: Security | None = None, token: str | None = None,
            keepalive_s: float | None = None) -> grpc.Channel:
    """A channel to ``address``. By default an internal one: the process's TLS settings,
    presenting the cluster secret; a client passes its own ``security`` and ``token``.
    ``keepalive_s``: ping the peer that often while calls are open and fail them if a
    ping goes unanswered as long (a partitioned peer sends no reset)."""
    sec = security or process()
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    if keepalive_s is not None:
        options += [("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
                    ("grpc.keepalive_timeout_ms", int(keepalive_s * 1000)),
                    # grpc-core 1.85 times an unanswered ping out by this, not by the
                    # keepalive timeout (60 s by default): without it a call to a
                    # SIGSTOPped peer waited forever (tests/integration/test_controller_ha.py).
                    ("grpc.http2.ping_timeout_ms", int(keepalive_s * 1000)),
                    # It also stops pinging after 2 pings without a data frame by
                    # default: an idle follow-mode Subscribe would lose its keepalive.
                    ("grpc.http2.max_pings_without_data", 0)]
    return sec.open_channel(address, token if security is not None else sec.cluster_secret, options)
