"""Client commands: talk to a running controller (register, unregister, inject,
watermark, state, keys, status, computations, subscribe).

Every client command prints a human table by default and JSON with ``--json``; the
controller address comes from ``--controller``, ``$MILLWHEEL_CONTROLLER`` or
127.0.0.1:7070. The process commands (up, controller, worker) are in
:mod:`services.cli.service`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator

from millwheel.errors import InvalidSpecError
from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.sources import parse_json_record
from millwheel.spec import load_spec_file, spec_parts

from ..client import inject_messages
from .errors import late_data, status_lines
from .output import client_for, client_parser, emit, fmt_event_time, fmt_lag, fmt_ts, json_ts, table, worker_state


def add_commands(sub: Any) -> None:
    reg = client_parser(sub, "register", "register computations (and injectors) from a spec file",
                        "Register the computations of a YAML/JSON spec file: either one computation "
                        "mapping (name, inputs, outputs, code, options) or a topology with "
                        "'injectors' and 'computations', all or nothing (one RegisterTopology call: "
                        "if anything is refused, nothing is registered). Ones identical to the "
                        "registered ones are left as they are; ones that differ are an error.")
    reg.add_argument("spec", metavar="SPEC.yaml|json")
    reg.set_defaults(func=cmd_register)

    unreg = client_parser(sub, "unregister", "unregister a computation",
                          "Unregister a computation (refused while another consumes its output).")
    unreg.add_argument("name", metavar="COMPUTATION")
    unreg.set_defaults(func=cmd_unregister)

    inj = client_parser(sub, "inject", "inject JSON-lines records through an injector",
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
    par = inj.add_argument_group(
        "parallel ingestion (docs/service.md)",
        "Records go straight to the workers owning the injector's key ranges; the controller "
        "only says where they are and keeps each writer's watermark.")
    par.add_argument("--writer", default="inject", metavar="NAME",
                     help="this writer's name: the injector's watermark is the least of its live "
                          "writers'; --done says this writer is done (default 'inject': every "
                          "`millwheel inject` without --writer is the same writer). Give writers "
                          "that feed one injector at once names of their own")
    par.add_argument("--key-ranges", type=int, default=0, metavar="N",
                     help="key ranges of an injector registered by this call (default: the most "
                          "of its stream's consumers')")
    par.add_argument("--via-controller", action="store_true",
                     help="send every record through the controller's Inject instead (one "
                          "watermark for all callers; what plain gRPC clients use)")
    inj.set_defaults(func=cmd_inject)

    wm = client_parser(sub, "watermark", "show low watermarks and what holds them",
                       "Show the low watermark of every computation and injector, or of one, and "
                       "what holds it where it is (HELD BY): a range not reporting or failing, "
                       "'input: NODE' (its slowest upstream node), a range's own pending work (its "
                       "earliest timer not yet fired, else its oldest production not yet acked: "
                       "time, key, tag or stream), an injector's slowest live writer, its outbox "
                       "or its watermark as set.")
    wm.add_argument("computation", nargs="?", default="", metavar="COMPUTATION")
    wm.add_argument("--why", action="store_true",
                    help="follow 'input: NODE' upstream from COMPUTATION to what holds the chain")
    wm.set_defaults(func=cmd_watermark)

    st = client_parser(sub, "state", "show the state and pending timers of a key",
                       "Show the stored state bytes and pending timers of one key of a computation.")
    st.add_argument("computation", metavar="COMPUTATION")
    st.add_argument("key", metavar="KEY")
    st.set_defaults(func=cmd_state)

    ks = client_parser(sub, "keys", "list the keys with state", "List the keys of a computation that have state.")
    ks.add_argument("computation", metavar="COMPUTATION")
    ks.add_argument("--limit", type=int, default=0, help="at most this many (default all)")
    ks.set_defaults(func=cmd_keys)

    stat = client_parser(sub, "status", "show workers, ranges, tokens and watermarks",
                         "Show the cluster: workers, every key range with its owner and token, "
                         "and watermarks with their lag.")
    stat.set_defaults(func=cmd_status)

    comps = client_parser(sub, "computations", "list registered computations and injectors",
                          "List registered computations and injectors.")
    comps.set_defaults(func=cmd_computations)

    subs = client_parser(sub, "subscribe", "print the records of a sink stream",
                         "Print the records of a sink stream (one no computation consumes) from "
                         "the stream log, from the start or after --after; --follow keeps "
                         "printing new records.")
    subs.add_argument("stream", metavar="STREAM")
    subs.add_argument("--after", type=int, default=0, metavar="SEQ", help="start after this position")
    subs.add_argument("--follow", "-f", action="store_true", help="keep streaming new records")
    subs.add_argument("--from-oldest", action="store_true",
                      help="if the log's retention removed the records after --after, start at the "
                           "oldest record kept instead of failing (skipping what was removed)")
    subs.set_defaults(func=cmd_subscribe)


def _value_text(value: bytes) -> str:
    return value.decode("utf-8", "replace")


_quoted = json.encoder.encode_basestring_ascii  # what json.dumps does with a str (ensure_ascii)


def _json_line(seq: int, rec: Record) -> str:
    """``json.dumps({"seq", "key", "value", "timestamp", "id"})`` of one log entry, the
    same text (json.dumps' separators, ASCII), at a fifth of its cost: only the three
    strings go through the encoder."""
    return (f'{{"seq": {seq:d}, "key": {_quoted(rec.key)}, "value": {_quoted(_value_text(rec.value))}, '
            f'"timestamp": {rec.timestamp:d}, "id": {_quoted(rec.record_id)}}}')


# -- client commands ----------------------------------------------------------------------------
def cmd_register(args: argparse.Namespace) -> int:
    from ..rpc.convert import spec_to_proto

    data = load_spec_file(args.spec)
    # One computation mapping, or a topology read exactly as `millwheel run` reads it
    # (spec_parts: an unknown field anywhere is refused), all checked before sending.
    if "name" in data and "computations" not in data:
        comps, injectors, logged, sinks = spec_parts({"computations": [data]})
    else:
        comps, injectors, logged, sinks = spec_parts(data)
        refuse_local_fields(data, Path(args.spec))
    with client_for(args) as client:  # all or nothing: one RegisterTopology call
        resp = client.register_topology([spec_to_proto(c) for c in comps], list(injectors), logged, sinks)
    done: list[dict[str, Any]] = [{"injector": i.name, "stream": i.stream} for i in resp.injectors]
    done += [{"computation": c.spec.name, "ranges": len(c.ranges)} for c in resp.computations]
    text = "\n".join(
        f"registered injector {d['injector']!r} -> stream {d['stream']!r}" if "injector" in d
        else f"registered computation {d['computation']!r} ({d['ranges']} key ranges)" for d in done)
    return emit(args, done, text)


def refuse_local_fields(data: Any, spec: Path) -> None:
    """An injector's fields that ``millwheel run`` honours and the service cannot,
    refused by name, with what to do instead: never registered without them (the
    injector would wait for records and a watermark nobody sends, issue 34).

    ``file:`` is a file on this machine that ``run`` reads to its end (the watermark
    the newest time minus ``max_disorder_us`` meanwhile, the end of time after the last
    line); the service's workers cannot read it, and what does the same is ``millwheel
    inject FILE --max-disorder-us N --done`` once registered. An injector without a
    ``source:`` takes its watermark from whoever injects (``--max-disorder-us``), so its
    own ``max_disorder_us`` has nothing to set (with a ``source:`` it is the source's
    default and is carried in the source's settings)."""
    for i, inj in enumerate(data.get("injectors", [])):
        name = inj["name"]
        if "file" in inj:
            given = Path(str(inj["file"]))
            path = given if given.is_absolute() else spec.parent / given
            command = ["millwheel", "inject", os.path.relpath(path), "--injector", str(name)]
            if inj.get("max_disorder_us"):
                command += ["--max-disorder-us", str(inj["max_disorder_us"])]
            raise InvalidSpecError(
                f"injectors[{i}] {name!r}: 'file' is read by `millwheel run` on this machine, and the "
                f"service does not read the client's files; register the injector without 'file' "
                f"(and 'max_disorder_us'), then send the file: {shlex.join([*command, '--done'])} "
                "(or read files on the workers' machines with a files source under a directory "
                "the operator allowed: --allow-source-path, docs/connectors.md)")
        if "max_disorder_us" in inj and "source" not in inj:
            raise InvalidSpecError(
                f"injectors[{i}] {name!r}: 'max_disorder_us' sets nothing in the service: an injector "
                "without a 'source' takes its watermark from whoever injects; give it there "
                f"({shlex.join(['millwheel', 'inject', 'FILE', '--injector', str(name)])} --max-disorder-us N) "
                "and register the injector without it")


def cmd_unregister(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        client.unregister(args.name)
    return emit(args, {"unregistered": args.name}, f"unregistered {args.name!r}")


def _read_records(path: str) -> Iterator[Record]:
    name = "stdin" if path == "-" else path
    fh = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{name}:{n}"
            rec = parse_json_record(line, where)
            if rec.record_id == where:  # no "id" given: inject_messages assigns one
                rec = Record(rec.key, rec.value, rec.timestamp, "")
            yield rec
    finally:
        if fh is not sys.stdin.buffer:
            fh.close()


def cmd_inject(args: argparse.Namespace) -> int:
    if args.file != "-" and not Path(args.file).is_file():
        raise InvalidSpecError(f"{args.file}: no such file")
    if args.batch < 1:
        raise InvalidSpecError(f"--batch must be at least 1, got {args.batch}")
    if not args.via_controller:
        return _inject_direct(args)
    messages = inject_messages(
        args.injector, args.stream, _read_records(args.file), batch=args.batch,
        max_disorder_us=None if args.no_watermark else args.max_disorder_us, done=args.done)
    with client_for(args) as client:
        resp = client.inject(messages)
    data = {"injector": args.injector, "accepted": resp.accepted, "watermark": json_ts(resp.watermark)}
    return emit(args, data, f"injected {resp.accepted} records through {args.injector!r}; "
                 f"injector watermark {fmt_ts(resp.watermark)}")


def _inject_direct(args: argparse.Namespace) -> int:
    """Parallel ingestion (services/inject_writer.py): the records to their ranges' owners,
    this writer's watermark (the newest timestamp so far minus --max-disorder-us) after
    each batch, coalesced; --done at the end."""
    from ..inject_writer import InjectWriter

    newest = MIN_TIMESTAMP
    with client_for(args) as client:
        with InjectWriter(client, args.injector, stream=args.stream, writer=args.writer,
                          key_ranges=args.key_ranges) as writer:
            chunk: list[Record] = []
            for rec in _read_records(args.file):
                chunk.append(rec)
                newest = max(newest, rec.timestamp)
                if len(chunk) >= args.batch:
                    writer.write(chunk)
                    chunk = []
                    if not args.no_watermark:
                        writer.advance(max(MIN_TIMESTAMP, newest - args.max_disorder_us))
            writer.write(chunk)
            if args.done:
                writer.done()
            elif not args.no_watermark and newest > MIN_TIMESTAMP:
                writer.advance(max(MIN_TIMESTAMP, newest - args.max_disorder_us), now=True)
            else:
                writer.flush()
        accepted, watermark = writer.written, writer.watermark
    data = {"injector": args.injector, "accepted": accepted, "watermark": json_ts(watermark)}
    return emit(args, data, f"injected {accepted} records through {args.injector!r}; "
                 f"injector watermark {fmt_ts(watermark)}")


def cmd_watermark(args: argparse.Namespace) -> int:
    if args.why and not args.computation:
        raise InvalidSpecError("--why follows one node's watermark upstream: name the COMPUTATION")
    with client_for(args) as client:
        wms = client.watermarks(args.computation)
        if args.why:  # up the chain of "input: NODE" to what holds it
            seen = {w.node for w in wms}
            while wms[-1].held_by.startswith("input: ") and len(wms) < 100:
                up = wms[-1].held_by[len("input: "):]
                if up in seen:
                    break
                seen.add(up)
                wms += client.watermarks(up)
    data = [{"node": w.node, "low_watermark": json_ts(w.low_watermark),
             "input_low_watermark": json_ts(w.input_low_watermark), "lag_us": w.lag_us,
             "held_by": w.held_by} for w in wms]
    rows = [(w.node, fmt_ts(w.low_watermark), fmt_ts(w.input_low_watermark), w.held_by or "-", fmt_lag(w.lag_us))
            for w in wms]
    return emit(args, data, table(["NODE", "LOW WATERMARK", "INPUT WATERMARK", "HELD BY", "LAG"], rows))


def _labelled_state(client: Any, computation: str, state: bytes) -> dict[str, Any] | None:
    """A built-in operator's state with its fields named (the console's labels,
    services/ui/state_view.py); None for user code's state or one that is not JSON."""
    from ..rpc.convert import spec_from_proto
    from ..ui.state_view import labelled

    try:
        decoded = json.loads(state)
    except ValueError:
        return None
    try:
        spec = spec_from_proto(client.describe(computation).spec)
    except Exception:  # noqa: BLE001 - no labels is the plain output, never an error
        return None
    return labelled(spec, decoded)


def cmd_state(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        resp = client.state(args.computation, args.key)
        labels = _labelled_state(client, args.computation, resp.state) if resp.exists and resp.state else None
    timers: list[dict[str, Any]] = [{"tag": t.tag, "time": t.time, "domain": t.domain, "hold": t.hold}
                                    for t in resp.timers]
    data = {"computation": args.computation, "key": args.key, "exists": resp.exists,
            "range": resp.range_id, "state": _value_text(resp.state) if resp.exists else None,
            "timers": timers}
    if labels is not None:
        data["state_labelled"] = labels
    if not resp.exists:
        text = f"{args.computation} key {args.key!r}: no state and no pending timers"
    else:
        text = (f"{args.computation} key {args.key!r} (range {resp.range_id})\nstate: "
                f"{_value_text(resp.state) or '(none)'}\n")
        if labels is not None:
            text += f"as {labels['operator']} state:\n" + "".join(
                f"  {e['label']}: " + ", ".join(f"{k}={v}" for k, v in e["fields"].items()) + "\n"
                for e in labels["entries"])
        text += table(["TIMER", "TIME", "DOMAIN", "HOLDS WATERMARK"],
                      [(t["tag"], fmt_ts(t["time"]), t["domain"], t["hold"]) for t in timers]) \
            if timers else "timers: (none)"
    return emit(args, data, text)


def cmd_keys(args: argparse.Namespace) -> int:
    keys = []
    with client_for(args) as client:
        for key in client.keys(args.computation):
            keys.append(key)
            if args.limit and len(keys) >= args.limit:
                break
    return emit(args, keys, "\n".join(keys) if keys else "(no keys with state)")


def cmd_status(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        s = client.status()
        comps = client.computations().computations
        errors = status_lines(comps)
    data = {
        "store": s.store_url,
        "leader": s.leader, "leader_epoch": s.leader_epoch, "answered_by": s.answered_by,
        "workers": [{"id": w.worker_id, "address": w.address, "metrics": w.metrics_address,
                     "alive": w.alive, "draining": w.draining, "ranges": w.ranges,
                     "last_heartbeat_age_s": round(w.last_heartbeat_age_s, 3)} for w in s.workers],
        "ranges": [{"node": r.node, "range": r.range_id, "worker": r.worker_id,
                    "address": r.worker_address, "token": r.token, "watermark": json_ts(r.watermark),
                    "pending": r.pending}
                   for r in s.ranges],
        "watermarks": [{"node": w.node, "low_watermark": json_ts(w.low_watermark), "lag_us": w.lag_us}
                       for w in s.watermarks],
        "versions": [{"computation": v.name, "version": v.version, "has_previous": v.has_previous}
                     for v in s.versions],
        "late": {c.spec.name: late_data(c) for c in comps if c.late},  # per input and action
    }
    leader = (f"leader: {s.leader} (epoch {s.leader_epoch})" if s.leader
              else "leader: none elected yet")
    if s.answered_by and s.answered_by != s.leader:
        leader += f"; answered by standby {s.answered_by} (worker liveness unknown there)"
    parts = [f"store: {s.store_url}", leader, "", table(
        ["WORKER", "ADDRESS", "STATE", "RANGES", "LAST HEARTBEAT", "METRICS"],
        [(w.worker_id, w.address, worker_state(w.alive, w.draining),
          w.ranges, f"{w.last_heartbeat_age_s:.1f}s ago", w.metrics_address) for w in s.workers]),
        "", table(["NODE", "RANGE", "WORKER", "TOKEN", "WATERMARK", "PENDING"],
                  [(r.node, r.range_id, r.worker_id or "(unassigned)", r.token, fmt_ts(r.watermark),
                    r.pending) for r in s.ranges]),
        "", table(["NODE", "LOW WATERMARK", "LAG"],
                  [(w.node, fmt_ts(w.low_watermark), fmt_lag(w.lag_us)) for w in s.watermarks]),
        "", table(["COMPUTATION", "VERSION"], [(v.name, _version(v.version, v.has_previous)) for v in s.versions]),
        *errors]
    return emit(args, data, "\n".join(parts))


def _version(version: int, has_previous: bool) -> str:
    """A computation's version as shown: ``3`` or, with a rollback target, ``3 (rollback: 2)``
    (a controller from before versions answers 0: shown as 1, what it runs)."""
    version = version or 1
    return f"{version} (rollback: {version - 1})" if has_previous else str(version)


def cmd_computations(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        resp = client.computations()
    data: dict[str, list[dict[str, Any]]] = {
        "computations": [{"name": c.spec.name, "inputs": [i.stream for i in c.spec.inputs],
                          "outputs": list(c.spec.outputs), "code": c.spec.code.name,
                          "key_ranges": c.spec.options.key_ranges, "version": c.version,
                          "has_previous": c.has_previous,
                          "low_watermark": json_ts(c.low_watermark)} for c in resp.computations],
            "injectors": [{"name": i.name, "stream": i.stream} for i in resp.injectors]}
    text = table(["COMPUTATION", "VERSION", "INPUTS", "OUTPUTS", "CODE", "RANGES", "LOW WATERMARK"], [
        (c["name"], _version(info.version, info.has_previous), ",".join(c["inputs"]), ",".join(c["outputs"]),
         c["code"], c["key_ranges"], fmt_ts(info.low_watermark))
        for c, info in zip(data["computations"], resp.computations, strict=True)])
    text += "\n\n" + table(["INJECTOR", "STREAM"], [(i["name"], i["stream"]) for i in data["injectors"]])
    return emit(args, data, text)


def cmd_subscribe(args: argparse.Namespace) -> int:
    try:
        return _subscribe(args)
    except BrokenPipeError:  # `millwheel subscribe S | head`
        sys.stderr.close()
        return 0


def _subscribe(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        if not args.json:
            print(f"{'SEQ':>8}  {'TIMESTAMP (UTC)':<27}  KEY  VALUE", flush=True)
        out = sys.stdout
        # A batch as the controller sent it, written and flushed at once: a line a record,
        # as before, without a write and a flush each (millwheel subscribe keeps up with a log).
        for batch in client.subscribe_batches(args.stream, args.after, args.follow, args.from_oldest):
            if args.json:
                lines = [_json_line(seq, rec) for seq, rec in batch]
            else:
                lines = [f"{seq:>8}  {fmt_event_time(rec.timestamp):<27}  {rec.key}  {_value_text(rec.value)}"
                         for seq, rec in batch]
            lines.append("")
            out.write("\n".join(lines))
            out.flush()
    return 0
