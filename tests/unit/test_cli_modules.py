"""The CLI builds only the parsers of the command it runs: its table of which module adds
which command must match what the modules add, and every command must still parse."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path

from services.cli import COMMAND_MODULES, COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_names_every_command_and_its_module() -> None:
    added = {}
    for name in COMMAND_MODULES:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        importlib.import_module(name).add_commands(sub)
        added.update({command: name.rsplit(".", 1)[1] for command in sub.choices})
    assert COMMANDS == added


def test_each_command_parses_with_its_module_alone() -> None:
    for command in COMMANDS:
        parser = build_parser([command])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert command in sub.choices


def test_status_and_version_load_neither_the_console_nor_the_local_runner() -> None:
    probe = ("import sys; from services.cli import build_parser; build_parser(sys.argv[1:]); "
             "print(sorted(m for m in ('services.ui.server', 'millwheel.runtime.local_runner') if m in sys.modules))")
    for args in (["status"], ["--version"]):
        out = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]", (args, out.stdout)
