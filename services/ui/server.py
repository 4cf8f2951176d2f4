"""The console's HTTP listener: the static page, the Tracker API and the login.

Standard library only (:class:`http.server.ThreadingHTTPServer`): the console is a
few read endpoints and one action, not worth a web framework. Rules:

* With a client token configured, every ``/api/`` request needs a credential (the
  client token, the operator token, or a named credential: services/rpc/roles.py), as
  an ``Authorization: Bearer`` header or a session cookie set by the login form
  (``POST /login``, HttpOnly, SameSite=Strict, Secure under TLS). The token is never
  accepted in a URL. Wrong or missing: 401 with a JSON message. ``/healthz`` and the
  static files (which hold no data) are open.
* A session has the **role** of the credential it logged in with. Reading needs role
  read; the **actions** (``POST /api/v1/actions/NAME``, a JSON body: today
  ``replay-dead-letters``) need role operator, as their RPCs do: any other session is
  answered 403 naming the role needed and the one held, and nothing runs.
  ``/api/v1/session`` says the role and the actions it may take, so the page shows
  only the buttons it can use. An action runs as the controller calling its own public
  RPC (with the cluster secret, after the console checked the role), so it takes the
  same path, checks and leader forwarding as the CLI's. Actions take JSON only (a form
  from another site cannot send it, on top of the SameSite cookie).
* ``millwheel up`` prints a **one-time login link** (``GET /login?code=...``): a random
  code, not the token, that signs one browser in (the same session cookie, role
  operator: whoever started ``up`` runs the deployment) and is then spent; it expires
  after ``LOGIN_LINK_S`` unused. ``up`` hands it to its controller in the environment
  (``MILLWHEEL_UI_LOGIN_CODE``), never on a command line.
* Without a client token the listener follows the gRPC rule: loopback only unless
  ``--insecure``.
* Every answer carries a Content-Security-Policy allowing only this origin's script
  and style files (no inline script), ``X-Content-Type-Options: nosniff``,
  ``X-Frame-Options: DENY`` and ``Cache-Control: no-store`` on data.
* Under ``--tls-cert``/``--tls-key`` it serves HTTPS with the same certificate; under
  mTLS (``--tls-ca`` too) it requires a client certificate signed by that CA, as the
  gRPC port does: without one the TLS handshake fails, before any page (even
  ``/healthz``). The token rules apply on top.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import secrets
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import parse_qs, urlsplit

from millwheel.errors import MillWheelError, NotFoundError

from ..controller.held_by import LeastWriter
from ..rpc import security
from ..rpc.roles import CONSOLE_ACTION_ROLE, OPERATOR, Identity, Role
from ..rpc.server import ListenError
from .snapshot import Snapshotter, controller_view
from .tracker import BadRequest, Tracker

if TYPE_CHECKING:
    from ..controller.plane import ControlPlane
    from ..controller.service import Controller

log = logging.getLogger("millwheel.ui")

COOKIE = "millwheel_session"
SESSION_S = 12 * 3600
MAX_SESSIONS = 1000
MAX_FORM_BYTES = 4096
#: The console's actions (``POST /api/v1/actions/NAME``), each needing role operator.
ACTIONS = ("replay-dead-letters",)
ACTION_TIMEOUT_S = 60.0
#: A request without a credential to check (no token configured: loopback only, as gRPC).
UNAUTHENTICATED_SERVICE = Identity("no authentication configured", OPERATOR)
LOGIN_CODE_ENV = "MILLWHEEL_UI_LOGIN_CODE"
LOGIN_LINK_S = 600.0
STATIC = {"/": ("index.html", "text/html; charset=utf-8"),
          "/index.html": ("index.html", "text/html; charset=utf-8"),
          "/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/app.css": ("app.css", "text/css; charset=utf-8")}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")


def add_args(p: argparse.ArgumentParser, up: bool = False) -> None:
    p.add_argument("--ui-port", type=int, default=0 if up else -1, metavar="PORT",
                   help="serve the operations console and its Tracker JSON API (docs/ui.md) on "
                        + ("this port (default 0 = any free port; -1 = off)" if up else
                           "this port (0 = any free; default -1 = off)"))


class Sessions:
    """Random session ids of logged-in browsers, bounded and expiring."""

    def __init__(self) -> None:
        self._ids: dict[str, tuple[float, Identity]] = {}
        self._lock = threading.Lock()

    def new(self, who: Identity) -> str:
        """A session of the credential ``who`` (its role is the session's)."""
        sid = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            for old in [s for s, (exp, _who) in self._ids.items() if exp < now]:
                del self._ids[old]
            while len(self._ids) >= MAX_SESSIONS:
                del self._ids[min(self._ids, key=lambda k: self._ids[k][0])]
            self._ids[sid] = (now + SESSION_S, who)
        return sid

    def end(self, sid: str) -> None:
        with self._lock:
            self._ids.pop(sid, None)

    def valid(self, sid: str) -> Identity | None:
        """The session's credential, or None (unknown or expired)."""
        with self._lock:
            entry = self._ids.get(sid)
            return entry[1] if entry is not None and entry[0] > time.monotonic() else None


class LoginLink:
    """A code that signs one browser in once, within ``LOGIN_LINK_S`` of the start."""

    def __init__(self, code: str | None) -> None:
        self._code = code
        self._until = time.monotonic() + LOGIN_LINK_S
        self._lock = threading.Lock()

    def spend(self, presented: str) -> bool:
        """True once, for the right code before it expires; the code is gone after."""
        with self._lock:
            code, ok = self._code, time.monotonic() < self._until
            if code is None or not hmac.compare_digest(presented.encode(), code.encode()):
                return False
            self._code = None  # spent (or expired): never again
            return ok


class Console:
    """The running console of one controller."""

    def __init__(self, controller: ControlPlane, host: str, port: int, token: str | None,
                 tls: ssl.SSLContext | None = None, interval_s: float = 1.0,
                 login_code: str | None = None,
                 identify: Callable[[str], Identity | None] | None = None,
                 act: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
                 least_writer: LeastWriter | None = None) -> None:
        """``token``: the client token (None: no authentication); ``identify``: a
        presented token -> its credential (default: the client token alone, role
        client); ``act``: runs an action (name, JSON body) -> its JSON answer;
        ``least_writer``: an injector's least live writer, named in what holds a watermark."""
        self.token = token
        self.identify = identify or (lambda t: Identity("client token", Role.CLIENT)
                                     if token is not None and hmac.compare_digest(t.encode(), token.encode())
                                     else None)
        self.act = act
        self.login_link = LoginLink(login_code if token is not None else None)
        self.tls = tls is not None
        self.sessions = Sessions()
        self.snap = Snapshotter(controller, interval_s, least_writer)
        self.tracker = Tracker(self.snap)
        self.httpd = _Server((host, port), _handler(self))
        self.httpd.daemon_threads = True
        if tls is not None:
            # the handshake happens in the request's thread, not in accept(): a slow
            # client cannot hold up the listener
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True,
                                                do_handshake_on_connect=False)
        self.port = int(self.httpd.server_address[1])
        self.snap.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ui-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.snap.stop()
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, headers: Any) -> Identity | None:
        """The request's credential (its bearer token, else its session), or None."""
        if self.token is None:
            return UNAUTHENTICATED_SERVICE
        auth = headers.get("Authorization", "")
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer":
            who = self.check_token(value.strip())
            if who is not None:
                return who
        for part in headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                who = self.sessions.valid(value)
                if who is not None:
                    return who
        return None

    def check_token(self, presented: str) -> Identity | None:
        """The credential a presented token is (the cluster secret counts as an
        operator here: the console's powers stop there)."""
        if self.token is None or not presented:
            return None
        who = self.identify(presented)
        if who is not None and who.role > OPERATOR:
            who = Identity(who.name, OPERATOR, who.per_client)
        return who


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that breaks off (or speaks plaintext to TLS) is not worth a traceback."""
        log.debug("console connection from %s failed", client_address, exc_info=True)


def start_console(process: Controller, args: argparse.Namespace) -> Console | None:
    """Start the console if ``--ui-port`` asks for it (same host and security as the
    controller's gRPC); prints its URL. Either way, add the controller's scrape-time
    series (error records, worker liveness) to its /metrics: dashboards need them.
    The console reads the controller's plane (services/controller/plane.py), never its parts."""
    controller = process.plane
    if controller.sensors is not None:
        controller.sensors.controller_view(controller_view(controller))
    if getattr(args, "ui_port", -1) < 0:
        return None
    sec = security.process()
    if sec.client_token is None and not args.insecure and not security.is_loopback(args.host):
        # No token to log in with (mTLS cannot authenticate a browser): loopback only.
        raise security.SecurityConfigError(
            f"refusing to serve the console (--ui-port) on {args.host} without a client token: "
            "set one ($MILLWHEEL_AUTH_TOKEN / --auth-token-file), listen on loopback, "
            "pass --ui-port -1 (no console), or --insecure if the network is trusted")
    writers = getattr(process, "writers", None)  # parallel ingestion's writers (services/controller/writers.py)
    tls = None
    if sec.tls_cert and sec.tls_key:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(sec.tls_cert, sec.tls_key)
        if sec.tls_ca:  # mTLS: the console is a door to the same data as the gRPC port
            tls.load_verify_locations(cafile=sec.tls_ca)
            tls.verify_mode = ssl.CERT_REQUIRED
    try:
        console = Console(controller, args.host, args.ui_port, sec.client_token, tls,
                          login_code=os.environ.pop(LOGIN_CODE_ENV, None) or None,
                          identify=sec.identify, act=SelfCall(controller),
                          least_writer=writers.least if writers is not None else None)
    except OSError as exc:
        raise ListenError(f"cannot serve the console on {args.host}:{args.ui_port} (--ui-port): "
                          f"{exc.strerror or exc}") from None
    host = "127.0.0.1" if args.host == "0.0.0.0" else args.host
    print(f"millwheel controller: console at {'https' if tls else 'http'}://{host}:{console.port}/"
          + (" (log in with the client token)" if sec.client_token else ""), file=sys.stderr, flush=True)
    return console


class SelfCall:
    """The console's actions as calls of this controller's own public RPCs, presenting
    the cluster secret (the console has checked the session's role first): the same
    checks, leader forwarding and errors as a CLI's call."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane

    def __call__(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        from dataclasses import replace

        from ..client import ControllerClient

        if action != "replay-dead-letters":
            raise NotFoundError(f"no console action {action[:80]!r}; there are: {', '.join(ACTIONS)}")
        computation = body.get("computation")
        if not isinstance(computation, str) or not computation:
            raise BadRequest("replay-dead-letters needs {\"computation\": NAME}")
        sec = security.process()
        with ControllerClient(self.plane.address, timeout_s=ACTION_TIMEOUT_S,
                              security=replace(sec, client_token=sec.cluster_secret)) as client:
            resp = client.replay_dead_letters(computation, ACTION_TIMEOUT_S)
        return {"computation": computation, "replayed": resp.replayed, "skipped": resp.skipped,
                "remaining": resp.remaining}


def _static(name: str) -> bytes:
    return resources.files(__package__ or "services.ui").joinpath("static", name).read_bytes()


def _handler(console: Console) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "millwheel-console"
        sys_version = ""
        protocol_version = "HTTP/1.1"
        timeout = 30  # seconds a connection may sit idle or trickle a request

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
            log.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("X-Frame-Options", "DENY")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Cache-Control", "no-store")
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, data: Any, extra: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps(data, separators=(",", ":")).encode(),
                       "application/json", extra)

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            url = urlsplit(self.path)
            path = url.path
            if len(self.path) > 16384:
                self._json(414, {"error": "request URL over 16384 characters"})
                return
            if path == "/healthz":
                self._json(200, {"ok": True})
                return
            if path == "/login":  # the one-time link `up` prints
                try:
                    code = (parse_qs(url.query, max_num_fields=5).get("code") or [""])[0]
                except ValueError:  # too many fields
                    code = ""
                if console.login_link.spend(code):
                    sid = console.sessions.new(Identity("login link of millwheel up", OPERATOR))
                    self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": _cookie(sid, SESSION_S)})
                else:
                    self._send(303, b"", "text/plain", {"Location": "/?login=link-spent"})
                return
            if path in STATIC:
                name, ctype = STATIC[path]
                self._send(200, _static(name), ctype)
                return
            if not path.startswith("/api/"):
                self._json(404, {"error": f"no such page {path[:100]!r}"})
                return
            if path == "/api/v1/session":  # open: lets the page ask before it gets a 401
                who = console.authorized(self.headers)
                self._json(200, {"auth_required": console.token is not None, "authorized": who is not None,
                                 "role": who.role.label if who is not None else None,
                                 "actions": list(ACTIONS) if who is not None and who.role >= CONSOLE_ACTION_ROLE
                                 else []})
                return
            if console.authorized(self.headers) is None:
                self._json(401, {"error": "log in with the client token (Authorization: Bearer "
                                          "<token>, or the console's login form)"},
                           {"WWW-Authenticate": 'Bearer realm="millwheel"'})
                return
            try:
                query = parse_qs(url.query, keep_blank_values=True, strict_parsing=False,
                                 max_num_fields=20)
                self._json(200, console.tracker.handle(path, query))
            except BadRequest as exc:
                self._json(exc.status, {"error": str(exc)})
            except ValueError as exc:  # parse_qs: too many fields
                self._json(400, {"error": f"bad query string: {exc}"})
            except Exception as exc:  # noqa: BLE001 - the console must answer, not hang
                log.exception("console request %s failed", path)
                self._json(500, {"error": f"{type(exc).__name__}: {exc}"[:500]})

        def do_POST(self) -> None:  # noqa: N802
            path = urlsplit(self.path).path
            if path.startswith("/api/v1/actions/"):
                self._action(path[len("/api/v1/actions/"):])
                return
            if path not in ("/login", "/logout"):
                self._json(405, {"error": "the console's data is read-only; POST only to /login, /logout "
                                          "and /api/v1/actions/NAME"})
                return
            raw = self._body("login form")
            if raw is None:
                return
            form = parse_qs(raw.decode("utf-8", "replace"), max_num_fields=5)
            if path == "/logout":
                for part in self.headers.get("Cookie", "").split(";"):
                    name, _, value = part.strip().partition("=")
                    if name == COOKIE:
                        console.sessions.end(value)  # the session is over, not just forgotten
                self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": _cookie("", 0)})
                return
            if console.token is None:
                self._send(303, b"", "text/plain", {"Location": "/"})
                return
            who = console.check_token((form.get("token") or [""])[0].strip())
            if who is None:
                self._send(303, b"", "text/plain", {"Location": "/?login=failed"})
                return
            sid = console.sessions.new(who)
            self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": _cookie(sid, SESSION_S)})

        def _body(self, what: str) -> bytes | None:
            """The request's body, at most MAX_FORM_BYTES; else answered 400 here (None)."""
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_FORM_BYTES:
                self._json(400, {"error": f"{what} must be 0..{MAX_FORM_BYTES} bytes"})
                return None
            return bytes(self.rfile.read(length))

        def _action(self, name: str) -> None:
            """``POST /api/v1/actions/NAME`` (JSON body): role operator, checked before
            anything runs."""
            who = console.authorized(self.headers)
            if who is None:
                self._json(401, {"error": "log in first (Authorization: Bearer <token>, or the login form)"},
                           {"WWW-Authenticate": 'Bearer realm="millwheel"'})
                return
            if who.role < CONSOLE_ACTION_ROLE:
                self._json(403, {"error": f"permission denied: the console action {name[:80]!r} needs role "
                                          f"{CONSOLE_ACTION_ROLE.label}; this session's credential is "
                                          f"{who.describe()}; log in with the operator token or a "
                                          "credential with role operator"})
                return
            if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
                self._json(415, {"error": "an action's body is JSON (Content-Type: application/json)"})
                return
            raw = self._body("an action's body")
            if raw is None:
                return
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("an action's body is a JSON object")
                if console.act is None:
                    raise BadRequest("this console runs no actions")
                log.info("console action %s by %s: %s", name[:80], who.describe(), json.dumps(body)[:200])
                self._json(200, console.act(name, body))
            except (BadRequest, ValueError) as exc:
                self._json(getattr(exc, "status", 400), {"error": str(exc)[:500]})
            except NotFoundError as exc:
                self._json(404, {"error": str(exc)[:500]})
            except MillWheelError as exc:
                self._json(409, {"error": f"{type(exc).__name__}: {exc}"[:500]})

    def _cookie(value: str, max_age: int) -> str:
        return (f"{COOKIE}={value}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict"
                + ("; Secure" if console.tls else ""))

    return Handler


def free_port(host: str) -> int:
    """A port free on ``host`` now (for ``millwheel up`` to hand its controller)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1" if host == "0.0.0.0" else host, 0))
        return int(s.getsockname()[1])
