"""`millwheel up --controllers 2`: a leader and a standby on the next port, workers given
both; the leader killed -9 mid-stream, a new leader (a new epoch) within seconds, the output is exact, and the
dead controller comes back (up restarts it). Ctrl-C then stops every child."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from millwheel.record import Record
from services.client import ControllerClient
from services.rpc.security import Security
from tests.integration.test_up_cleanup import _role, children, processes_mentioning, up
from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, expected_outputs, wait_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _two_free_ports() -> int:
    """A port P with P+1 free as well (up puts the standby there)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return int(port)
    raise AssertionError("no two consecutive free ports")


def _controller_pid(port: int) -> int:
    return next(pid for pid in processes_mentioning(f"--port {port} ") if _role(pid) == "controller")


def test_up_with_two_controllers_survives_the_leader(tmp_path: Path) -> None:
    port = _two_free_ports()
    addresses = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
    proc = up(tmp_path, port, "--controllers", "2", "--workers", "2", "--ui-port", "-1",
              "--allow-code", PIPELINE_CODE,
              "--store", f"sqlite:///{tmp_path}/s.db")
    client = ControllerClient(",".join(addresses), timeout_s=10, security=Security())
    try:
        wait_for(lambda: "millwheel is up" in (tmp_path / "up.log").read_text(), 60, "up to start")
        assert f"controllers {','.join(addresses)}" in (tmp_path / "up.log").read_text()
        status = client.status()
        assert status.leader in addresses and len([w for w in status.workers if w.alive]) == 2
        topology = pipelines.topology(key_ranges=2)
        client.register(topology)
        records = pipelines.workload(n=800)
        half = len(records) // 2
        client.inject_records("events", records[:half], batch=50, max_disorder_us=2 * pipelines.SECOND)
        leader = status.leader
        leader_pid = _controller_pid(int(leader.rpartition(":")[2]))
        t0 = time.monotonic()
        os.kill(leader_pid, signal.SIGKILL)
        rest: list[Record] = records[half:]
        client.inject_records("events", rest, batch=50, max_disorder_us=2 * pipelines.SECOND, done=True)
        new = client.status()
        print(f"up: leader {leader} killed; {new.leader} leads (epoch {new.leader_epoch}) "
              f"{time.monotonic() - t0:.2f} s later")
        # The standby, or the killed one already restarted by up: a new epoch either way.
        assert new.leader in addresses and new.leader_epoch > status.leader_epoch
        wait_for(lambda: client.watermarks("totals")[0].low_watermark >= 2**62, 90, "the end")
        want = expected_outputs(tmp_path, topology, pipelines.sources(records), ("totals",))
        got = sorted((r.key, r.value, r.timestamp, r.record_id) for _s, r in client.subscribe("totals"))
        assert got == want["totals"]
        # up restarted the dead controller; both name the same leader.
        wait_for(lambda: _controller_pid(int(leader.rpartition(":")[2])) != leader_pid, 30,
                 "the killed controller to be restarted")
        assert "controller pid" in (tmp_path / "up.log").read_text()
        for address in addresses:
            with ControllerClient(address, timeout_s=5, security=Security()) as one:
                wait_for(lambda one=one: one.status().leader == new.leader, 20, f"{address} to agree")
    finally:
        client.close()
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    wait_for(lambda: not children(port) and not children(port + 1), 15, "no child left behind")
