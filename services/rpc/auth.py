"""Authentication and roles of every gRPC call a millwheel server receives.

Credentials, each sent as ``authorization: Bearer <token>`` metadata, each with a role
(services/rpc/roles.py: read < client < operator < cluster):

- the **client token** (role client): what users, the CLI and client programs present;
- the **operator token** (role operator): what the CLI's rescale, savepoint (stop,
  drain), restore and dead-letter replay present; ``millwheel up`` writes it beside the
  client token;
- **named credentials** (any of read, client, operator), issued and revoked per client
  with ``millwheel credentials`` and kept in the store as hashes (services/credentials.py);
- the **cluster secret** (role cluster): what the controller and workers present to each
  other. It alone opens the internal ``millwheel.v1.Cluster`` (heartbeats) and
  ``millwheel.v1.Worker`` (data plane) services, and it opens everything else too.

Under mTLS a client certificate can stand for a credential: ``--tls-role CN=ROLE`` maps
a certificate's common name to a role, for calls that carry no token (the token wins
when both are sent). The certificate is known only on the call's thread (the
interceptor sees the method and metadata alone), so such a call is checked there, first
thing, before its request is read or the servicer runs.

A client cannot join as a worker, take key ranges or deliver records past the
controller's checks. Health checking (``grpc.health.v1.Health``) stays open for load
balancers and probes.

A refused call is answered UNAUTHENTICATED (no or unknown token) or PERMISSION_DENIED
(a credential whose role is below the method's: the message names both roles) before
the servicer runs: nothing else happens. Tokens are compared with
:func:`hmac.compare_digest` (constant time).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import grpc

from .roles import (
    CLUSTER,
    INTERNAL_SERVICES,
    CredentialLookup,
    Identity,
    Role,
    identify,
    refusal_message,
    required,
    service_of,
)

log = logging.getLogger("millwheel.auth")

OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
Refusal = tuple[grpc.StatusCode, str]


def bearer_token(metadata: Sequence[Any] | None) -> str | None:
    """The token of the first ``authorization: Bearer ...`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


def certificate_identity(context: grpc.ServicerContext, cert_roles: dict[str, Role]) -> Identity | None:
    """The role the caller's client certificate maps to (``--tls-role CN=ROLE``), or None."""
    try:
        names: list[Any] = list(context.auth_context().get("x509_common_name") or [])
    except Exception:  # noqa: BLE001 - no TLS on this call: no certificate
        return None
    for raw in names:
        cn = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if cn in cert_roles:
            return Identity(f"certificate CN={cn}", cert_roles[cn], per_client=True)
    return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks every call's credential against the role its method needs."""

    def __init__(self, client_token: str | None, cluster_secret: str | None,
                 operator_token: str | None = None, credentials: CredentialLookup | None = None,
                 cert_roles: dict[str, Role] | None = None) -> None:
        if (client_token is not None or operator_token is not None) and cluster_secret is None:
            # The internal services would have nothing to check: refuse to run that way.
            raise ValueError("a client token needs a cluster secret for the internal services")
        self.client_token = client_token
        self.cluster_secret = cluster_secret
        self.operator_token = operator_token
        self.credentials = credentials
        self.cert_roles = dict(cert_roles or {})
        self._last_log = 0.0
        self._refused = 0
        self._lock = threading.Lock()

    def identify(self, token: str) -> Identity | None:
        return identify(token, cluster_secret=self.cluster_secret, operator_token=self.operator_token,
                        client_token=self.client_token, book=self.credentials)

    def refusal(self, method: str) -> Callable[[str | None], Refusal | None]:
        """For a method path ``/package.Service/Method``: a function from the presented
        token to None (allowed) or the (status, message) refusing the call."""
        needed = required(method)
        if needed is None:
            return lambda _token: None
        internal = service_of(method) in INTERNAL_SERVICES or needed >= CLUSTER
        what = (f"{method} is internal to the cluster: send the cluster secret "
                "($MILLWHEEL_CLUSTER_SECRET)" if internal else
                f"{method} needs a credential with role {needed.label} (the client token "
                "$MILLWHEEL_AUTH_TOKEN, the operator token $MILLWHEEL_OPERATOR_TOKEN, or one made "
                "with `millwheel credentials create`)")

        def check(token: str | None) -> Refusal | None:
            if token is None:
                return grpc.StatusCode.UNAUTHENTICATED, (
                    f"missing credentials: {what} as 'authorization: Bearer <token>' metadata")
            who = self.identify(token)
            if who is None:
                return grpc.StatusCode.UNAUTHENTICATED, f"wrong token: {what}"
            return self.role_refusal(method, needed, who)

        return check

    @staticmethod
    def role_refusal(method: str, needed: Role, who: Identity) -> Refusal | None:
        """None if ``who`` may call ``method``; else PERMISSION_DENIED saying why."""
        if who.role >= needed:
            return None
        if needed >= CLUSTER:
            return grpc.StatusCode.PERMISSION_DENIED, (
                f"the {who.name} cannot call {method}: it is internal to the cluster "
                "(controller and workers, with the cluster secret)")
        return grpc.StatusCode.PERMISSION_DENIED, refusal_message(method, needed, who)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        method = str(details.method)
        token = bearer_token(details.invocation_metadata)
        handler = continuation(details)
        if handler is None:
            return handler
        needed = required(method)
        if token is None and self.cert_roles and needed is not None:
            return _checked(handler, lambda context: self._by_certificate(method, needed, context))
        refused = self.refusal(method)(token)
        if refused is None:
            return handler
        self._note(method, refused)
        return _refusing(handler, *refused)

    def _by_certificate(self, method: str, needed: Role, context: grpc.ServicerContext) -> Refusal | None:
        who = certificate_identity(context, self.cert_roles)
        if who is None:
            refused: Refusal | None = (grpc.StatusCode.UNAUTHENTICATED, (
                f"missing credentials: {method} needs a token ('authorization: Bearer <token>' "
                "metadata) or a client certificate whose CN has a role (--tls-role CN=ROLE)"))
        else:
            refused = self.role_refusal(method, needed, who)
        if refused is not None:
            self._note(method, refused)
        return refused

    def _note(self, method: str, refused: Refusal) -> None:
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


def _checked(handler: Any, check: Callable[[grpc.ServicerContext], Refusal | None]) -> Any:
    """``handler``, taking a request stream, that first runs ``check`` on the call's
    context (the client certificate is known only there) and aborts if it refuses,
    before any request message is read."""
    req_stream, resp_stream = bool(handler.request_streaming), bool(handler.response_streaming)
    inner: Callable[[Any, Any], Any] = {
        (False, False): handler.unary_unary, (False, True): handler.unary_stream,
        (True, False): handler.stream_unary, (True, True): handler.stream_stream,
    }[(req_stream, resp_stream)]

    def argument(requests: Any, context: grpc.ServicerContext) -> Any:
        refused = check(context)
        if refused is not None:
            context.abort(*refused)
        if req_stream:
            return requests
        request = next(requests, None)
        if request is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "exactly one request message expected")
        return request

    def unary(requests: Any, context: grpc.ServicerContext) -> Any:
        return inner(argument(requests, context), context)

    def streaming(requests: Any, context: grpc.ServicerContext) -> Any:
        yield from inner(argument(requests, context), context)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if resp_stream:
        return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
