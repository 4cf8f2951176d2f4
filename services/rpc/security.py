"""Security settings of one millwheel process: tokens, TLS, mTLS, where to listen.

Every server (controller, worker) and every client (CLI, :class:`ControllerClient`,
the controller's and workers' internal links) builds its gRPC credentials here, from
one :class:`Security`:

- ``client_token``: the bearer token of the public Controller service
  (``--auth-token-file``, ``$MILLWHEEL_AUTH_TOKEN``, ``$MILLWHEEL_AUTH_TOKEN_FILE``);
- ``operator_token``: the bearer token of role operator (rescale, savepoint, restore,
  dead-letter replay: services/rpc/roles.py) (``--operator-token-file``,
  ``$MILLWHEEL_OPERATOR_TOKEN``, ``$MILLWHEEL_OPERATOR_TOKEN_FILE``; a client also
  reads the ``operator-token`` file ``millwheel up`` writes). A client sends it only
  for the CLI's operator commands, the client token otherwise;
- ``cluster_secret``: the bearer token of the internal Cluster and Worker services
  (``--cluster-secret-file``, ``$MILLWHEEL_CLUSTER_SECRET``,
  ``$MILLWHEEL_CLUSTER_SECRET_FILE``); a server given a client or operator token must
  be given a cluster secret too (there is no implicit one);
- ``credentials_store``: on a server, the store URL whose named credentials it also
  accepts (services/credentials.py: looked up by the hash of a presented token, in a
  book the process opens once, on first use);
- ``cert_roles``: on a server under mTLS, ``--tls-role CN=ROLE``: a client certificate
  with that common name has that role when its call carries no token;
- TLS: ``--tls-cert``/``--tls-key`` (the process's certificate, served and, on
  internal calls, presented as client certificate) and ``--tls-ca`` (verifies the
  peer; on a server it also *requires* a client certificate signed by it: mTLS), or
  ``$MILLWHEEL_TLS_CERT``/``_KEY``/``_CA``; ``--tls-server-name`` checks the servers'
  certificates against that name instead of the dialled host.

A process's own settings are installed once with :func:`configure`; the servers it
starts and the internal channels it opens use them. A server with no authentication
(no token, no mTLS) listens on loopback only unless ``--insecure`` is given.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import os
import secrets
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from millwheel.errors import MillWheelError

from .roles import CredentialLookup, Identity, Role, identify

ENV_TOKEN, ENV_TOKEN_FILE = "MILLWHEEL_AUTH_TOKEN", "MILLWHEEL_AUTH_TOKEN_FILE"
ENV_SECRET, ENV_SECRET_FILE = "MILLWHEEL_CLUSTER_SECRET", "MILLWHEEL_CLUSTER_SECRET_FILE"
ENV_OPERATOR, ENV_OPERATOR_FILE = "MILLWHEEL_OPERATOR_TOKEN", "MILLWHEEL_OPERATOR_TOKEN_FILE"
ENV_TLS = {"cert": "MILLWHEEL_TLS_CERT", "key": "MILLWHEEL_TLS_KEY", "ca": "MILLWHEEL_TLS_CA",
           "server_name": "MILLWHEEL_TLS_SERVER_NAME"}
# `millwheel up` keeps its generated credentials here (next to its default SQLite store);
# client commands fall back to the client token found here.
DEFAULT_DATA_DIR = Path("millwheel-data")
CLIENT_TOKEN_FILE, CLUSTER_SECRET_FILE = "client-token", "cluster-secret"
OPERATOR_TOKEN_FILE = "operator-token"


class SecurityConfigError(MillWheelError):
    """Security settings that cannot work (a missing file, a token without a secret,
    a public address without authentication)."""


@dataclass(frozen=True)
class Security:
    client_token: str | None = None
    cluster_secret: str | None = None
    operator_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    # A plaintext listener serving only gRPC health (Kubernetes' gRPC probes cannot do TLS).
    health_port: int | None = None
    # A server's store, whose named credentials it accepts. A URL, not the book itself:
    # the settings are plain values (the worker hands them to its watchdog as JSON).
    credentials_store: str | None = None
    # A server's --tls-role CN=ROLE mappings (role labels: read, client, operator).
    cert_roles: tuple[tuple[str, str], ...] = ()

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    @property
    def authenticated(self) -> bool:
        """Callers must prove who they are: a token, or a client certificate (mTLS)."""
        return bool(self.client_token or self.operator_token or self.cluster_secret
                    or (self.tls_ca and self.tls_cert))

    def identify(self, token: str | None) -> Identity | None:
        """The credential a server is presented (None: none, or unknown)."""
        if token is None:
            return None
        return identify(token, cluster_secret=self.cluster_secret, operator_token=self.operator_token,
                        client_token=self.client_token, book=self.credentials())

    def credentials(self) -> CredentialLookup | None:
        """The named credentials this server accepts (one book per store and process)."""
        if not self.credentials_store:
            return None
        from ..credentials import book_for

        return book_for(self.credentials_store)

    def roles_of_certificates(self) -> dict[str, Role]:
        return {cn: Role.parse(role) for cn, role in self.cert_roles}

    def operator(self) -> Security:
        """A client's settings for an operator command: sending the operator token
        when it has one, else its client token (which the server then refuses, with a
        message saying where the operator token is found)."""
        return replace(self, client_token=self.operator_token) if self.operator_token else self

    def check(self, server: bool) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityConfigError("--tls-cert and --tls-key go together (a certificate and its key)")
        if server and self.tls_ca and not self.tls_cert:
            raise SecurityConfigError("a server with --tls-ca (mTLS) needs --tls-cert and --tls-key")
        if server and (self.client_token or self.operator_token) and not self.cluster_secret:
            raise SecurityConfigError(
                "a client token (--auth-token-file / $MILLWHEEL_AUTH_TOKEN) or operator token "
                "(--operator-token-file / $MILLWHEEL_OPERATOR_TOKEN) needs a cluster secret "
                "too (--cluster-secret-file / $MILLWHEEL_CLUSTER_SECRET), or the internal "
                "services would be open; `millwheel up` generates all three")
        if server and self.cert_roles and not (self.tls_ca and self.tls_cert and self.cluster_secret):
            raise SecurityConfigError(
                "--tls-role maps client certificates to roles: it needs mTLS (--tls-cert, "
                "--tls-key, --tls-ca) and a cluster secret (the controller and workers then "
                "present the secret to each other, whatever their certificates' names)")
        for flag, path, marker in (("--tls-cert", self.tls_cert, b"-----BEGIN CERTIFICATE-----"),
                                   ("--tls-key", self.tls_key, b"PRIVATE KEY-----"),
                                   ("--tls-ca", self.tls_ca, b"-----BEGIN CERTIFICATE-----")):
            if path and marker not in _read(path, flag):
                raise SecurityConfigError(f"{flag} {path} is not a PEM file (no {marker.decode()!r})")

    # -- credentials ----------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert or not self.tls_key:
            return None
        ca = _read(self.tls_ca, "--tls-ca") if self.tls_ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key, "--tls-key"), _read(self.tls_cert, "--tls-cert"))],
            root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "--tls-ca") if self.tls_ca else None,
            private_key=_read(self.tls_key, "--tls-key") if self.tls_key else None,
            certificate_chain=_read(self.tls_cert, "--tls-cert") if self.tls_cert else None)

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        if not (self.client_token or self.cluster_secret or self.operator_token or self.cert_roles):
            return []
        from .auth import AuthInterceptor

        return [AuthInterceptor(self.client_token, self.cluster_secret, self.operator_token,
                                self.credentials(), self.roles_of_certificates())]

    def open_channel(self, address: str, token: str | None, options: list[tuple[str, Any]]
                     ) -> grpc.Channel:
        """A channel to ``address`` over TLS when configured, sending ``token`` (if any)
        as ``authorization: Bearer`` on every call."""
        creds = self.channel_credentials()
        if creds is None:
            ch = grpc.insecure_channel(address, options=options)
        else:
            if self.tls_server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.tls_server_name)]
            ch = grpc.secure_channel(address, creds, options=options)
        return grpc.intercept_channel(ch, _Bearer(token)) if token else ch


def _read(path: str | None, what: str) -> bytes:
    try:
        return Path(path or "").read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read {what} {path}: {exc.strerror}") from None


def read_token(path: str, what: str) -> str:
    token = _read(path, what).decode("utf-8", "replace").strip()
    if not token:
        raise SecurityConfigError(f"{what} {path} is empty")
    return token


# -- the process's settings -------------------------------------------------------------------
_process = Security()


def configure(security: Security) -> None:
    """Install this process's settings: used by every server it starts and every
    internal channel it opens (:func:`services.rpc.server.start_server`/``channel``)."""
    global _process
    _process = security


def process() -> Security:
    return _process


# -- command line -----------------------------------------------------------------------------
def add_args(p: argparse.ArgumentParser, server: bool, up: bool = False, operator: bool = False) -> None:
    """The security flags of a server (``server``; ``up``: of ``millwheel up``) or of a
    client command (``operator``: one that needs role operator, so it takes the
    operator token too)."""
    g = p.add_argument_group("security (docs/service.md, Security)")
    if up:
        g.add_argument("--no-auth", action="store_true",
                       help="generate no client token and cluster secret (loopback only, "
                            "unless --insecure)")
    g.add_argument("--auth-token-file", metavar="FILE",
                   help="the client token (default $MILLWHEEL_AUTH_TOKEN, $MILLWHEEL_AUTH_TOKEN_FILE"
                        + (")" if server else f", else ./{DEFAULT_DATA_DIR}/{CLIENT_TOKEN_FILE} if present)"))
    if server or operator:
        g.add_argument("--operator-token-file", metavar="FILE",
                       help="the operator token (default $MILLWHEEL_OPERATOR_TOKEN, "
                            "$MILLWHEEL_OPERATOR_TOKEN_FILE"
                            + (")" if server else f", else ./{DEFAULT_DATA_DIR}/{OPERATOR_TOKEN_FILE} "
                               "if present; else the client token is sent)"))
    if server:
        g.add_argument("--cluster-secret-file", metavar="FILE",
                       help="the cluster secret of the internal services (default "
                            "$MILLWHEEL_CLUSTER_SECRET, $MILLWHEEL_CLUSTER_SECRET_FILE)")
        g.add_argument("--insecure", action="store_true",
                       help="allow listening on a non-loopback address without authentication")
    if server and not up:
        g.add_argument("--tls-role", action="append", default=[], metavar="CN=ROLE",
                       help="under mTLS, a client certificate with common name CN has ROLE (read, "
                            "client, operator) on calls without a token; repeatable")
        g.add_argument("--health-port", type=int, default=None, metavar="PORT",
                       help="also serve gRPC health (only) in plaintext on this port, for "
                            "probes that cannot do TLS")
    g.add_argument("--tls-cert", metavar="PEM", help="certificate (default $MILLWHEEL_TLS_CERT)")
    g.add_argument("--tls-key", metavar="PEM", help="its private key (default $MILLWHEEL_TLS_KEY)")
    g.add_argument("--tls-ca", metavar="PEM",
                   help="CA verifying the peer (default $MILLWHEEL_TLS_CA)"
                        + ("; servers then require client certificates (mTLS)" if server else ""))
    g.add_argument("--tls-server-name", metavar="NAME",
                   help="name the servers' certificates must carry, instead of the dialled host "
                        "(default $MILLWHEEL_TLS_SERVER_NAME)")


def _token(flag: str | None, env: str, env_file: str, what: str, fallback: Path | None = None
           ) -> str | None:
    if flag:
        return _usable(read_token(flag, what), f"{what} {flag}")
    if os.environ.get(env, "").strip():
        return _usable(os.environ[env].strip(), f"${env}")
    if os.environ.get(env_file):
        return _usable(read_token(os.environ[env_file], f"{what} (${env_file})"), os.environ[env_file])
    if fallback is not None and fallback.is_file():
        return _usable(read_token(str(fallback), what), str(fallback))
    return None


def _token_source(args: argparse.Namespace | None, attr: str, flag_name: str, env: str, env_file: str,
                  default_file: str) -> str | None:
    flag = getattr(args, attr, None) if args is not None else None
    if flag:
        return f"{flag_name} {flag}"
    if os.environ.get(env, "").strip():
        return f"${env}"
    if os.environ.get(env_file):
        return f"${env_file} ({os.environ[env_file]})"
    fallback = DEFAULT_DATA_DIR / default_file
    return str(fallback.resolve()) if fallback.is_file() else None


def client_token_source(args: argparse.Namespace | None) -> str | None:
    """Where a client's token comes from, in the order :func:`from_args` looks (the
    flag, ``$MILLWHEEL_AUTH_TOKEN``, ``$MILLWHEEL_AUTH_TOKEN_FILE``, the file
    ``millwheel up`` writes), or None if it has none: for messages."""
    return _token_source(args, "auth_token_file", "--auth-token-file", ENV_TOKEN, ENV_TOKEN_FILE,
                         CLIENT_TOKEN_FILE)


def operator_token_source(args: argparse.Namespace | None) -> str | None:
    """Where a client's operator token comes from (as :func:`client_token_source`)."""
    return _token_source(args, "operator_token_file", "--operator-token-file", ENV_OPERATOR,
                         ENV_OPERATOR_FILE, OPERATOR_TOKEN_FILE)


