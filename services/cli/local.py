"""Local-mode commands: ``millwheel run`` and ``millwheel demo``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import runpy
import sys
from pathlib import Path
from typing import Any

from millwheel import late
from millwheel.errors import InvalidSpecError
from millwheel.runtime.crash import crash_hook_from_env
from millwheel.runtime.local_runner import LocalRunner, print_progress
from millwheel.runtime.writer_process import check_store_url
from millwheel.sources import Source
from millwheel.spec import load_spec_file, sources_from_dict, topology_from_dict
from millwheel.state import open_store
from millwheel.state.protocol import StateStore
from millwheel.state.url_display import describe_store
from millwheel.topology import ComputationSpec, Topology

DEFAULT_STORE = "sqlite:///millwheel-data/local.db"
#: ``millwheel run``'s exit status when it finished but dead-lettered records on the way
#: (a pipeline that ran "successfully" while setting input aside must not look clean).
EXIT_DEAD_LETTERS = 3


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="run a topology in this process (local mode)",
        description=(
            "Run a topology to completion in one process, exactly-once over the store. "
            "PATH_OR_MODULE is a YAML/JSON spec (injectors reading JSON-lines files or pulling a "
            "source, sinks; docs/connectors.md), or a "
            "Python file or module that defines `topology` (a millwheel.Topology) and "
            "`sources` (injector name -> Source). Re-running on the same store resumes."
        ),
    )
    run.add_argument("target", metavar="PATH_OR_MODULE")
    run.add_argument("--store", default=DEFAULT_STORE, help=f"store URL (default {DEFAULT_STORE})")
    run.add_argument("--print", dest="print_streams", action="append", default=[], metavar="STREAM",
                     help="print this sink stream's records as JSON lines when done (repeatable)")
    run.add_argument("--batch-size", type=int, default=None, metavar="N",
                     help="records per batch and checkpoint (default: the runner's, 5000)")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--writer-process", action="store_true",
                     help="apply each step's store writes in a child process while the next "
                          "step runs (uses a second core; sqlite:/// file stores only)")
    run.add_argument("--dead-letters-ok", action="store_true",
                     help=f"exit 0 even when this run dead-lettered records (default: exit "
                          f"{EXIT_DEAD_LETTERS}, so a script notices)")
    run.epilog = (f"Exit status: 0 done; {EXIT_DEAD_LETTERS} done, but this run dead-lettered records "
                  "(a computation's or a source's bad input: see them with --print STREAM.dead_letters); "
                  "1 an error.")
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="run a bundled demo", description="Run a bundled demo.")
    demo_sub = demo.add_subparsers(dest="demo", metavar="DEMO", required=True)
    from millwheel.demo import zeitgeist

    zeitgeist.add_arguments(demo_sub.add_parser(
        "zeitgeist", help="MillWheel's Zeitgeist: spike and dip detection on search queries",
        description=zeitgeist.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    ))
    demo.set_defaults(func=lambda args: zeitgeist.main(args))


def load_target(target: str) -> tuple[Topology, dict[str, Source]]:
    path = Path(target)
    if path.suffix in (".yaml", ".yml", ".json"):
        sys.path.insert(0, str(path.resolve().parent))
        data = load_spec_file(path)
        return topology_from_dict(data), sources_from_dict(data, path.parent)
    if path.suffix == ".py":
        if not path.is_file():
            raise InvalidSpecError(f"{target}: no such file")
        sys.path.insert(0, str(path.resolve().parent))  # so `module:Class` code refs beside it import
        namespace = runpy.run_path(str(path))
    else:
        if importlib.util.find_spec(target) is None:
            raise InvalidSpecError(f"{target}: neither a spec file, a .py file nor an importable module")
        namespace = vars(importlib.import_module(target))
    topology, sources = namespace.get("topology"), namespace.get("sources")
    if not isinstance(topology, Topology):
        raise InvalidSpecError(f"{target}: must define `topology` as a millwheel.Topology")
    if not isinstance(sources, dict):
        raise InvalidSpecError(f"{target}: must define `sources` as a dict of injector name -> Source")
    return topology, sources


def cmd_run(args: argparse.Namespace) -> int:
    topology, sources = load_target(args.target)
    if args.writer_process:  # before the store is opened (a Redis URL would be tried for 30 s)
        check_store_url(args.store)
    store = open_store(args.store)
    if not args.quiet:
        print(f"store {describe_store(args.store)}", file=sys.stderr)
    try:
        if args.batch_size is not None and args.batch_size < 1:
            raise InvalidSpecError(f"--batch-size must be >= 1, got {args.batch_size}")
        extra = {"batch_size": args.batch_size} if args.batch_size else {}
        dead_letters = {c.dead_letter_stream for c in topology.computations}
        dead_letters |= {inj.dead_letter_stream for inj in topology.injectors if inj.source is not None}
        before = {s: store.log_end(s)[1] for s in dead_letters}
        late_before = {c.name: _late_counts(store, c) for c in topology.computations}
        runner = LocalRunner(topology, store, sources, crash=crash_hook_from_env(),
                             writer_process=args.writer_process, **extra)
        try:
            runner.run(on_progress=None if args.quiet else print_progress)
        finally:
            runner.stop_writer()
        sinks = topology.sink_streams()
        for stream in sinks:
            count = store.log_end(stream)[1]  # counted by the store: the log is not read
            if count or stream not in dead_letters:  # a dead-letter stream only when it has any
                print(f"{stream}: {count} records", file=sys.stderr)
                _say_what_retention_removed(store, stream, count)
        for spec in topology.computations:  # late records this run counted, per input
            counts = _late_counts(store, spec)
            counts = {k: n - late_before[spec.name].get(k, 0) for k, n in counts.items()}
            if any(counts.values()):
                shown = "; ".join(late.describe({k: n for k, n in counts.items() if n},
                                                [i.stream for i in spec.inputs]))
                print(f"{spec.name}: late records (behind the input watermark), per input: {shown}",
                      file=sys.stderr)
        for stream in args.print_streams:
            if stream not in sinks:
                _say_what_retention_removed(store, stream, store.log_end(stream)[1])
            print_log(store, stream)
        new_letters = {s: n for s in sorted(dead_letters) if (n := store.log_end(s)[1] - before[s]) > 0}
    finally:
        store.close()
    if new_letters and not args.dead_letters_ok:
        listed = ", ".join(f"{s} {n}" for s, n in new_letters.items())
        print(f"millwheel run: done, but this run dead-lettered records ({listed}): see them with "
              f"--print STREAM; exit status {EXIT_DEAD_LETTERS} "
              "(--dead-letters-ok: 0)", file=sys.stderr)
        return EXIT_DEAD_LETTERS
    return 0


def _late_counts(store: StateStore, spec: ComputationSpec) -> late.Counts:
    """``spec``'s durable late counts (:mod:`millwheel.late`), summed over its ranges."""
    return late.summed(store.read_errors(spec.name, r).counters for r in range(spec.options.key_ranges))


