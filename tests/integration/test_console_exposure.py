"""What the console gives away, and to whom (issue 21, item 8), against a real controller.

* its JSON API never carries the store's password (``ClusterStatus`` did not, the
  console's ``/api/v1/overview`` did: ``redis://:PASSWORD@host``);
* under mTLS (``--tls-ca`` on the controller) the console, like the gRPC port, takes
  only clients with a certificate signed by that CA (it served anyone with the token).
"""

from __future__ import annotations

import http.client
import json
import ssl
from pathlib import Path

import pytest

from services.rpc.security import Security
from tests.integration.ui_cluster import SECRET, TOKEN
from tests.support.certs import CertificateAuthority
from tests.support.redis_server import RedisServer, free_port
from tests.support.service_cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(120)
PASSWORD = "hunter2-" + "x" * 12
PAGES = ("/api/v1/overview", "/api/v1/workers", "/api/v1/session")


def get(port: int, path: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    conn: http.client.HTTPConnection = (http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
                                        if context is not None else http.client.HTTPConnection("127.0.0.1", port,
                                                                                               timeout=10))
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_the_console_never_shows_the_store_password(tmp_path: Path) -> None:
    port = free_port()
    with RedisServer(requirepass=PASSWORD) as redis:
        assert PASSWORD in redis.url
        c = Cluster(tmp_path, store_url=redis.url, env={"MILLWHEEL_AUTH_TOKEN": TOKEN,
                                                         "MILLWHEEL_CLUSTER_SECRET": SECRET},
                    security=Security(client_token=TOKEN), controller_args=["--ui-port", str(port)])
        try:
            c.start_controller()
            c.start_worker()
            over = wait_for(lambda: (r := get(port, "/api/v1/overview"))[0] == 200 and json.loads(r[1])["store"]
                            and r, 20, "the console's first snapshot")
            shown = json.loads(over[1])["store"]
            assert PASSWORD not in shown  # the whole URL, password included, before
            assert shown == c.client.status().store_url == redis.url.replace(PASSWORD, "***")
            for page in PAGES:
                status, body = get(port, page)
                assert status == 200 and PASSWORD.encode() not in body, page
            assert PASSWORD not in c.log("controller")
        finally:
            c.stop()


def test_under_mtls_the_console_takes_only_clients_with_a_certificate(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "ca")
    node, client = ca.issue("node"), ca.issue("client")
    foreign = CertificateAuthority(tmp_path / "other", "someone else's CA").issue("intruder")
    port = free_port()
    env = {"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET, "MILLWHEEL_TLS_CERT": str(node.cert),
           "MILLWHEEL_TLS_KEY": str(node.key), "MILLWHEEL_TLS_CA": str(ca.pem)}
    c = Cluster(tmp_path, env=env, controller_args=["--ui-port", str(port)],
                security=Security(client_token=TOKEN, tls_ca=str(ca.pem), tls_cert=str(client.cert),
                                  tls_key=str(client.key)))
    try:
        c.start_controller()  # its gRPC port took the client's certificate
        with_cert = ssl.create_default_context(cafile=str(ca.pem))
        with_cert.load_cert_chain(str(client.cert), str(client.key))
        wait_for(lambda: get(port, "/api/v1/overview", with_cert)[0] == 200, 20, "the console over mTLS")
        assert get(port, "/healthz", with_cert)[0] == 200

        no_cert = ssl.create_default_context(cafile=str(ca.pem))
        wrong_cert = ssl.create_default_context(cafile=str(ca.pem))
        wrong_cert.load_cert_chain(str(foreign.cert), str(foreign.key))
        for refused in (no_cert, wrong_cert):
            for path in ("/api/v1/overview", "/healthz", "/"):
                with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                    get(port, path, refused)  # before: 200 with the token, no certificate asked
        assert get(port, "/api/v1/workers", with_cert)[0] == 200  # and the console still serves
    finally:
        c.stop()