def cert_roles(entries: list[str] | None) -> tuple[tuple[str, str], ...]:
    """``--tls-role CN=ROLE`` entries, checked."""
    out: dict[str, str] = {}
    for entry in entries or ():
        cn, sep, role = entry.rpartition("=")
        if not sep or not cn.strip():
            raise SecurityConfigError(f"--tls-role {entry!r}: expected CN=ROLE (e.g. ops.example.com=operator)")
        try:
            out[cn.strip()] = Role.parse(role).label
        except ValueError as exc:
            raise SecurityConfigError(f"--tls-role {entry!r}: {exc}") from None
    return tuple(out.items())


def token_lookup() -> str:
    """Where a client looks for its token, for a message saying it has none."""
    return (f"give it with --auth-token-file FILE, ${ENV_TOKEN} or ${ENV_TOKEN_FILE}; without them "
            f"it reads {(DEFAULT_DATA_DIR / CLIENT_TOKEN_FILE).resolve()} (not there), the file "
            "`millwheel up` writes when started in that directory and prints the path of "
            f"(with --store sqlite:///DIR/NAME.db: DIR/{CLIENT_TOKEN_FILE})")


def _usable(token: str, where: str) -> str:
    """A token must fit in a gRPC metadata value: printable ASCII, no spaces."""
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise SecurityConfigError(f"{where}: a token must be printable ASCII without spaces")
    return token


