"""A real, throw-away PostgreSQL for tests: ``initdb`` into a temp dir, ``postgres``
on a free loopback port with its socket in that dir, stopped (or killed) by PID.

PostgreSQL refuses to run as root: when the tests do, the server runs as the
``postgres`` user (created by the Debian package dev.sh installs) through setpriv.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.redis_server import free_port


def _binary(name: str) -> str:
    found = shutil.which(name) or f"/usr/local/bin/{name}"
    if not Path(found).exists():
        for version in ("17", "16", "15", "14"):
            candidate = f"/usr/lib/postgresql/{version}/bin/{name}"
            if Path(candidate).exists():
                return candidate
    return found


class PostgresServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="mw-pg-"))
        self.data = self.dir / "data"
        self.proc: subprocess.Popen[bytes] | None = None
        self._prefix: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._prefix = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
        subprocess.run([*self._prefix, _binary("initdb"), "-D", str(self.data), "-U", "mw", "-A", "trust",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True)
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql://mw@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        log = open(self.dir / "postgres.log", "ab")  # noqa: SIM115 - the server's, closed with it
        self.proc = subprocess.Popen(
            [*self._prefix, _binary("postgres"), "-D", str(self.data), "-p", str(self.port),
             "-k", str(self.dir), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=on"],
            stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {self.log()}")
            if self._ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"postgres not ready on {self.port}: {self.log()}")

    def _ready(self) -> bool:
        try:
            import psycopg
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except Exception:  # noqa: BLE001 - not up yet
            return False

    def log(self) -> str:
        path = self.dir / "postgres.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            # its children (backends) die with the postmaster's session
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            pid_file = self.data / "postmaster.pid"
            pid_file.unlink(missing_ok=True)

    def restart(self) -> None:
        """SIGKILL and start again on the same data and port (crash recovery runs)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def rows(self, table: str) -> list[tuple[object, ...]]:
        import psycopg
        with psycopg.connect(self.url) as conn:
            return list(conn.execute(f"SELECT record_id, key, window_start, window_end, value, ts FROM {table} "
                                     "ORDER BY record_id").fetchall())

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
