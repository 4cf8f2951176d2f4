"""Several "hosts" on one machine: Linux network namespaces joined by a private switch.

A :class:`NetLab` creates, for one test:

- a hub namespace holding a bridge (the switch), so nothing but one veth end is added
  to the machine's own (root) namespace;
- one namespace per host, each with loopback up and ``eth0`` (a veth whose other end
  is a port of the bridge) carrying an address on a private /24 of 10.213.0.0/16 that
  no route or address of the root namespace uses;
- one veth from the root namespace to the bridge (address ``.1``), so the test process
  itself is a client on that subnet: it dials the hosts' addresses directly.

Processes run inside a host with ``ip netns exec NS ...`` (which execs the command: the
PID is the process's own), each in its own session. :meth:`NetLab.cut` sets the host's
switch port down (a cable pulled at the switch: the host keeps its address and routes,
its packets and those sent to it vanish, TCP retransmits until :meth:`NetLab.heal`).

Names carry the test process's PID (``mw<PID><n>-<host>``), so parallel runs cannot
collide; :meth:`NetLab.close` kills every process started here (by PID, then any left
in the namespaces, found by ``ip netns pids``) and deletes the namespaces and the root
veth, whatever happened to the test. A lab left behind by a killed run (its PID gone)
is removed by the next one. Creating namespaces needs root: :func:`unavailable` says
why a test must be skipped.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

IP = shutil.which("ip") or "/usr/sbin/ip"
SUBNET_PREFIX = "10.213"  # the lab takes one free 10.213.X.0/24
_NAME = re.compile(r"^mw(\d+)n(\d+)-")
_labs = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    if not Path(IP).exists():
        return "iproute2's `ip` command is not installed"
    probe = f"mw{os.getpid()}probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` does not work here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_labs() -> list[str]:
    """Delete the namespaces (and root veths) of labs whose creating process is gone."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_pids(name)
            _ip("netns", "del", name, check=False)
            _ip("link", "del", f"mw{m.group(1)}n{m.group(2)}c", check=False)
            removed.append(name)
    return removed


def _kill_namespace_pids(ns: str) -> None:
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def free_subnet() -> str:
    """A 10.213.X (X in 1..254) that no address or route of the root namespace uses,
    starting from one derived from this PID so parallel runs rarely even try the same."""
    used = _ip("-4", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    start = os.getpid() % 254
    for i in range(254):
        x = (start + i) % 254 + 1
        if re.search(rf"\b{re.escape(SUBNET_PREFIX)}\.{x}\.", used) is None:
            return f"{SUBNET_PREFIX}.{x}"
    raise RuntimeError(f"no free /24 in {SUBNET_PREFIX}.0.0/16")


@dataclass
class Host:
    name: str
    ns: str  # the namespace's name
    ip: str
    port: str  # its switch port (a veth end in the hub namespace)


class NetLab:
    """A switch and hosts on it; see the module docstring. Use as a context manager."""

    def __init__(self, logs: Path) -> None:
        reap_stale_labs()
        self.logs = logs
        self.tag = f"mw{os.getpid()}n{next(_labs)}"
        self.hub = f"{self.tag}-hub"
        self.root_dev = f"{self.tag}c"
        self.hosts: dict[str, Host] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._namespaces: list[str] = []
        self._files: list[Any] = []
        try:
            self.subnet = free_subnet()
            self._add_namespace(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            # The root namespace's own leg: the test process is a client on the subnet.
            _ip("link", "add", self.root_dev, "type", "veth", "peer", "name", "root", "netns", self.hub)
            _ip("-n", self.hub, "link", "set", "root", "master", "br0", "up")
            _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.root_dev)
            _ip("link", "set", self.root_dev, "up")
            self.client_ip = f"{self.subnet}.1"
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A namespace with loopback and eth0 up, its address the next free one."""
        if name in self.hosts or not re.fullmatch(r"[a-z0-9]{1,12}", name):
            raise ValueError(f"bad or duplicate host name {name!r}")
        index = len(self.hosts)
        host = Host(name, f"{self.tag}-{name}", f"{self.subnet}.{index + 2}", f"p{index}")
        self._add_namespace(host.ns)
        _ip("-n", self.hub, "link", "add", host.port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
        _ip("-n", self.hub, "link", "set", host.port, "master", "br0", "up")
        _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", host.ns, "link", "set", "eth0", "up")
        self.hosts[name] = host
        return host

    # -- processes ------------------------------------------------------------------------
    def spawn(self, host: Host, args: Sequence[str], log_name: str, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        """Run ``args`` inside ``host`` (own session), output to ``logs/<log_name>.log``."""
        log = open(self.logs / f"{log_name}.log", "ab")  # noqa: SIM115
        self._files.append(log)
        proc = subprocess.Popen([IP, "netns", "exec", host.ns, *args], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def log(self, log_name: str) -> str:
        path = self.logs / f"{log_name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- faults ---------------------------------------------------------------------------
    def cut(self, host: Host) -> None:
        """Pull the host's cable at the switch: nothing gets in or out until :meth:`heal`."""
        _ip("-n", self.hub, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        _ip("-n", self.hub, "link", "set", host.port, "up")

    def is_cut(self, host: Host) -> bool:
        return "state DOWN" in _ip("-n", self.hub, "link", "show", host.port).stdout

    # -- the end --------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process started here, then delete namespaces and links. Safe to
        call twice and after a failed set-up."""
        for proc in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process dies too
                    try:
                        os.killpg(proc.pid, sig)  # its session: the process and its children
                    except ProcessLookupError:
                        pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._namespaces):
            _kill_namespace_pids(ns)  # anything else left running inside
            deadline = time.monotonic() + 5
            while _ip("netns", "pids", ns, check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.05)
            _ip("netns", "del", ns, check=False)
        self._namespaces.clear()
        _ip("link", "del", self.root_dev, check=False)
        for f in self._files:
            f.close()
        self._files.clear()

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
