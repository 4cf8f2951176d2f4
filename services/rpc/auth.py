"""Bearer-token authentication of every gRPC call a millwheel server receives.

Two credentials, both sent as ``authorization: Bearer <token>`` metadata:

- the **client token**: what users, the CLI and client programs present. It opens the
  public ``millwheel.v1.Controller`` service (and reflection);
- the **cluster secret**: what the controller and workers present to each other. It
  opens the internal ``millwheel.v1.Cluster`` (heartbeats) and ``millwheel.v1.Worker``
  (data plane) services, and everything the client token opens.

The client token is never accepted by an internal service, so a client cannot join as
a worker, take key ranges or deliver records past the controller's checks. Health
checking (``grpc.health.v1.Health``) stays open for load balancers and probes.

A refused call is answered UNAUTHENTICATED (no or wrong token) or PERMISSION_DENIED
(the client token on an internal service) before the servicer runs: nothing else
happens. Tokens are compared with :func:`hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any, Callable, Sequence

import grpc

log = logging.getLogger("millwheel.auth")

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
INTERNAL_SERVICES = frozenset({"millwheel.v1.Cluster", "millwheel.v1.Worker"})


def bearer_token(metadata: Sequence[Any] | None) -> str | None:
    """The token of the first ``authorization: Bearer ...`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


def _same(presented: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(presented.encode(), expected.encode())


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks the bearer token of every call against the service's trust class."""

    def __init__(self, client_token: str | None, cluster_secret: str | None) -> None:
        if client_token is not None and cluster_secret is None:
            # The internal services would have nothing to check: refuse to run that way.
            raise ValueError("a client token needs a cluster secret for the internal services")
        self.client_token = client_token
        self.cluster_secret = cluster_secret
        self._last_log = 0.0
        self._refused = 0
        self._lock = threading.Lock()

    def refusal(self, method: str) -> Callable[[str | None], tuple[grpc.StatusCode, str] | None]:
        """For a method path ``/package.Service/Method``: a function from the presented
        token to None (allowed) or the (status, message) refusing the call."""
        service = method.split("/")[1] if method.count("/") >= 2 else method
        if service in OPEN_SERVICES:
            return lambda _token: None
        internal = service in INTERNAL_SERVICES
        what = (f"{method} is internal to the cluster: send the cluster secret "
                "($MILLWHEEL_CLUSTER_SECRET)" if internal else
                f"{method} needs the client token ($MILLWHEEL_AUTH_TOKEN)")

        def check(token: str | None) -> tuple[grpc.StatusCode, str] | None:
            if token is None:
                return grpc.StatusCode.UNAUTHENTICATED, (
                    f"missing credentials: {what} as 'authorization: Bearer <token>' metadata")
            if _same(token, self.cluster_secret):
                return None
            if _same(token, self.client_token):
                if not internal:
                    return None
                return grpc.StatusCode.PERMISSION_DENIED, (
                    f"the client token cannot call {method}: it is internal to the cluster "
                    "(controller and workers, with the cluster secret)")
            return grpc.StatusCode.UNAUTHENTICATED, f"wrong token: {what}"

        return check

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        refused = self.refusal(details.method)(bearer_token(details.invocation_metadata))
        handler = continuation(details)
        if refused is None or handler is None:
            return handler
        self._note(details.method, refused)
        return _refusing(handler, *refused)

    def _note(self, method: str, refused: tuple[grpc.StatusCode, str]) -> None:
        """Log refusals, at most one line every 10 s (a scan must not flood the log)."""
        with self._lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._last_log < 10.0:
                return
            self._last_log, count, self._refused = now, self._refused, 0
        log.warning("refused %d call(s), latest %s: %s: %s", count, method, refused[0].name,
                    refused[1])


def _refusing(handler: grpc.RpcMethodHandler[Any, Any], code: grpc.StatusCode, message: str) -> Any:
    """A handler answering like ``handler`` that only aborts. The request is neither
    parsed nor read: it takes a request stream whatever the method (grpcio reads a
    unary request on a pool thread *before* the handler runs, so a caller that never
    sent its message would hold that thread), and aborts without touching it."""

    def abort(_requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    return grpc.stream_unary_rpc_method_handler(abort)
