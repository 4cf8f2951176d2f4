"""The computation version the docs point to is shown (issue 34, item 9): `millwheel
computations` and `millwheel status`, table and --json, after a registration, an update
and a rollback (docs/service.md, "Versions")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options
from services.client import ControllerClient
from services.controller.service import serve
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def counts(size_us: int) -> ComputationSpec:
    return ComputationSpec("counts", (InputSpec("events"),), ("counts_out",),
                           CodeRef("window_aggregate", {"size_us": size_us}), Options(key_ranges=2))


def test_computations_and_status_show_each_version(tmp_path: Path) -> None:
    server, port, _m, service = serve(f"sqlite:///{tmp_path}/s.db", port=0, metrics_port=None)
    address = f"127.0.0.1:{port}"
    client = ControllerClient(address, timeout_s=30, security=Security())

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "services.cli", *args, "--controller", address], cwd=ROOT,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def shown() -> tuple[str, str, int, int]:
        table = next(line for line in cli("computations").splitlines() if line.startswith("counts "))
        status = next(line for line in cli("status").splitlines()[::-1] if line.startswith("counts "))
        listed = json.loads(cli("computations", "--json"))["computations"][0]
        versions = json.loads(cli("status", "--json"))["versions"]
        assert versions == [{"computation": "counts", "version": listed["version"],
                             "has_previous": listed["has_previous"]}]
        return " ".join(table.split()[1:3]), " ".join(status.split()[1:]), listed["version"], len(versions)

    try:
        client.register_topology([spec_to_proto(counts(1_000_000))], [InjectorSpec("events", "events")])
        assert shown()[:3] == ("1 events", "1", 1)
        assert client.update(spec_to_proto(counts(2_000_000)), on_open_windows="drop").changed
        assert shown()[:3] == ("2 (rollback:", "2 (rollback: 1)", 2)
        assert client.update(None, rollback="counts").changed
        assert shown()[:3] == ("3 events", "3", 3)  # a rollback keeps no target of its own
    finally:
        client.close()
        service.close()
        server.stop(0)
