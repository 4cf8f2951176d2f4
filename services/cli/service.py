"""Service commands: run the processes (up, controller, worker). The client commands
that talk to them (register, unregister, inject, watermark, state, keys, status,
computations, subscribe) are in :mod:`services.cli.remote`.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

from millwheel.connectors.spec import SourcePaths
from millwheel.errors import InvalidSpecError
from millwheel.savepoint.format import DEFAULT_MAX_RESTORE_BYTES, MAX_FILE_BYTES
from millwheel.state.url_display import describe_store

from .. import memory
from ..client import CONTROLLER_HELP, CONTROLLER_METAVAR, ControllerClient, controller_address
from ..inject_limits import InjectLimits
from ..rpc import security
from ..rpc.admission import AdmissionLimits
from ..ui.server import LOGIN_CODE_ENV, free_port, start_console
from ..ui.server import add_args as console_args
from . import lifeline
from .restarter import Restarter

DEFAULT_STORE = "sqlite:///millwheel-data/service.db"
#: The store URL as ``up`` hands it to its children: in the environment (which only the
#: same user reads), not on the command line, where ``ps`` shows a Redis password to all.
STORE_ENV = "MILLWHEEL_STORE"


def add_commands(sub: Any) -> None:
    up = sub.add_parser("up", help="start a controller and N workers on this machine",
                        description="Start a controller and N workers as child processes on one "
                        "machine, sharing one store (embedded SQLite by default, or --store "
                        "redis://HOST:PORT/DB). Ctrl-C drains the workers and stops everything.")
    up.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    up.add_argument("--controllers", type=int, default=1, metavar="N",
                    help="number of controllers (default 1): one leads, the others stand by on "
                         "--port+1, --port+2, ... (with --port 0, any free ports) and take over "
                         "if it dies (the console is served by the first)")
    up.add_argument("--no-watchdog", action="store_true", help="start the workers with --no-watchdog")
    # Passed through to the controllers (as `millwheel controller` takes them: issue 34).
    _writer_expiry_arg(up)
    _max_restore_arg(up)
    _server_args(up, port=7070, up=True)
    _allow_code_arg(up)
    console_args(up, up=True)
    up.set_defaults(func=cmd_up)

    ctl = sub.add_parser("controller", help="run the controller",
                         description="Run the controller: registry, key-range assignment, "
                         "watermark authority, state queries, Inject and Subscribe.")
    _server_args(ctl, port=7070)
    _allow_code_arg(ctl)
    console_args(ctl)
    ctl.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="SECONDS",
                     help="a worker silent this long is dead and its ranges move (default 3)")
    _limit_args(ctl)
    ctl.add_argument("--inject-wait", type=float, default=10.0, metavar="SECONDS",
                     help="how long Inject holds a message while the injector's outbox is full "
                          "before answering RESOURCE_EXHAUSTED with a retry hint (default 10)")
    _writer_expiry_arg(ctl)
    ctl.add_argument("--inject-batch", type=int, default=5000, metavar="N",
                     help="Inject messages larger than N records go to the worker in pieces of N")
    _max_restore_arg(ctl)
    _admission_args(ctl)
    ha = ctl.add_argument_group(
        "several controllers (docs/service.md, Controller high availability)",
        "Start any number of controllers on one store: one leads (it holds a lease in the "
        "store), the others stand by, answer reads, forward writes and take over when the "
        "leader stops renewing its lease. Give clients and workers every address: "
        "--controller a:7070,b:7070.")
    ha.add_argument("--advertise", metavar="HOST",
                    help="the host the other controllers and the workers reach this one at "
                         "(default --host, or this machine's name when --host is 0.0.0.0)")
    ha.add_argument("--lease-ttl", type=float, default=2.0, metavar="SECONDS",
                    help="the leader's lease runs out this long after its last renewal (renewed "
                         "every quarter of it); a standby takes over within about this (default 2)")
    ha.add_argument("--takeover-grace", type=float, default=10.0, metavar="SECONDS",
                    help="a new leader gives the workers it finds this long to heartbeat before "
                         "declaring any dead, so a leader change moves no range (default 10)")
    ctl.set_defaults(func=cmd_controller)

    wk = sub.add_parser("worker", help="run a worker",
                        description="Run a worker: it joins the controller, takes the key ranges "
                        "it is assigned and processes them. SIGTERM drains it gracefully.")
    _server_args(wk, port=0)
    _allow_code_arg(wk)
    wk.add_argument("--controller", metavar=CONTROLLER_METAVAR, default=None, help=CONTROLLER_HELP)
    wk.add_argument("--id", dest="worker_id", help="worker id (default ADDRESS/PID)")
    wk.add_argument("--advertise", metavar="HOST",
                    help="host name other processes reach this worker by (default --host, or this "
                         "machine's name when listening on 0.0.0.0)")
    wk.add_argument("--batch-size", type=int, default=5000, help="records per delivered batch")
    wk.add_argument("--max-inflight", type=int, default=8,
                    help="unacked batches per destination before senders wait (backpressure)")
    wk.add_argument("--max-injector-outbox", type=int, default=50_000, metavar="N",
                    help="an injector's outbox holding N records refuses more until it drains: "
                         "Inject waits, then answers RESOURCE_EXHAUSTED (default 50000)")
    _limit_args(wk)
    wk.add_argument("--ingest-port", type=int, default=0, metavar="PORT",
                    help="where writers send records (parallel ingestion, docs/service.md): a "
                         "listener of its own with client admission, so writers cannot take the "
                         "threads of records between workers (default 0: any free port; the "
                         "controller tells writers where)")
    wk.add_argument("--weak-wait", type=float, default=1.0, metavar="SECONDS",
                    help="weak productions: outputs not acked downstream within this time are "
                         "checkpointed and resent later (default 1)")
    wk.add_argument("--heartbeat", type=float, default=0.1, metavar="SECONDS",
                    help="heartbeat interval (default 0.1)")
    wk.add_argument("--delivery-timeout", type=float, default=5.0, metavar="SECONDS",
                    help="a batch unacked this long is resent (default 5)")
    wk.add_argument("--no-watchdog", action="store_true",
                    help="run without the watchdog process: no deadline on user code, and a "
                         "batch holding the interpreter past the heartbeat timeout gets the worker "
                         "declared dead (for measurements)")
    wk.set_defaults(func=cmd_worker)


def _writer_expiry_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--writer-expiry", type=float, default=30.0, metavar="SECONDS",
                   help="parallel ingestion: a writer silent this long no longer holds its "
                        "injector's watermark back (docs/service.md, Parallel ingestion; default 30)")


def _max_restore_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-restore-bytes", type=int, default=DEFAULT_MAX_RESTORE_BYTES, metavar="BYTES",
                   help="the largest savepoint file RestoreSavepoint takes: the upload is spooled to a "
                        "temporary file and refused with RESOURCE_EXHAUSTED as it passes this (default "
                        f"{DEFAULT_MAX_RESTORE_BYTES}, 16 GiB; at most {MAX_FILE_BYTES})")


def _limit_args(p: argparse.ArgumentParser) -> None:
    """The limits on an Inject message (the controller) and a Write batch (a worker's
    parallel ingestion): services/inject_limits.py."""
    p.add_argument("--max-value-bytes", type=int, default=InjectLimits.max_value_bytes,
                   help="largest record value Inject and Write accept (default 1 MiB)")
    p.add_argument("--max-inject-records", type=int, default=InjectLimits.max_records, metavar="N",
                   help=f"records per Inject message or Write batch (default {InjectLimits.max_records})")
    p.add_argument("--max-future-us", type=int, default=InjectLimits.max_future_us, metavar="US",
                   help="refuse record timestamps and watermarks further ahead of the clock "
                        "(default one day; 0 = no limit)")


def _inject_limits(args: argparse.Namespace) -> InjectLimits:
    return InjectLimits(max_records=args.max_inject_records, max_value_bytes=args.max_value_bytes,
                        max_future_us=args.max_future_us)


def _admission_args(p: argparse.ArgumentParser) -> None:
    d = AdmissionLimits()
    g = p.add_argument_group(
        "control plane and client admission (docs/service.md, Limits)",
        "Heartbeats have a listener and threads of their own; client calls are admitted per "
        "client (its host) and in total, each refusal RESOURCE_EXHAUSTED naming the flag.")
    g.add_argument("--cluster-port", type=int, default=0, metavar="PORT",
                   help="port of the Cluster service (worker heartbeats), apart from the client "
                        "port; workers learn it from the controller (default 0 = any free)")
    g.add_argument("--max-client-streams", type=int, default=d.client_streams, metavar="N",
                   help="streams (Inject, Subscribe, ...) one client may hold open "
                        f"(default {d.client_streams})")
    g.add_argument("--max-client-calls", type=int, default=d.client_calls, metavar="N",
                   help=f"unary calls one client may have in flight (default {d.client_calls})")
    g.add_argument("--max-streams", type=int, default=d.streams, metavar="N",
                   help=f"streams open from all clients together (default {d.streams})")
    g.add_argument("--max-calls", type=int, default=d.calls, metavar="N",
                   help=f"unary calls in flight from all clients together (default {d.calls})")
    g.add_argument("--stream-idle-timeout", type=float, default=d.idle_s, metavar="SECONDS",
                   help="end a call whose client sends nothing it awaits, or reads nothing "
                        f"sent to it, for this long (default {d.idle_s:g})")


def admission_limits(args: argparse.Namespace) -> AdmissionLimits:
    limits = AdmissionLimits(client_streams=args.max_client_streams, client_calls=args.max_client_calls,
                             streams=args.max_streams, calls=args.max_calls,
                             idle_s=args.stream_idle_timeout)
    limits.check()
    return limits


def _allow_code_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-code", default=os.environ.get("MILLWHEEL_ALLOW_CODE", ""),
                   metavar="PATTERNS", help="modules whose code specs may name by import path, "
                   "e.g. 'mypkg.*,otherpkg.mod' (env MILLWHEEL_ALLOW_CODE; default none: "
                   "built-in operators only)")
    # Beside --allow-code, on every process that takes it: what a client may make the
    # service's machines read is the operator's to hand out (issue 34).
    p.add_argument("--allow-source-path", action="append", default=[], metavar="DIR",
                   help="a directory under which a files source may read (repeatable; checked "
                        "after resolving '..' and symbolic links; default none: files sources "
                        "are refused, PERMISSION_DENIED)")


def source_paths(args: argparse.Namespace) -> SourcePaths:
    """The process's --allow-source-path directories, resolved against its directory."""
    return SourcePaths.parse(args.allow_source_path)