def from_args(args: argparse.Namespace | None, server: bool) -> Security:
    """Settings from the flags, else the environment (see the module doc)."""
    def flag(name: str) -> Any:
        return getattr(args, name, None) if args is not None else None

    tls = {k: flag(f"tls_{k}") or os.environ.get(env) or None for k, env in ENV_TLS.items()}
    sec = Security(
        client_token=_token(flag("auth_token_file"), ENV_TOKEN, ENV_TOKEN_FILE, "client token file",
                            None if server else DEFAULT_DATA_DIR / CLIENT_TOKEN_FILE),
        cluster_secret=_token(flag("cluster_secret_file"), ENV_SECRET, ENV_SECRET_FILE,
                              "cluster secret file") if server else None,
        operator_token=_token(flag("operator_token_file"), ENV_OPERATOR, ENV_OPERATOR_FILE,
                              "operator token file", None if server else DEFAULT_DATA_DIR / OPERATOR_TOKEN_FILE),
        cert_roles=cert_roles(flag("tls_role")) if server else (),
        tls_cert=tls["cert"], tls_key=tls["key"], tls_ca=tls["ca"], tls_server_name=tls["server_name"],
        health_port=flag("health_port"))
    sec.check(server)
    return sec


def client_security() -> Security:
    """A client's settings from the environment (what :class:`ControllerClient` uses
    when given none)."""
    return from_args(None, server=False)


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback
                               for i in infos)


