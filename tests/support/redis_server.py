"""A real, throw-away ``redis-server`` for tests: own loopback port, own data dir.

Tests never touch a Redis they did not start (a system Redis may run on 6379). The
server can be killed with SIGKILL and restarted on the same port and data dir, which
is how the Redis-restart tests prove durability with AOF on.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Sequence

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1.

    ``appendonly``/``appendfsync`` set the AOF persistence; RDB snapshots are off so a
    test sees exactly what AOF gives. ``requirepass`` turns on password auth. ``tls``
    serves TLS only, with a fresh self-signed certificate for 127.0.0.1 (``ca_file``).
    ``extra_args`` are passed on to redis-server (a cluster node's settings).
    """

    def __init__(
        self,
        *,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        requirepass: str | None = None,
        tls: bool = False,
        data_dir: str | Path | None = None,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.requirepass = requirepass
        self.tls = tls
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="mw-redis-"))
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        if tls:
            self._make_certificate()
        self.start()

    @property
    def ca_file(self) -> Path:
        return self.data_dir / "tls.crt"

    def _make_certificate(self) -> None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", str(self.data_dir / "tls.key"), "-out", str(self.ca_file),
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )

    @property
    def url(self) -> str:
        auth = f":{self.requirepass}@" if self.requirepass else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
            "--protected-mode", "no",
        ]
        if self.requirepass:
            args += ["--requirepass", self.requirepass]
        args += self.extra_args
        if self.tls:
            args[2] = "0"  # no plain-text port
            args += [
                "--tls-port", str(self.port), "--tls-cert-file", str(self.ca_file),
                "--tls-key-file", str(self.data_dir / "tls.key"), "--tls-auth-clients", "no",
            ]
        return args

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()}")
            if self._ping():
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} not ready in {timeout_s}s: {self.log()}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as plain:
                sock = plain
                if self.tls:
                    context = ssl.create_default_context(cafile=str(self.ca_file))
                    sock = context.wrap_socket(plain, server_hostname="127.0.0.1")
                if self.requirepass:
                    sock.sendall(f"AUTH {self.requirepass}\r\n".encode())
                    sock.recv(64)
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def log(self) -> str:
        path = self.data_dir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the process dies at once, no shutdown save or final fsync. (What the
        kernel already has of the AOF survives, as it would not on a power loss.)"""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Start again on the same port and data dir (AOF is replayed on start)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill the server and remove its data dir (if this object created it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