def _server_args(p: argparse.ArgumentParser, port: int, up: bool = False) -> None:
    security.add_args(p, server=True, up=up)
    p.add_argument("--store", default=os.environ.get(STORE_ENV, DEFAULT_STORE),
                   help=f"store URL (env {STORE_ENV}, which keeps a password out of `ps`; "
                   f"default {DEFAULT_STORE})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port}; 0 = any free)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port (default 0 = any free; -1 = off)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


# -- processes --------------------------------------------------------------------------------
def _logging(level: str) -> None:
    """Log to stderr; SIGUSR1 dumps every thread's stack (for a process that seems stuck)."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _wait_for_signal(tick: Callable[[], None] | None = None) -> None:
    """Until SIGTERM or SIGINT; meanwhile ``tick()`` every half second if given."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(None if tick is None else 0.5):
        tick()  # type: ignore[misc]


def cmd_controller(args: argparse.Namespace) -> int:
    from ..controller.service import serve

    lifeline.die_with_parent(signal.SIGTERM)
    if not 0 <= args.takeover_grace <= 86_400:  # nan and inf too: a grace must end
        raise InvalidSpecError(f"--takeover-grace must be 0..86400 seconds, got {args.takeover_grace:g}")
    if not 0 <= args.cluster_port <= 65535:
        raise InvalidSpecError(f"--cluster-port must be 0..65535, got {args.cluster_port}")
    if not 0 < args.max_restore_bytes <= MAX_FILE_BYTES:
        raise InvalidSpecError(f"--max-restore-bytes must be 1..{MAX_FILE_BYTES}, got {args.max_restore_bytes}")
    admission = admission_limits(args)
    _logging(args.log_level)
    memory.start_from_env("controller")
    security.setup_server(args, "controller", credentials_store=args.store)
    server, port, mport, service = serve(
        args.store, args.host, args.port, None if args.metrics_port < 0 else args.metrics_port,
        heartbeat_timeout_s=args.heartbeat_timeout, max_value_bytes=args.max_value_bytes,
        inject_wait_s=args.inject_wait, inject_batch=args.inject_batch, allow_code=args.allow_code,
        advertise=args.advertise,
        lease_ttl_s=args.lease_ttl, takeover_grace_s=args.takeover_grace,
        cluster_port=args.cluster_port, admission=admission,
        limits=_inject_limits(args), writer_expiry_s=args.writer_expiry,
        max_restore_bytes=args.max_restore_bytes, source_paths=source_paths(args))
    metrics = "metrics off" if args.metrics_port < 0 else f"metrics port {mport}"
    print(f"millwheel controller listening on {args.host}:{port}, cluster port {service.cluster_port} "
          f"({metrics}, store {describe_store(args.store)})", file=sys.stderr, flush=True)
    console = start_console(service, args)
    _wait_for_signal()
    stop_controller(server, service, console)
    return 0


def stop_controller(server: Any, service: Any, console: Any) -> None:
    """The controller's way out: the console first (its snapshots read the store, which
    must not be closed under it: "Cannot operate on a closed database" tracebacks), then
    the service (a leader hands the lease over at once), the gRPC server, the store."""
    if console is not None:
        console.close()
    service.close()
    server.stop(grace=1.0).wait(2.0)
    service.plane.store.close()


def cmd_worker(args: argparse.Namespace) -> int:
    from ..worker.service import WorkerProcess

    lifeline.die_with_parent(signal.SIGKILL)
    _logging(args.log_level)
    memory.start_from_env("worker")
    security.setup_server(args, "worker", credentials_store=args.store)
    worker = WorkerProcess(
        controller_address(args.controller), args.store,
        host=args.host, port=args.port, advertise=args.advertise,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        worker_id=args.worker_id, batch_size=args.batch_size, max_inflight=args.max_inflight,
        max_injector_outbox=args.max_injector_outbox, weak_wait_s=args.weak_wait,
        heartbeat_s=args.heartbeat, delivery_timeout_s=args.delivery_timeout,
        allow_code=args.allow_code, use_watchdog=not args.no_watchdog, inject_limits=_inject_limits(args),
        ingest_port=args.ingest_port, source_paths=source_paths(args))
    metrics = "metrics off" if args.metrics_port < 0 else f"metrics port {worker.metrics_port}"
    print(f"millwheel worker {worker.worker_id} listening on {worker.address} ({metrics}, "
          f"store {describe_store(args.store)})", file=sys.stderr, flush=True)
    _wait_for_signal()
    worker.drain_and_stop()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise InvalidSpecError("--workers must be at least 1")
    if not 1 <= args.controllers <= 9:
        raise InvalidSpecError("--controllers must be 1..9")
    if not 0 < args.max_restore_bytes <= MAX_FILE_BYTES:  # refused here, not by a controller that exits
        raise InvalidSpecError(f"--max-restore-bytes must be 1..{MAX_FILE_BYTES}, got {args.max_restore_bytes}")
    if args.store.startswith("sqlite:///"):
        Path(args.store[len("sqlite:///"):].split("?")[0]).parent.mkdir(parents=True, exist_ok=True)
    import socket

    if not 0 <= args.port <= 65535 - (args.controllers - 1):
        raise InvalidSpecError(f"--port must be 0..{65535 - (args.controllers - 1)}, got {args.port}")
    # --port 0: any free port, one per controller (each kept across its restarts).
    ports = _free_ports(args.host, args.controllers) if args.port == 0 else \
        [args.port + i for i in range(args.controllers)]
    for port in ports:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1" if args.host == "0.0.0.0" else args.host, port)) == 0:
                raise InvalidSpecError(
                    f"port {port} on {args.host} is in use (another millwheel controller?); "
                    "choose another with --port")
    base = [sys.executable, "-m", str(__package__)]
    client_sec, secure_args, how = security.up_credentials(args)
    common = ["--host", args.host, "--log-level", args.log_level,
              "--allow-code", args.allow_code, *secure_args,
              *(a for d in source_paths(args).dirs for a in ("--allow-source-path", d))]
    procs: list[subprocess.Popen[bytes]] = []
    host = '127.0.0.1' if args.host == '0.0.0.0' else args.host
    controller = ",".join(f"{host}:{port}" for port in ports)
    first = len(ports)  # procs[:first] are the controllers, the rest workers

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen([*base, "worker", *common, "--controller", controller,
                                 "--port", "0", "--metrics-port", "-1" if args.metrics_port < 0 else "0",
                                 *(["--no-watchdog"] if args.no_watchdog else [])],
                                start_new_session=True, env={**lifeline.child_env(), STORE_ENV: args.store})

    ui_port = free_port(args.host) if args.ui_port == 0 else args.ui_port

    # The console's one-time login link (services/ui/server.py): for the first start of
    # the controller serving it only, so a restarted controller does not take it again.
    login = secrets.token_urlsafe(24) if client_sec.client_token and ui_port >= 0 else ""
    unspent = [login] if login else []

    def controller_proc(i: int) -> subprocess.Popen[bytes]:
        env = {**lifeline.child_env(), STORE_ENV: args.store}
        if i == 0 and unspent:
            env[LOGIN_CODE_ENV] = unspent.pop()
        return subprocess.Popen([*base, "controller", *common, "--port", str(ports[i]),
                                 "--writer-expiry", str(args.writer_expiry),
                                 "--max-restore-bytes", str(args.max_restore_bytes),
                                 "--metrics-port", str(args.metrics_port if i == 0 or args.metrics_port < 0 else 0),
                                 "--ui-port", str(ui_port if i == 0 else -1)],
                                start_new_session=True, env=env)
    # Every child is stopped on the way out, whatever the way: a controller that never
    # answers, Ctrl-C while starting, an error, or the end of a normal run.
    store_probe = StoreProbe(args.store)
    try:
        procs += [controller_proc(i) for i in range(first)]
        with ControllerClient(controller, security=client_sec) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.status()
                    break
                except Exception:
                    cause = store_probe.failure()
                    if cause or all(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                        print("millwheel up: the controller did not start"
                              + (f": cannot open the store: {cause}" if cause else ""), file=sys.stderr)
                        return 1
                    time.sleep(0.1)
            procs += [worker() for _ in range(args.workers)]
            deadline = time.monotonic() + 20
            while len([w for w in client.status().workers if w.alive]) < args.workers:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.1)
        print(f"millwheel is up: controller{'s' if first > 1 else ''} {controller}, {args.workers} workers, "
              f"store {describe_store(args.store)}\n"
              + "".join(f"{line}\n" for line in how)
              + (f"  console: {'https' if client_sec.tls_cert else 'http'}://{host}:{ui_port}/\n"
                 if ui_port >= 0 else "")
              + (f"  sign in once: {'https' if client_sec.tls_cert else 'http'}://{host}:{ui_port}/login?code="
                 f"{login} (a one-time link, for 10 minutes; then the client token)\n" if login else "")
              + f"  try: millwheel status --controller {controller}\n  Ctrl-C stops everything.",
              file=sys.stderr, flush=True)
        # A dead worker is restarted; with several controllers, a dead one comes back as a standby.
        restarters = [Restarter(procs, first, worker)] + ([
            Restarter(procs, i, partial(controller_proc, i), last=i + 1, what="controller")
            for i in range(first)] if first > 1 else [])

        def check() -> None:
            for r in restarters:
                r.check()

        _wait_for_signal(check)
    finally:
        if procs:
            print("millwheel up: stopping workers, then the controller", file=sys.stderr, flush=True)
        for p in procs[first:]:
            p.send_signal(signal.SIGTERM)
        for p in procs[first:]:
            _reap(p, 20)
        for p in procs[:first]:
            p.send_signal(signal.SIGTERM)
        for p in procs[:first]:
            _reap(p, 10)
    return 0


class StoreProbe:
    """``up`` opens a Redis store itself, as its controllers do (``open_store``), but with
    short timeouts (:data:`PROBE_QUERY`), in a thread while they start: a Redis that is
    down or does not answer is named within seconds, where the controller would retry
    for 30 s and ``up`` say only that it did not start. (A SQLite store's error comes
    at once, from the controller itself.)"""

    #: The probe's timeouts: lower ones given in the URL are kept.
    PROBE_QUERY = {"connect_timeout": 2.0, "socket_timeout": 2.0, "retry_deadline": 4.0}

    def __init__(self, url: str) -> None:
        self.url = url
        self._failure: str | None = None
        self._done = threading.Event()
        if url.split(":", 1)[0] in ("redis", "rediss"):
            threading.Thread(target=self._run, name="store-probe", daemon=True).start()
        else:
            self._done.set()

    def failure(self) -> str | None:
        """Why the store cannot be opened, once the probe failed; else None."""
        return self._failure if self._done.is_set() else None

    def _run(self) -> None:
        from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

        from millwheel.state import open_store
        from millwheel.state.url_display import redact

        parts = urlsplit(self.url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        for name, limit in self.PROBE_QUERY.items():
            try:
                given = float(query.get(name, limit))
            except ValueError:
                continue  # the store's own parsing says what is wrong with it
            query[name] = f"{min(given, limit) if given > 0 else limit:g}"
        probe_url = urlunsplit(parts._replace(query=urlencode(query)))
        try:
            store = open_store(probe_url)
            try:
                store.get_meta("up-probe")
            finally:
                store.close()
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is the cause to name
            message = str(exc).replace(redact(probe_url), redact(self.url))
            self._failure = message if redact(self.url) in message else f"{redact(self.url)}: {message}"
        finally:
            self._done.set()


def _free_ports(host: str, n: int) -> list[int]:
    """``n`` different ports free on ``host`` now (``up --port 0``)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def _reap(p: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
