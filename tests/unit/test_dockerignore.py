"""The image's build context is what deploy/Dockerfile copies and nothing else, for
BuildKit (deploy/Dockerfile.dockerignore) and the legacy builder (the root
.dockerignore) alike: the legacy builder ignored the Dockerfile's own file and sent a
1.1 GB context holding the .venv and deploy/secrets (issue 33)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dockerfile import context_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("builder, dockerfile", [
    ("BuildKit", ROOT / "deploy" / "Dockerfile"),
    ("legacy", ROOT / "deploy" / "no-own-ignore-file"),  # no <Dockerfile>.dockerignore: the root's
])
def test_the_context_holds_the_sources_and_no_secrets(builder: str, dockerfile: Path) -> None:
    files = context_files(ROOT, dockerfile)
    assert {"pyproject.toml", "setup.py", "README.md", "scripts/gen_proto.py",
            "millwheel/__init__.py", "services/__init__.py"} <= set(files), builder
    assert any(f.startswith("proto/") for f in files)
    leaked = [f for f in files if f.split("/")[0] in {".venv", ".git", "deploy", "tests", "bench", ".dev", ".whl"}
              or f.startswith("services/generated/") or "__pycache__" in f or f.endswith((".db", ".db-wal"))]
    assert leaked == [], f"{builder}: {leaked[:5]}"


def test_both_ignore_files_say_the_same() -> None:
    assert (ROOT / ".dockerignore").read_text() == (ROOT / "deploy" / "Dockerfile.dockerignore").read_text()
