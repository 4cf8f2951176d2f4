"""`millwheel up` never leaks its children: not when the controller cannot start, not
on Ctrl-C while it is starting. (A leaked controller or worker would keep a port, a
store lock and a heartbeat going after the user thinks everything stopped.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.integration.service_cluster import ROOT, wait_for
from tests.support.redis_server import free_port


def children(port: int) -> list[int]:
    """The controller and workers of the `millwheel up` on ``port`` (not up itself)."""
    return [pid for pid in processes_mentioning(f"--port {port}") + processes_mentioning(
        f"--controller 127.0.0.1:{port}") if _role(pid) in ("controller", "worker")]


def _role(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    return args[args.index(b"services.cli") + 1].decode() if b"services.cli" in args else ""


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and "services.cli" in cmdline:
            pids.append(int(entry.name))
    return pids


def up(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    # Output to a file: a pipe would stay open as long as any child holds it.
    with open(tmp_path / "up.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port),
                                 "--metrics-port", "-1", "--no-auth", *extra], cwd=tmp_path,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=log)


def test_a_controller_that_never_answers_is_stopped(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as blackhole:  # takes connections, never answers: the store hangs
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(16)
        proc = up(tmp_path, port, "--store", f"redis://127.0.0.1:{blackhole.getsockname()[1]}/0")
        assert proc.wait(90) == 1
        assert "the controller did not start" in (tmp_path / "up.log").read_text()
        wait_for(lambda: not children(port), 3, "no child left behind")


def test_ctrl_c_while_starting_stops_every_child(tmp_path: Path) -> None:
    port = free_port()
    proc = up(tmp_path, port, "--workers", "2", "--store", f"sqlite:///{tmp_path}/s.db")
    wait_for(lambda: bool(children(port)), 30, "the controller to be started")
    proc.send_signal(signal.SIGINT)  # up is waiting for its controller to answer
    proc.wait(60)
    wait_for(lambda: not children(port), 10, "no child left behind")
