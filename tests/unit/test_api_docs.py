"""docs/api.md is generated from the proto and must say what the proto says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_api_doc_is_current() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_api_docs.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
