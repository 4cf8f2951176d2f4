"""The project's own rules, checked on every run: lint, types and the layering of
ARCHITECTURE.md (no gRPC in the core; redis, prometheus_client and pyspark each
imported in one module of their own)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def product_files() -> list[Path]:
    return [p for d in ("millwheel", "services") for p in (ROOT / d).rglob("*.py") if "generated" not in p.parts]


def importers(top: str) -> list[str]:
    return sorted(
        str(p.relative_to(ROOT)) for p in product_files()
        if any(name == top or name.startswith(top + ".") for name in imports_of(p))
    )


def test_the_core_never_imports_grpc_or_services() -> None:
    core = [p for p in product_files() if p.parts[len(ROOT.parts)] == "millwheel"]
    offenders = [
        str(p.relative_to(ROOT)) for p in core
        if any(n.split(".")[0] in ("grpc", "grpc_health", "grpc_reflection", "services") for n in imports_of(p))
    ]
    assert offenders == []


@pytest.mark.parametrize("library,home", [
    ("redis", "millwheel/state/redis_connection.py"),
    ("prometheus_client", "services/metrics.py"),
    ("pyspark", "millwheel/spark/session.py"),
    ("psycopg", "millwheel/connectors/postgres.py"),
    ("nats", "millwheel/connectors/nats_jetstream.py"),
])
def test_heavy_libraries_live_in_one_module(library: str, home: str) -> None:
    assert importers(library) == [home]


def test_ruff_is_clean() -> None:
    done = subprocess.run([str(BIN / "ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean_on_the_core_and_the_services() -> None:
    """Strict on millwheel/ and services/ (pyproject's [tool.mypy]; the generated stubs
    are excluded, gRPC and protobuf typed by the dev extra's types-* packages)."""
    done = subprocess.run([str(BIN / "mypy")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