def check_listen(sec: Security, host: str, insecure: bool) -> None:
    """Refuse a non-loopback address without authentication, unless ``insecure``."""
    if not sec.authenticated and not insecure and not is_loopback(host):
        raise SecurityConfigError(
            f"refusing to listen on {host} without authentication: anyone who reaches "
            "it could run the cluster. Set a client token and cluster secret "
            "($MILLWHEEL_AUTH_TOKEN + $MILLWHEEL_CLUSTER_SECRET, or --auth-token-file + "
            "--cluster-secret-file) and/or mTLS (--tls-cert/--tls-key/--tls-ca), or pass "
            "--insecure if the network is trusted")


def setup_server(args: argparse.Namespace, role: str, credentials_store: str | None = None) -> Security:
    """Read and check a server's settings, refuse a public address without
    authentication (unless ``--insecure``), say how it is protected, and install them.
    ``credentials_store``: the store whose named credentials its servers also accept
    (only with tokens in use: without them every call is let through anyway)."""
    sec = from_args(args, server=True)
    if credentials_store and sec.cluster_secret:
        sec = replace(sec, credentials_store=credentials_store)
    check_listen(sec, args.host, args.insecure)
    if not sec.authenticated:
        print(f"millwheel {role}: no authentication configured"
              + (" (--insecure): anyone who reaches" if args.insecure else ": listening on loopback "
                 "only; anyone on this machine can call") + f" {args.host}", file=sys.stderr, flush=True)
    else:
        how = [w for w, on in (("client token", sec.client_token), ("operator token", sec.operator_token),
                               ("cluster secret", sec.cluster_secret), ("named credentials", sec.credentials_store),
                               ("TLS", sec.tls_cert), ("mTLS", sec.tls_ca),
                               ("certificate roles", sec.cert_roles)) if on]
        print(f"millwheel {role}: security: {', '.join(how)}", file=sys.stderr, flush=True)
    configure(sec)
    return sec


