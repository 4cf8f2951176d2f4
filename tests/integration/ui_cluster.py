"""A secured cluster with the operations console, running the README's quickstart.

The pipeline is read from README.md itself (the ``pipeline.yaml`` of the service
quickstart), so the console tests follow what users paste.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from millwheel.record import Record
from services.rpc.convert import spec_dict_to_proto
from services.rpc.security import Security
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, Cluster, wait_for

T0 = 1_700_000_000_000_000
TOKEN = "client-" + secrets.token_urlsafe(24)
SECRET = "cluster-" + secrets.token_urlsafe(24)
OPERATOR = "operator-" + secrets.token_urlsafe(24)  # role operator (issue 34): savepoints, rescales


def readme_pipeline() -> dict[str, Any]:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"cat > pipeline.yaml <<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert m, "README.md: the quickstart's pipeline.yaml heredoc is gone"
    data: dict[str, Any] = yaml.safe_load(m.group(1))
    return data


def clicks(n: int = 60, start: int = 0) -> list[Record]:
    """The README's clicks: users ann, bob, cy in turn, then only ann; 0.5 s apart."""
    out = []
    for i in range(start, start + n):
        user = ["ann", "bob", "cy"][i % 3] if i % 60 < 40 else "ann"
        out.append(Record(f"c{i}", json.dumps({"user": user}).encode(), T0 + i * 500_000, f"click-{i}"))
    return out


@dataclass
class Console:
    cluster: Cluster
    port: int
    token: str = TOKEN
    injected: list[Record] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def request(self, method: str, path: str, headers: dict[str, str] | None = None,
                body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def get(self, path: str, token: str | None = "") -> tuple[int, Any]:
        """GET with ``token`` (default: the console's own; None: no Authorization)."""
        token = self.token if token == "" else token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        status, _, body = self.request("GET", path, headers)
        return status, json.loads(body)

    def api(self, path: str) -> Any:
        status, data = self.get(path)
        assert status == 200, (path, status, data)
        return data

    def inject(self, records: list[Record], done: bool = False) -> None:
        self.cluster.inject("clicks", "clicks", records, done=done)
        self.injected += records


def start_console(tmp: Path, workers: int = 2, ui: bool = True) -> Console:
    """Controller (with ``--ui-port`` unless not ``ui``) and workers with a client
    token; the README's pipeline registered (nothing injected yet)."""
    port = free_port()
    c = Cluster(tmp, env={"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET,
                          "MILLWHEEL_OPERATOR_TOKEN": OPERATOR},
                security=Security(client_token=TOKEN), controller_args=["--ui-port", str(port)] if ui else [])
    try:
        c.start_controller()
        for _ in range(workers):
            c.start_worker()
        spec = readme_pipeline()
        c.client.register_topology([spec_dict_to_proto(s) for s in spec["computations"]],
                                   [(i["name"], i["stream"]) for i in spec["injectors"]],
                                   spec.get("log_streams", []))
        c.wait_balanced()
        console = Console(c, port)
        if not ui:
            return console
        wait_for(lambda: console.get("/healthz", None)[0] == 200, 20, "the console to answer")
        names = {s["name"] for s in spec["computations"]}
        wait_for(lambda: {x["name"] for x in console.api("/api/v1/overview")["computations"]} == names,
                 20, "the console's snapshot to show the registered computations")
        return console
    except BaseException:
        c.stop()
        raise


@contextlib.contextmanager
def console_with_clicks(tmp: Path, workers: int) -> Iterator[Console]:
    """A console over the README pipeline with 60 clicks in, every window up to
    T0 + 29.5 s closed, and the console's snapshot caught up with it; stopped after."""
    con = start_console(tmp, workers=workers)
    try:
        con.inject(clicks(60))
        con.cluster.wait_watermark("counts", T0 + 29_500_000)
        wait_for(lambda: con.api("/api/v1/computation?computation=counts")["input_low_watermark"]
                 == T0 + 29_500_000, 10, "the console's snapshot to catch up")
        yield con
    finally:
        con.cluster.stop()