def _say_what_retention_removed(store: Any, stream: str, kept: int) -> None:
    """On stderr, when the stream's log retention removed its oldest records: the count
    and ``--print`` show only what is kept, and a user comparing a run's output with
    another's must not take that for all of it (a 10M-event Nexmark q0 kept 1.3M of its
    9.2M rows under the default 256 MiB, and said nothing)."""
    removed_through = store.log_start(stream)
    if removed_through:
        print(f"{stream}: log retention removed its oldest records (every one through log position "
              f"{removed_through}; log_retention_bytes / log_retention_us of the computation writing it): "
              f"the count and --print {stream} cover only the {kept} kept. Set options: "
              "{log_retention_bytes: 0} on that computation to keep a run's whole output", file=sys.stderr)


def print_log(store: Any, stream: str, page: int = 10_000) -> None:
    """Every record of ``stream``'s log as a JSON line on stdout, read a page at a time
    and written a page per call: memory stays one page however long the log (a 10M-event
    Nexmark run prints 9.2M rows), and a line costs no ``print`` call of its own."""
    after = 0
    while batch := store.read_log(stream, after, page):
        sys.stdout.write("".join(json.dumps(record_json(rec)) + "\n" for _seq, rec in batch))
        after = batch[-1][0]
    sys.stdout.flush()


def record_json(rec: Any) -> dict[str, Any]:
    return {"key": rec.key, "value": rec.value.decode("utf-8", "replace"),
            "timestamp": rec.timestamp, "id": rec.record_id}
