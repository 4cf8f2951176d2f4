"""What every client command shares: its parser (``--controller``, ``--json``, the client
security flags), the client those flags describe, and the table/JSON output.

Every client command prints a human table by default and JSON with ``--json``; the
controller address comes from ``--controller``, ``$MILLWHEEL_CONTROLLER`` or
127.0.0.1:7070.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any, Sequence

from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP

from ..client import CONTROLLER_HELP, CONTROLLER_METAVAR, ControllerClient
from ..rpc import security

#: The commands whose calls need role operator (services/rpc/roles.py): they send the
#: operator token when the client has one (--operator-token-file, $MILLWHEEL_OPERATOR_TOKEN,
#: $MILLWHEEL_OPERATOR_TOKEN_FILE, ./millwheel-data/operator-token), every other command
#: the client token. tests/unit/test_roles.py checks each names a command.
OPERATOR_COMMANDS = frozenset({"millwheel rescale", "millwheel savepoint create",
                               "millwheel savepoint restore", "millwheel dead-letters replay"})


def client_parser(sub: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A client command's parser: --controller, --json and the client security flags,
    the same for every command that talks to the controller (an operator command's take
    the operator token too)."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    operator = p.prog in OPERATOR_COMMANDS
    p.add_argument("--controller", metavar=CONTROLLER_METAVAR, help=CONTROLLER_HELP)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    security.add_args(p, server=False, operator=operator)
    p.set_defaults(operator_command=operator)
    return p


def client_for(args: argparse.Namespace) -> ControllerClient:
    """The client a command's flags (address, token, TLS) describe: with the operator
    token for an operator command, when there is one."""
    sec = security.from_args(args, server=False)
    if getattr(args, "operator_command", False):
        sec = sec.operator()
    return ControllerClient(args.controller, security=sec)


#: gRPC's words for a controller that could not be reached at all (nothing listens, no
#: such host), as opposed to one that answered UNAVAILABLE itself (its store is down).
UNREACHABLE = ("failed to connect to all addresses", "DNS resolution failed", "errors resolving")


def hint(exc: BaseException, args: argparse.Namespace) -> str | None:
    """What to check after a client command failed with ``exc``, or None: the service
    not running where the command looked (UNAVAILABLE, nothing reached), or the token
    missing or refused (UNAUTHENTICATED)."""
    import grpc

    from ..client import controller_address

    status = getattr(exc, "status", None)
    if status == grpc.StatusCode.UNAVAILABLE and any(m in str(exc) for m in UNREACHABLE):
        address = controller_address(getattr(args, "controller", None))
        return (f"is `millwheel up` (or a controller) running at {address}? Another address: "
                "--controller HOST:PORT or $MILLWHEEL_CONTROLLER")
    if status == grpc.StatusCode.PERMISSION_DENIED and "needs role operator" in str(exc):
        source = security.operator_token_source(args)
        if source is None:
            return ("this command needs the operator token and this client has none: "
                    f"--operator-token-file FILE, ${security.ENV_OPERATOR} or ${security.ENV_OPERATOR_FILE}; "
                    f"`millwheel up` writes it beside the client token (its data directory's "
                    f"{security.OPERATOR_TOKEN_FILE}), or ask the operator for a credential with role operator")
        return (f"the operator token sent ({source}) is not one the service gives role operator; "
                f"`millwheel up` writes its own as {security.OPERATOR_TOKEN_FILE} beside the client token")
    if status == grpc.StatusCode.UNAUTHENTICATED:
        if getattr(args, "operator_command", False) and security.operator_token_source(args):
            return (f"the operator token sent ({security.operator_token_source(args)}) is not the "
                    f"service's; `millwheel up` writes its own as {security.OPERATOR_TOKEN_FILE} beside "
                    "the client token")
        source = security.client_token_source(args)
        if source is None:
            return f"this client sent no token: {security.token_lookup()}"
        return (f"the token sent ({source}) is not the service's; `millwheel up` prints the path of "
                f"the one it uses (its data directory's {security.CLIENT_TOKEN_FILE})")
    return None


def fmt_ts(us: int) -> str:
    if us <= MIN_TIMESTAMP:
        return "-inf (nothing yet)"
    if us >= MAX_TIMESTAMP:
        return "+inf (done)"
    when = dt.datetime.fromtimestamp(us / 1e6, tz=dt.UTC)
    return f"{us} ({when.isoformat(timespec='milliseconds').replace('+00:00', 'Z')})"


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def fmt_event_time(us: int) -> str:
    """A record's timestamp for people: UTC to the microsecond (exact: no float on the
    way), ``-inf``/``+inf`` at the ends; a time no calendar holds (past year 9999) stays
    in microseconds."""
    if us <= MIN_TIMESTAMP:
        return "-inf"
    if us >= MAX_TIMESTAMP:
        return "+inf"
    try:
        return (_EPOCH + dt.timedelta(microseconds=us)).isoformat(timespec="microseconds").replace("+00:00", "Z")
    except OverflowError:
        return f"{us} µs"


def json_ts(us: int) -> int | str:
    """A watermark in ``--json`` output as the console's Tracker API gives it: integer
    microseconds, or ``"-inf"`` (nothing yet) / ``"+inf"`` (done) at the ends."""
    return "-inf" if us <= MIN_TIMESTAMP else "+inf" if us >= MAX_TIMESTAMP else us


def fmt_lag(us: int) -> str:
    """How far behind, for people: ``0.4s``, ``5m 12s``, ``3h 05m``, ``1106d 3h``."""
    sign, s = ("-" if us < 0 else ""), abs(us) / 1e6
    if s < 60:
        return f"{sign}{s:.1f}s"
    whole = int(s)
    if whole < 3600:
        return f"{sign}{whole // 60}m {whole % 60:02d}s"
    if whole < 86_400:
        return f"{sign}{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{sign}{whole // 86_400}d {whole % 86_400 // 3600}h"


def worker_state(alive: bool, draining: bool) -> str:
    """alive, draining or dead. Liveness first: a worker that drained and exited keeps
    its draining flag, and must not look as if it were still draining once it is gone."""
    return ("draining" if draining else "alive") if alive else "dead"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit(args: argparse.Namespace, data: Any, text: str) -> int:
    print(json.dumps(data, indent=2) if args.json else text)
    return 0
