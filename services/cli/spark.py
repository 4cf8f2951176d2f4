"""Spark commands: ``millwheel backfill``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from millwheel.errors import InvalidSpecError
from millwheel.spark.backfill import backfill, compare, streamed_results
from millwheel.state import open_store

from .local import DEFAULT_STORE, load_target


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "backfill",
        help="recompute a windowed computation's results from the record log with Spark",
        description=(
            "Recompute every window of COMPUTATION (a spark_aggregate or window_aggregate) that lies "
            "inside [--from, --to) from its input stream in the durable stream log, with one Spark "
            "job. The input stream must be logged (a sink, or in the topology's log_streams). "
            "Results go to a stream log (--to-stream, idempotent: record IDs derive from computation, "
            "key and window), a JSON-lines file (--out), or stdout. --compare reports every window "
            "whose result differs from what the streaming path emitted, and exits 1 if any does."
        ),
    )
    p.add_argument("computation", metavar="COMPUTATION")
    p.add_argument("--from", dest="t_from", required=True, type=parse_time, metavar="T1",
                   help="range start: integer µs since the epoch or ISO-8601 (UTC if no zone)")
    p.add_argument("--to", dest="t_to", required=True, type=parse_time, metavar="T2",
                   help="range end (exclusive), same forms as --from")
    p.add_argument("--spec", required=True, metavar="SPEC",
                   help="the topology: YAML/JSON spec, or a .py file/module defining `topology`")
    p.add_argument("--store", default=DEFAULT_STORE, help=f"store URL (default {DEFAULT_STORE})")
    dest = p.add_mutually_exclusive_group()
    dest.add_argument("--to-stream", metavar="NAME", help="append the results to this stream log")
    dest.add_argument("--out", metavar="FILE", help="write the results as JSON lines to FILE")
    p.add_argument("--compare", action="store_true",
                   help="compare with the streaming results (the computation's logged output stream)")
    p.add_argument("--master", default=None,
                   help="Spark master; beats $MILLWHEEL_SPARK_MASTER, which beats the stage's 'master' "
                        "param (default local[*])")
    p.set_defaults(func=cmd_backfill)


def parse_time(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither integer microseconds nor an ISO-8601 time"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    delta = when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def cmd_backfill(args: argparse.Namespace) -> int:
    topology, _sources = load_target(args.spec)
    store = open_store(args.store)
    try:
        results = backfill(topology, args.computation, store, args.t_from, args.t_to, master=args.master)
        if args.to_stream:
            if args.to_stream in {s for c in topology.computations for s in c.all_outputs()} | {
                i.stream for i in topology.injectors
            }:
                raise InvalidSpecError(
                    f"--to-stream {args.to_stream!r} is a stream of the running topology; "
                    "use a stream name of its own"
                )
            added = store.append_log(args.to_stream, [r.to_record(args.computation) for r in results])
            print(f"backfill: {len(results)} windows, {added} new records in stream {args.to_stream!r}",
                  file=sys.stderr)
        elif args.out:
            with Path(args.out).open("w") as fh:
                for r in results:
                    fh.write(json.dumps(r.payload()) + "\n")
            print(f"backfill: {len(results)} windows written to {args.out}", file=sys.stderr)
        elif not args.compare:
            for r in results:
                print(json.dumps(r.payload()))
        if args.compare:
            streamed = streamed_results(topology, args.computation, store, args.t_from, args.t_to)
            diff = compare(results, streamed)
            for r in diff.missing_in_stream:
                print(json.dumps({"diff": "missing_in_stream", "backfill": r.payload()}))
            for r in diff.missing_in_backfill:
                print(json.dumps({"diff": "missing_in_backfill", "stream": r.payload()}))
            for b, s in diff.different:
                print(json.dumps({"diff": "different", "backfill": b.payload(), "stream": s.payload()}))
            print(
                f"compare: {diff.compared} windows in both, {len(diff.different)} different, "
                f"{len(diff.missing_in_stream)} only in backfill, "
                f"{len(diff.missing_in_backfill)} only in the stream",
                file=sys.stderr,
            )
            return 0 if diff.equal else 1
    finally:
        store.close()
    return 0