# -- millwheel up ------------------------------------------------------------------------------
def up_credentials(args: argparse.Namespace) -> tuple[Security, list[str], list[str]]:
    """For ``millwheel up``: (its client's settings, the security flags for its children,
    lines telling the user how to connect). Without a client token or cluster secret
    given (flags or environment) and without ``--no-auth``, it reuses or generates them
    as files (mode 0600) in its data directory: the SQLite store's, else ./millwheel-data."""
    store = str(args.store)
    data_dir = Path(store[len("sqlite:///"):].split("?")[0]).parent if store.startswith("sqlite:///") \
        else DEFAULT_DATA_DIR
    child: list[str] = []
    lines: list[str] = []
    for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name"):
        if getattr(args, name):
            child += [f"--{name.replace('_', '-')}", getattr(args, name)]
    if args.insecure:
        child.append("--insecure")
    if args.no_auth or _given(args):
        sec = from_args(args, server=True)
        check_listen(sec, args.host, args.insecure)
        for flag in ("auth_token_file", "cluster_secret_file", "operator_token_file"):
            if getattr(args, flag):
                child += [f"--{flag.replace('_', '-')}", getattr(args, flag)]
    else:
        token_path = _generated(data_dir / CLIENT_TOKEN_FILE)
        secret_path = _generated(data_dir / CLUSTER_SECRET_FILE)
        operator_path = _generated(data_dir / OPERATOR_TOKEN_FILE)
        child += ["--auth-token-file", str(token_path), "--cluster-secret-file", str(secret_path),
                  "--operator-token-file", str(operator_path)]
        sec = replace(from_args(args, server=False), client_token=read_token(str(token_path), "token"),
                      cluster_secret=read_token(str(secret_path), "secret"),
                      operator_token=read_token(str(operator_path), "operator token"))
        lines += [f"  client token: {token_path.resolve()} (operator token and cluster secret beside "
                  "it; all 0600)",
                  f"  clients started here find them; elsewhere: export {ENV_TOKEN_FILE}="
                  f"{token_path.resolve()} (and {ENV_OPERATOR_FILE}={operator_path.resolve()} "
                  "for rescale, savepoint, restore, dead-letters replay)"]
    client = replace(sec, cluster_secret=None)
    return client, child, lines


def _given(args: argparse.Namespace) -> bool:
    return bool(args.auth_token_file or args.cluster_secret_file or getattr(args, "operator_token_file", None)
                or any(os.environ.get(e) for e in (ENV_TOKEN, ENV_TOKEN_FILE, ENV_SECRET, ENV_SECRET_FILE,
                                                    ENV_OPERATOR, ENV_OPERATOR_FILE)))


def _generated(path: Path) -> Path:
    """``path``, holding a fresh random token unless it already holds one."""
    if path.is_file() and path.read_text().strip():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    os.chmod(path, 0o600)
    return path


# -- client side: the bearer token on every call ---------------------------------------------
class _Details(collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.entry = ("authorization", f"Bearer {token}")

    def _with(self, d: Any) -> _Details:
        return _Details(d.method, d.timeout, [*(d.metadata or ()), self.entry], d.credentials,
                        d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with(details), requests)
