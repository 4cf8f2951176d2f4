"""The ``millwheel`` command line. Each command group lives in its own module and
registers its subcommands here through ``add_commands(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from millwheel.errors import MillWheelError

COMMAND_MODULES = ("services.cli_local", "services.cli_service", "services.cli_spark")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="millwheel",
        description="Keyed, stateful, exactly-once stream computations (after Google's MillWheel).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MillWheelError as exc:
        print(f"millwheel: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("millwheel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
