"""``./dev.sh`` on a machine with pyenv: a shim for a Python version that is not
installed prints an error when probed ("pyenv: python3.12: command not found"); dev.sh
probes python3.12, python3.11 and python3 in turn, so before, every call printed that
error though it went on to work (issue 33's set-up items)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = """#!/bin/sh
echo "pyenv: $(basename "$0"): command not found" >&2
echo "The \\`$(basename "$0")' command exists in these Python versions: 3.12.1" >&2
exit 127
"""


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="dev.sh setup has not run here")
def test_a_pyenv_shim_of_a_missing_version_prints_nothing(tmp_path: Path) -> None:
    shims = tmp_path / "shims"
    shims.mkdir()
    for name in ("python3.12", "python3.11"):  # pyenv shims of versions not installed
        (shims / name).write_text(SHIM)
        (shims / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"}
    out = subprocess.run(["./dev.sh", "mw", "--version"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("millwheel "), out.stdout + out.stderr
    assert "pyenv" not in out.stderr and "command not found" not in out.stderr, out.stderr
