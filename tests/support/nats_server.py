"""A real, throw-away ``nats-server -js`` for tests: free loopback port, its JetStream
store in a temp dir, stopped (or killed) by PID; and small blocking helpers over
nats-py for what a test does with it (create a stream, publish, read a subject)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.redis_server import free_port

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


class NatsServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="mw-nats-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.dir / "nats.log", "ab")  # noqa: SIM115 - the server's, closed with it
        self.proc = subprocess.Popen([NATS_SERVER, "-js", "-sd", str(self.dir / "js"), "-a", "127.0.0.1",
                                      "-p", str(self.port)], stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {(self.dir / 'nats.log').read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("nats-server not ready")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- a client's actions ------------------------------------------------------------
    def _run(self, fn: Any) -> Any:
        import nats

        async def main() -> Any:
            nc = await nats.connect(self.url)
            try:
                return await fn(nc.jetstream())
            finally:
                await nc.close()
        return asyncio.run(main())

    def add_stream(self, name: str, subjects: list[str]) -> None:
        self._run(lambda js: js.add_stream(name=name, subjects=subjects))

    def publish(self, subject: str, bodies: list[dict[str, Any]]) -> None:
        async def go(js: Any) -> None:
            for body in bodies:
                await js.publish(subject, json.dumps(body).encode())
        self._run(go)

    def read(self, stream: str, subject: str) -> list[dict[str, Any]]:
        """Every message of ``subject`` in ``stream``, bodies as JSON, in order."""
        async def go(js: Any) -> list[dict[str, Any]]:
            info = await js.stream_info(stream)
            out = []
            for seq in range(int(info.state.first_seq), int(info.state.last_seq) + 1):
                try:
                    msg = await js.get_msg(stream, seq)
                except Exception:  # noqa: BLE001 - deleted
                    continue
                if msg.subject == subject:
                    out.append(json.loads(msg.data))
            return out
        return list(self._run(go))
