"""``millwheel errors`` and ``millwheel dead-letters``: failing user code, seen and
recovered from (docs/service.md, "When user code fails")."""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

from millwheel import late

from ..generated import millwheel_pb2 as pb
from .output import client_for, client_parser, fmt_ts, table


def add_commands(sub: Any) -> None:
    errs = client_parser(
        sub, "errors", "show a computation's failing records and dead letters",
        "Show how a computation's user code fails: the key ranges that cannot run at all "
        "(their code cannot be built, their checkpoints keep failing, or --allow-code "
        "refuses their code), the durable counts of records dead-lettered, skipped and "
        "dropped as late, the records and timers being retried now, and the last errors "
        "given up on (key, record ID, time, attempts, message).")
    errs.add_argument("computation", metavar="COMPUTATION")
    errs.set_defaults(func=cmd_errors)

    dl = sub.add_parser("dead-letters", help="act on a computation's dead letters",
                        description="Act on the dead letters of a computation.")
    dl_sub = dl.add_subparsers(dest="action", metavar="ACTION", required=True)
    replay = client_parser(
        dl_sub, "replay", "re-inject the dead letters into the computation, once",
        "Hand the computation's dead letters back to it (and to no other consumer "
        "of its inputs), after its code was fixed. It takes the dead letters present when it "
        "starts (not those its records write if the code still fails) and stops at --timeout, "
        "saying how many remain. Exactly once: replaying again first finishes a replay that was "
        "cut off, then hands over only dead letters written since. Dead letters of timers and "
        "of records whose key could not be extracted are not replayed (counted as skipped).")
    replay.add_argument("computation", metavar="COMPUTATION")
    replay.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="stop handing over after this long (default 120); run again for the rest")
    replay.set_defaults(func=cmd_replay)


def _error_dict(e: pb.ErrorInfo) -> dict[str, Any]:
    return {"range": e.range_id, "key": e.key, "record_id": e.record_id, "time": e.time,
            "attempts": e.attempts, "exception_type": e.exception_type, "message": e.message,
            "outcome": e.outcome, "where": e.where}


def _rows(errors: Any) -> list[tuple[Any, ...]]:
    return [(e.range_id, e.key, e.record_id.replace("\x1f", "/")[:60], fmt_ts(e.time) if e.time else "-", e.attempts,
             e.outcome, f"{e.exception_type}: {e.message}" + (f" (at {e.where})" if e.where else "")) for e in errors]


HEADERS = ["RANGE", "KEY", "RECORD", "TIME", "ATTEMPTS", "OUTCOME", "ERROR"]
RANGE_HEADERS = ["RANGE", "STAGE", "WORKER", "SINCE", "ATTEMPTS", "NEXT TRY", "ERROR"]


def _failure_dict(f: pb.RangeFailure) -> dict[str, Any]:
    return {"range": f.range_id, "stage": f.stage, "worker": f.worker_id, "since": f.since, "last": f.last,
            "attempts": f.attempts, "retry_in_s": round(f.retry_in_s, 2),
            "exception_type": f.exception_type, "message": f.message}


def _failure_rows(failing: Any) -> list[tuple[Any, ...]]:
    return [(f.range_id, f.stage, f.worker_id, fmt_ts(f.since) if f.since else "-", f.attempts,
             f"{f.retry_in_s:.1f} s", f"{f.exception_type}: {f.message}"[:200]) for f in failing]


def errors_data(info: pb.ComputationInfo) -> dict[str, Any]:
    return {"computation": info.spec.name, "on_error": info.spec.options.on_error or "dead_letter",
            "dead_letter_stream": info.spec.options.dead_letter_stream
            or f"{info.spec.name}.dead_letters",
            "dead_lettered": info.dead_lettered, "skipped": info.skipped,
            "late_dropped": info.late_dropped,
            "late": late_data(info),
            "failing_ranges": [_failure_dict(f) for f in info.failing_ranges],
            "retrying": [_error_dict(e) for e in info.retrying],
            "recent_errors": [_error_dict(e) for e in info.recent_errors]}


def cmd_errors(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        info = client.describe(args.computation)
    data = errors_data(info)
    lines = [f"computation {data['computation']}: on_error {data['on_error']}, "
             f"{data['dead_lettered']} dead-lettered (stream {data['dead_letter_stream']}), "
             f"{data['skipped']} skipped, {data['late_dropped']} late records dropped"]
    lines += [f"late records (behind the input watermark), per input: {late_text(info)}"]
    lines += ["", "failing ranges (cannot run at all; retried with backoff):",
              table(RANGE_HEADERS, _failure_rows(info.failing_ranges)) if info.failing_ranges else "  (none)"]
    lines += ["", "retrying now:", table(HEADERS, _rows(info.retrying)) if info.retrying else "  (none)"]
    lines += ["", "recent errors, newest first:",
              table(HEADERS, _rows(info.recent_errors)) if info.recent_errors else "  (none)"]
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print("\n".join(lines))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        resp = client.replay_dead_letters(args.computation, timeout_s=args.timeout)
    if args.json:
        print(json.dumps({"replayed": resp.replayed, "skipped": resp.skipped, "remaining": resp.remaining,
                          "expired_through": resp.expired_through}))
    else:
        print(f"replayed {resp.replayed} dead letters into {args.computation}"
              + (f" ({resp.skipped} not replayable: timers or unkeyable records)" if resp.skipped else "")
              + (f"; {resp.remaining} remain (the time ran out): run it again" if resp.remaining else ""))
        if resp.expired_through:
            print(f"dead letters through log position {resp.expired_through} were removed by the "
                  "dead-letter stream's log retention before they were replayed (log_retention_us / "
                  f"log_retention_bytes of {args.computation})")
    return 0


def late_data(info: pb.ComputationInfo) -> list[dict[str, Any]]:
    """A computation's late records per input stream and action, as ``--json`` shows them."""
    return [{"input": c.input, "action": c.action, "count": c.count} for c in info.late]


def late_text(info: pb.ComputationInfo) -> str:
    """``clicks 120 dropped, 3 processed; views 0 late``: every input of the computation,
    then any other counted (records whose stream was not known: replayed dead letters)."""
    return "; ".join(late.describe({(c.input, c.action): c.count for c in info.late},
                                   [i.stream for i in info.spec.inputs]))


def status_lines(comps: Sequence[pb.ComputationInfo]) -> list[str]:
    """The error summary ``millwheel status`` prints: computations with any errors, and
    those that had late records, per input."""
    late_lines = [f"  {c.spec.name}: {late_text(c)}" for c in comps if c.late]
    lines = ["", "late records (behind the input watermark), per input:", *late_lines] if late_lines else []
    rows = [(c.spec.name, len(c.failing_ranges), c.dead_lettered, c.skipped, c.late_dropped, len(c.retrying),
             (c.failing_ranges[0].message if c.failing_ranges else
              c.recent_errors[0].message if c.recent_errors else "")[:60])
            for c in comps
            if c.failing_ranges or c.dead_lettered or c.skipped or c.late_dropped or c.retrying
            or (c.recent_errors and c.recent_errors[0].outcome == "reload_failed")]  # its newest: a failed --reload
    if not rows:
        return lines
    return ["", table(["COMPUTATION", "FAILING RANGES", "DEAD-LETTERED", "SKIPPED", "LATE DROPPED",
                       "RETRYING", "LAST ERROR"], rows), "(details: millwheel errors COMPUTATION)", *lines]
