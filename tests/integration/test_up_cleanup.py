"""`millwheel up` never leaks its children: not when the controller cannot start, not
on Ctrl-C while it is starting, not when `up` itself is killed with SIGKILL. (A leaked
controller or worker would keep a port, a store lock and a heartbeat going after the
user thinks everything stopped.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, wait_for


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


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def _all_descendants(pid: int) -> list[int]:
    """Every process whose chain of parents leads to ``pid`` (watchdogs included)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_up_killed_with_sigkill_takes_every_child_with_it(tmp_path: Path) -> None:
    """A supervisor's kill -9 of `up`: the controller, the workers and their watchdogs
    end within a few seconds and the controller's port is free again."""
    port = free_port()
    proc = up(tmp_path, port, "--workers", "2", "--store", f"sqlite:///{tmp_path}/s.db")
    family: list[int] = []
    try:
        wait_for(lambda: "millwheel is up" in (tmp_path / "up.log").read_text(), 60, "up to be up")
        family += _all_descendants(proc.pid)
        roles = sorted(_role(p) for p in family)
        assert roles.count("controller") == 1 and roles.count("worker") == 2, roles
        assert len(family) >= 5, f"expected a controller, 2 workers and 2 watchdogs, got {family}"
        proc.kill()
        proc.wait(10)
        wait_for(lambda: not any(_alive(p) for p in family), 10, "every child of up to end")
        wait_for(lambda: _port_free(port), 5, "the controller's port to be free")
    finally:
        proc.kill()
        for p in family:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_store_password_is_on_no_command_line(tmp_path: Path) -> None:
    """`ps` shows every user every process's command line: `up` hands the store URL to
    its controller and workers, and a worker to its watchdog, in the environment, so a
    Redis password appears on none of them (it did on all five)."""
    from tests.support.redis_server import RedisServer

    password = "pw-" + os.urandom(6).hex()
    port = free_port()
    with RedisServer(requirepass=password) as redis:
        proc = up(tmp_path, port, "--workers", "2", "--store", f"redis://:{password}@127.0.0.1:{redis.port}/0")
        family: list[int] = []
        try:
            wait_for(lambda: "millwheel is up" in (tmp_path / "up.log").read_text(), 60, "up to be up")
            wait_for(lambda: len(_all_descendants(proc.pid)) >= 5, 30, "the workers' watchdogs")
            family = _all_descendants(proc.pid)  # up's own is the user's (MILLWHEEL_STORE keeps it off)
            lines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in family if _alive(p)}
            assert sorted(_role(p) for p in family).count("worker") == 2
            leaked = [p for p, line in lines.items() if password.encode() in line]
            assert not leaked, f"the password is on the command line of {leaked}"
            assert f"127.0.0.1:{redis.port}" in (tmp_path / "up.log").read_text()  # it runs on that store
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            finally:
                for p in family:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
