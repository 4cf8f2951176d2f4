"""Service commands: run the processes (up, controller, worker) and talk to them
(register, unregister, inject, watermark, state, keys, status, subscribe).

Every client command prints a human table by default and JSON with ``--json``; the
controller address comes from ``--controller``, ``$MILLWHEEL_CONTROLLER`` or
127.0.0.1:7070.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from millwheel.errors import InvalidSpecError
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP, Record
from millwheel.sources import parse_json_record
from millwheel.spec import load_spec_file
from millwheel.state.url import describe_store

from . import security
from .client import DEFAULT_CONTROLLER, ControllerClient, controller_address, inject_messages
from .limits import InjectLimits
from .restarter import Restarter
from .ui.server import add_args as console_args
from .ui.server import free_port, start_console

DEFAULT_STORE = "sqlite:///millwheel-data/service.db"


def add_commands(sub: Any) -> None:
    def client_parser(name: str, help: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=description)
        p.add_argument("--controller", metavar="HOST:PORT",
                       help=f"controller address (default $MILLWHEEL_CONTROLLER or {DEFAULT_CONTROLLER})")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        security.add_args(p, server=False)
        return p

    up = sub.add_parser("up", help="start a controller and N workers on this machine",
                        description="Start a controller and N workers as child processes on one "
                        "machine, sharing one store (embedded SQLite by default, or --store "
                        "redis://HOST:PORT/DB). Ctrl-C drains the workers and stops everything.")
    up.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    up.add_argument("--no-watchdog", action="store_true", help="start the workers with --no-watchdog")
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
    ctl.add_argument("--max-value-bytes", type=int, default=1024 * 1024,
                     help="largest record value Inject accepts (default 1 MiB)")
    ctl.add_argument("--inject-wait", type=float, default=10.0, metavar="SECONDS",
                     help="how long Inject holds a message while the injector's outbox is full "
                          "before answering RESOURCE_EXHAUSTED with a retry hint (default 10)")
    ctl.add_argument("--max-inject-records", type=int, default=InjectLimits.max_records, metavar="N",
                     help=f"records per Inject message (default {InjectLimits.max_records})")
    ctl.add_argument("--max-future-us", type=int, default=InjectLimits.max_future_us, metavar="US",
                     help="refuse record timestamps and watermarks further ahead of the clock "
                          "(default one day; 0 = no limit)")
    ctl.add_argument("--inject-batch", type=int, default=5000, metavar="N",
                     help="Inject messages larger than N records go to the worker in pieces of N")
    ctl.set_defaults(func=cmd_controller)

    wk = sub.add_parser("worker", help="run a worker",
                        description="Run a worker: it joins the controller, takes the key ranges "
                        "it is assigned and processes them. SIGTERM drains it gracefully.")
    _server_args(wk, port=0)
    _allow_code_arg(wk)
    wk.add_argument("--controller", metavar="HOST:PORT", default=None,
                    help=f"controller address (default $MILLWHEEL_CONTROLLER or {DEFAULT_CONTROLLER})")
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

    reg = client_parser("register", "register computations (and injectors) from a spec file",
                        "Register the computations of a YAML/JSON spec file: either one computation "
                        "mapping (name, inputs, outputs, code, options) or a topology with "
                        "'injectors' and 'computations', all or nothing (one RegisterTopology call: "
                        "if anything is refused, nothing is registered). Ones identical to the "
                        "registered ones are left as they are; ones that differ are an error.")
    reg.add_argument("spec", metavar="SPEC.yaml|json")
    reg.set_defaults(func=cmd_register)

    unreg = client_parser("unregister", "unregister a computation",
                          "Unregister a computation (refused while another consumes its output).")
    unreg.add_argument("name", metavar="COMPUTATION")
    unreg.set_defaults(func=cmd_unregister)

    inj = client_parser("inject", "inject JSON-lines records through an injector",
                        "Send records to an injector: JSON lines {\"key\", \"value\", \"timestamp\" "
                        "(integer microseconds)[, \"id\"]} from FILE or stdin. Records with an "
                        "'id' are idempotent (re-injecting them is a no-op); others get a fresh "
                        "id. Each batch reports the injector watermark: the largest timestamp "
                        "so far minus --max-disorder-us; --done reports the final watermark.")
    inj.add_argument("file", nargs="?", default="-", metavar="FILE", help="JSON lines (default stdin)")
    inj.add_argument("--injector", required=True, help="injector name")
    inj.add_argument("--stream", default="",
                     help="stream to write (registers the injector if it is new)")
    inj.add_argument("--batch", type=int, default=500, help="records per message (default 500)")
    inj.add_argument("--max-disorder-us", type=int, default=0,
                     help="how far out of timestamp order records may arrive (default 0)")
    inj.add_argument("--no-watermark", action="store_true", help="do not advance the watermark")
    inj.add_argument("--done", action="store_true",
                     help="this is the injector's last input: advance its watermark to the end")
    inj.set_defaults(func=cmd_inject)

    wm = client_parser("watermark", "show low watermarks",
                       "Show the low watermark of every computation and injector, or of one.")
    wm.add_argument("computation", nargs="?", default="", metavar="COMPUTATION")
    wm.set_defaults(func=cmd_watermark)

    st = client_parser("state", "show the state and pending timers of a key",
                       "Show the stored state bytes and pending timers of one key of a computation.")
    st.add_argument("computation", metavar="COMPUTATION")
    st.add_argument("key", metavar="KEY")
    st.set_defaults(func=cmd_state)

    ks = client_parser("keys", "list the keys with state", "List the keys of a computation that have state.")
    ks.add_argument("computation", metavar="COMPUTATION")
    ks.add_argument("--limit", type=int, default=0, help="at most this many (default all)")
    ks.set_defaults(func=cmd_keys)

    stat = client_parser("status", "show workers, ranges, tokens and watermarks",
                         "Show the cluster: workers, every key range with its owner and token, "
                         "and watermarks with their lag.")
    stat.set_defaults(func=cmd_status)

    comps = client_parser("computations", "list registered computations and injectors",
                          "List registered computations and injectors.")
    comps.set_defaults(func=cmd_computations)

    subs = client_parser("subscribe", "print the records of a sink stream",
                         "Print the records of a sink stream (one no computation consumes) from "
                         "the stream log, from the start or after --after; --follow keeps "
                         "printing new records.")
    subs.add_argument("stream", metavar="STREAM")
    subs.add_argument("--after", type=int, default=0, metavar="SEQ", help="start after this position")
    subs.add_argument("--follow", "-f", action="store_true", help="keep streaming new records")
    subs.set_defaults(func=cmd_subscribe)


def _allow_code_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-code", default=os.environ.get("MILLWHEEL_ALLOW_CODE", ""),
                   metavar="PATTERNS", help="modules whose code specs may name by import path, "
                   "e.g. 'mypkg.*,otherpkg.mod' (env MILLWHEEL_ALLOW_CODE; default none: "
                   "built-in operators only)")


def _server_args(p: argparse.ArgumentParser, port: int, up: bool = False) -> None:
    security.add_args(p, server=True, up=up)
    p.add_argument("--store", default=DEFAULT_STORE, help=f"store URL (default {DEFAULT_STORE})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help=f"gRPC port (default {port}; 0 = any free)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port (default 0 = any free; -1 = off)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


# -- formatting -----------------------------------------------------------------------------
def fmt_ts(us: int) -> str:
    if us <= MIN_TIMESTAMP:
        return "-inf (nothing yet)"
    if us >= MAX_TIMESTAMP:
        return "+inf (done)"
    when = dt.datetime.fromtimestamp(us / 1e6, tz=dt.UTC)
    return f"{us} ({when.isoformat(timespec='milliseconds').replace('+00:00', 'Z')})"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _emit(args: argparse.Namespace, data: Any, text: str) -> int:
    print(json.dumps(data, indent=2) if args.json else text)
    return 0


def _value_text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


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
    from .controller import serve

    _logging(args.log_level)
    security.setup_server(args, "controller")
    server, port, mport, service = serve(
        args.store, args.host, args.port, None if args.metrics_port < 0 else args.metrics_port,
        heartbeat_timeout_s=args.heartbeat_timeout, max_value_bytes=args.max_value_bytes,
        inject_wait_s=args.inject_wait, inject_batch=args.inject_batch, allow_code=args.allow_code,
        limits=InjectLimits(max_records=args.max_inject_records, max_value_bytes=args.max_value_bytes,
                            max_future_us=args.max_future_us))
    print(f"millwheel controller listening on {args.host}:{port} (metrics port {mport}, "
          f"store {describe_store(args.store)})", file=sys.stderr, flush=True)
    start_console(service, args)
    _wait_for_signal()
    service.close()
    server.stop(grace=1.0).wait(2.0)
    service.store.close()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from .worker import WorkerProcess

    _logging(args.log_level)
    security.setup_server(args, "worker")
    worker = WorkerProcess(
        controller_address(args.controller), args.store,
        host=args.host, port=args.port, advertise=args.advertise,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        worker_id=args.worker_id, batch_size=args.batch_size, max_inflight=args.max_inflight,
        max_injector_outbox=args.max_injector_outbox, weak_wait_s=args.weak_wait,
        heartbeat_s=args.heartbeat, delivery_timeout_s=args.delivery_timeout,
        allow_code=args.allow_code, use_watchdog=not args.no_watchdog)
    print(f"millwheel worker {worker.worker_id} listening on {worker.address} (metrics port "
          f"{worker.metrics_port}, store {describe_store(args.store)})", file=sys.stderr, flush=True)
    _wait_for_signal()
    worker.drain_and_stop()
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise InvalidSpecError("--workers must be at least 1")
    if args.store.startswith("sqlite:///"):
        Path(args.store[len("sqlite:///"):].split("?")[0]).parent.mkdir(parents=True, exist_ok=True)
    import socket

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1" if args.host == "0.0.0.0" else args.host, args.port)) == 0:
            raise InvalidSpecError(
                f"port {args.port} on {args.host} is in use (another millwheel controller?); "
                "choose another with --port")
    base = [sys.executable, "-m", f"{__package__}.cli"]
    client_sec, secure_args, how = security.up_credentials(args)
    common = ["--store", args.store, "--host", args.host, "--log-level", args.log_level,
              "--allow-code", args.allow_code, *secure_args]
    procs: list[subprocess.Popen[bytes]] = []
    controller = f"{'127.0.0.1' if args.host == '0.0.0.0' else args.host}:{args.port}"

    def worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen([*base, "worker", *common, "--controller", controller,
                                 "--port", "0", "--metrics-port", "0",
                                 *(["--no-watchdog"] if args.no_watchdog else [])], start_new_session=True)

    ui_port = free_port(args.host) if args.ui_port == 0 else args.ui_port
    # Every child is stopped on the way out, whatever the way: a controller that never
    # answers, Ctrl-C while starting, an error, or the end of a normal run.
    try:
        procs.append(subprocess.Popen([*base, "controller", *common, "--port", str(args.port),
                                       "--metrics-port", str(args.metrics_port), "--ui-port", str(ui_port)],
                                      start_new_session=True))
        with ControllerClient(controller, security=client_sec) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    client.status()
                    break
                except Exception:
                    if procs[0].poll() is not None or time.monotonic() > deadline:
                        print("millwheel up: the controller did not start", file=sys.stderr)
                        return 1
                    time.sleep(0.1)
            procs += [worker() for _ in range(args.workers)]
            deadline = time.monotonic() + 20
            while len([w for w in client.status().workers if w.alive]) < args.workers:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.1)
        print(f"millwheel is up: controller {controller}, {args.workers} workers, "
              f"store {describe_store(args.store)}\n"
              + "".join(f"{line}\n" for line in how)
              + (f"  console: {'https' if client_sec.tls_cert else 'http'}://{controller.rpartition(':')[0]}:"
                 f"{ui_port}/\n" if ui_port >= 0 else "")
              + f"  try: millwheel status --controller {controller}\n  Ctrl-C stops everything.",
              file=sys.stderr, flush=True)
        _wait_for_signal(Restarter(procs, 1, worker).check)  # a dead worker is restarted
    finally:
        if procs:
            print("millwheel up: stopping workers, then the controller", file=sys.stderr, flush=True)
        for p in procs[1:]:
            p.send_signal(signal.SIGTERM)
        for p in procs[1:]:
            _reap(p, 20)
        if procs:
            procs[0].send_signal(signal.SIGTERM)
            _reap(procs[0], 10)
    return 0


def _reap(p: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


# -- client commands ----------------------------------------------------------------------------
def _client(args: argparse.Namespace) -> ControllerClient:
    return ControllerClient(args.controller, security=security.from_args(args, server=False))


def cmd_register(args: argparse.Namespace) -> int:
    from .convert import spec_dict_to_proto

    data = load_spec_file(args.spec)
    if "computations" in data or "injectors" in data:
        comps, injectors = data.get("computations", []), data.get("injectors", [])
    else:
        comps, injectors = [data], []
    if not isinstance(comps, list) or not isinstance(injectors, list):
        raise InvalidSpecError(f"{args.spec}: 'computations' and 'injectors' must be lists")
    protos = [spec_dict_to_proto(c) for c in comps]  # validate everything before sending
    for i, inj in enumerate(injectors):
        if not isinstance(inj, dict) or not inj.get("name") or not inj.get("stream"):
            raise InvalidSpecError(f"{args.spec}: injectors[{i}] needs 'name' and 'stream'")
    logged = data.get("log_streams", []) if isinstance(data.get("log_streams"), list) else []
    with _client(args) as client:  # all or nothing: one RegisterTopology call
        resp = client.register_topology(protos, [(str(i["name"]), str(i["stream"])) for i in injectors],
                                        [str(s) for s in logged])
    done: list[dict[str, Any]] = [{"injector": i.name, "stream": i.stream} for i in resp.injectors]
    done += [{"computation": c.spec.name, "ranges": len(c.ranges)} for c in resp.computations]
    text = "\n".join(
        f"registered injector {d['injector']!r} -> stream {d['stream']!r}" if "injector" in d
        else f"registered computation {d['computation']!r} ({d['ranges']} key ranges)" for d in done)
    return _emit(args, done, text)


def cmd_unregister(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.unregister(args.name)
    return _emit(args, {"unregistered": args.name}, f"unregistered {args.name!r}")


def _read_records(path: str) -> Iterator[Record]:
    name = "stdin" if path == "-" else path
    fh = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{name}:{n}"
            rec = parse_json_record(line, where)
            if rec.record_id == where:  # no "id" given: the controller assigns one
                rec = Record(rec.key, rec.value, rec.timestamp, "")
            yield rec
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


def cmd_inject(args: argparse.Namespace) -> int:
    if args.file != "-" and not Path(args.file).is_file():
        raise InvalidSpecError(f"{args.file}: no such file")
    messages = inject_messages(
        args.injector, args.stream, _read_records(args.file), batch=args.batch,
        max_disorder_us=None if args.no_watermark else args.max_disorder_us, done=args.done)
    with _client(args) as client:
        resp = client.inject(messages)
    data = {"injector": args.injector, "accepted": resp.accepted, "watermark": resp.watermark}
    return _emit(args, data, f"injected {resp.accepted} records through {args.injector!r}; "
                 f"injector watermark {fmt_ts(resp.watermark)}")


def cmd_watermark(args: argparse.Namespace) -> int:
    with _client(args) as client:
        wms = client.watermarks(args.computation)
    data = [{"node": w.node, "low_watermark": w.low_watermark,
             "input_low_watermark": w.input_low_watermark, "lag_us": w.lag_us} for w in wms]
    rows = [(w.node, fmt_ts(w.low_watermark), fmt_ts(w.input_low_watermark),
             f"{w.lag_us / 1e6:.1f}s") for w in wms]
    return _emit(args, data, table(["NODE", "LOW WATERMARK", "INPUT WATERMARK", "LAG"], rows))


def cmd_state(args: argparse.Namespace) -> int:
    with _client(args) as client:
        resp = client.state(args.computation, args.key)
    timers = [{"tag": t.tag, "time": t.time, "domain": t.domain, "hold": t.hold} for t in resp.timers]
    data = {"computation": args.computation, "key": args.key, "exists": resp.exists,
            "range": resp.range_id, "state": _value_text(resp.state) if resp.exists else None,
            "timers": timers}
    if not resp.exists:
        text = f"{args.computation} key {args.key!r}: no state and no pending timers"
    else:
        text = (f"{args.computation} key {args.key!r} (range {resp.range_id})\nstate: "
                f"{_value_text(resp.state) or '(none)'}\n")
        text += table(["TIMER", "TIME", "DOMAIN", "HOLDS WATERMARK"],
                      [(t["tag"], fmt_ts(t["time"]), t["domain"], t["hold"]) for t in timers]) \
            if timers else "timers: (none)"
    return _emit(args, data, text)


def cmd_keys(args: argparse.Namespace) -> int:
    keys = []
    with _client(args) as client:
        for key in client.keys(args.computation):
            keys.append(key)
            if args.limit and len(keys) >= args.limit:
                break
    return _emit(args, keys, "\n".join(keys) if keys else "(no keys with state)")


def cmd_status(args: argparse.Namespace) -> int:
    from .cli_errors import status_lines

    with _client(args) as client:
        s = client.status()
        errors = status_lines(client)
    data = {
        "store": s.store_url,
        "workers": [{"id": w.worker_id, "address": w.address, "metrics": w.metrics_address,
                     "alive": w.alive, "draining": w.draining, "ranges": w.ranges,
                     "last_heartbeat_age_s": round(w.last_heartbeat_age_s, 3)} for w in s.workers],
        "ranges": [{"node": r.node, "range": r.range_id, "worker": r.worker_id,
                    "address": r.worker_address, "token": r.token, "watermark": r.watermark}
                   for r in s.ranges],
        "watermarks": [{"node": w.node, "low_watermark": w.low_watermark, "lag_us": w.lag_us}
                       for w in s.watermarks],
    }
    parts = [f"store: {s.store_url}", "", table(
        ["WORKER", "ADDRESS", "STATE", "RANGES", "LAST HEARTBEAT", "METRICS"],
        [(w.worker_id, w.address, "draining" if w.draining else "alive" if w.alive else "dead",
          w.ranges, f"{w.last_heartbeat_age_s:.1f}s ago", w.metrics_address) for w in s.workers]),
        "", table(["NODE", "RANGE", "WORKER", "TOKEN", "WATERMARK"],
                  [(r.node, r.range_id, r.worker_id or "(unassigned)", r.token, fmt_ts(r.watermark))
                   for r in s.ranges]),
        "", table(["NODE", "LOW WATERMARK", "LAG"],
                  [(w.node, fmt_ts(w.low_watermark), f"{w.lag_us / 1e6:.1f}s") for w in s.watermarks]),
        *errors]
    return _emit(args, data, "\n".join(parts))


def cmd_computations(args: argparse.Namespace) -> int:
    with _client(args) as client:
        resp = client.computations()
    data = {"computations": [{"name": c.spec.name, "inputs": [i.stream for i in c.spec.inputs],
                              "outputs": list(c.spec.outputs), "code": c.spec.code.name,
                              "key_ranges": c.spec.options.key_ranges,
                              "low_watermark": c.low_watermark} for c in resp.computations],
            "injectors": [{"name": i.name, "stream": i.stream} for i in resp.injectors]}
    text = table(["COMPUTATION", "INPUTS", "OUTPUTS", "CODE", "RANGES", "LOW WATERMARK"], [
        (c["name"], ",".join(c["inputs"]), ",".join(c["outputs"]), c["code"], c["key_ranges"],
         fmt_ts(c["low_watermark"])) for c in data["computations"]])
    text += "\n\n" + table(["INJECTOR", "STREAM"], [(i["name"], i["stream"]) for i in data["injectors"]])
    return _emit(args, data, text)


def cmd_subscribe(args: argparse.Namespace) -> int:
    try:
        return _subscribe(args)
    except BrokenPipeError:  # `millwheel subscribe S | head`
        sys.stderr.close()
        return 0


def _subscribe(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if not args.json:
            print(f"{'SEQ':>8}  {'TIMESTAMP':>18}  KEY  VALUE", flush=True)
        for seq, rec in client.subscribe(args.stream, args.after, args.follow):
            if args.json:
                print(json.dumps({"seq": seq, "key": rec.key, "value": _value_text(rec.value),
                                  "timestamp": rec.timestamp, "id": rec.record_id}), flush=True)
            else:
                print(f"{seq:>8}  {rec.timestamp:>18}  {rec.key}  {_value_text(rec.value)}", flush=True)
    return 0
