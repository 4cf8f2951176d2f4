"""A savepoint file holds every key's state: `millwheel savepoint create` writes it
readable by its owner alone (0600), whatever the umask, also over a file left with
another mode (--force), as the SQLite store's file is (issue 34, item 9)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from services.client import ControllerClient
from services.controller.service import serve
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security
from tests.support import pipelines

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_a_savepoint_file_is_the_owners_alone(tmp_path: Path) -> None:
    server, port, _m, service = serve(f"sqlite:///{tmp_path}/s.db", port=0, metrics_port=None,
                                      allow_code=pipelines.__name__)
    client = ControllerClient(f"127.0.0.1:{port}", timeout_s=30, security=Security())
    try:
        topology = pipelines.topology(key_ranges=2)
        client.register_topology([spec_to_proto(c) for c in topology.computations],
                                 [(i.name, i.stream) for i in topology.injectors])
        target = tmp_path / "sp.mwsp"
        target.write_bytes(b"old")
        target.chmod(0o644)  # left over with the usual mode: --force replaces it
        done = subprocess.run(
            ["sh", "-c", f"umask 000 && exec {sys.executable} -m services.cli savepoint create {target} --force "
                         f"--controller 127.0.0.1:{port}"],
            cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
            timeout=90)
        assert done.returncode == 0, done.stderr
        assert target.stat().st_size > 100
        assert stat.S_IMODE(target.stat().st_mode) == 0o600
        assert not (tmp_path / "sp.mwsp.partial").exists()
        assert os.access(target, os.R_OK)
    finally:
        client.close()
        service.close()
        server.stop(0)
