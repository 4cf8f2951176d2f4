"""The CLI fails cleanly: a message that says what and where, and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_inject_from_stdin_with_the_controller_down_exits_2_with_a_message(tmp_path: Path) -> None:
    lines = "".join(json.dumps({"key": f"k{i}", "value": i, "timestamp": i}) + "\n" for i in range(200_000))
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for _ in range(3):  # the abort it replaces was a race at interpreter shutdown
        proc = subprocess.run([sys.executable, "-m", "services.cli", "inject", "--injector", "clicks",
                               "--controller", address], input=lines, capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "Fatal Python error" not in proc.stderr
        assert f"controller {address}" in proc.stderr and "UNAVAILABLE" in proc.stderr
