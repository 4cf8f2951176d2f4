"""The ``millwheel`` command line. Each command group lives in its own module and
registers its subcommands here through ``add_commands(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from millwheel import __version__
from millwheel.errors import MillWheelError

COMMAND_MODULES = tuple(f"{__package__}.{m}" for m in (
    "local", "service", "remote", "update", "rescale", "savepoint", "errors", "spark", "credentials"))


#: Which module adds which command: a command builds only its own module's parsers (and
#: imports only what that module imports), so `millwheel status` does not load the
#: console, the local runner or Spark; ``--help`` and an unknown command load them all.
#: tests/unit/test_cli_modules.py checks this table against what the modules add.
COMMANDS = {
    "demo": "local", "run": "local",
    "controller": "service", "up": "service", "worker": "service",
    "computations": "remote", "inject": "remote", "keys": "remote", "register": "remote", "state": "remote",
    "status": "remote", "subscribe": "remote", "unregister": "remote", "watermark": "remote",
    "update": "update", "rescale": "rescale", "savepoint": "savepoint",
    "dead-letters": "errors", "errors": "errors", "backfill": "spark", "credentials": "credentials",
}


def _modules_for(argv: list[str]) -> tuple[str, ...]:
    """The command modules ``argv`` needs: the one of its command, else all of them."""
    if "--version" in argv and not any(a in ("-h", "--help") for a in argv):
        return ()  # answered by the top parser alone
    command = next((a for a in argv if not a.startswith("-")), None)
    module = COMMANDS.get(command or "")
    return (f"{__package__}.{module}",) if module is not None else COMMAND_MODULES


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="millwheel",
        description="Keyed, stateful, exactly-once stream computations (after Google's MillWheel).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  millwheel demo zeitgeist                      spike/dip detection, local mode\n"
            "  millwheel run pipeline.yaml --store sqlite:///data/p.db\n"
            "  millwheel up --workers 2                      controller + 2 workers\n"
            "  millwheel register pipeline.yaml && millwheel inject events.jsonl --injector events\n"
            "  millwheel watermark; millwheel state COMPUTATION KEY; millwheel subscribe STREAM\n"
            "\n'millwheel COMMAND --help' tells more about each command. Errors exit with status 2."
        ),
    )
    parser.add_argument("--version", action="version", version=f"millwheel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES if argv is None else _modules_for(argv):
        if importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args: argparse.Namespace | None = None
    try:
        parser = build_parser(sys.argv[1:] if argv is None else argv)
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            sys.stdout.flush()  # --help, --version: a pipe closed early fails here, handled below
            raise
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # the same for a command's output
        return code
    except MillWheelError as exc:
        print(f"millwheel: error: {exc}", file=sys.stderr)
        if args is not None and hasattr(args, "controller") and getattr(exc, "status", None) is not None:
            from .output import hint  # a client command's call failed: what to check

            said = hint(exc, args)
            if said:
                print(f"millwheel: hint: {said}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("millwheel: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`millwheel errors X | head -1`): not an error. Point stdout
        # at /dev/null so the interpreter's last flush does not fail (and print) again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
