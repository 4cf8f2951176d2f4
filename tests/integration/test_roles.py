"""Roles and named credentials (issue 34, items 8 and 10) against a real controller and
worker on loopback, credentials issued and revoked with the real ``millwheel
credentials`` command on the service's store.

- Each role is allowed and refused per a representative RPC of each class (read,
  client, operator; the worker's Ingest.Write too): a refusal is PERMISSION_DENIED
  naming the role needed and the one held, and changes nothing (a refused rescale
  leaves the ranges, a refused stop leaves Inject open), while a canary pipeline keeps
  flowing to the exact expected output.
- The CLI's operator commands send the operator token; with the client token alone
  they are refused with a hint saying where the operator token is.
- A revoked credential is refused by the controller and by the worker's Ingest
  listener within seconds.
- Admission counts per credential: one credential holding its follow-mode Subscribe
  streams does not stop another credential from the same address.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from millwheel.record import Record
from millwheel.topology import Topology
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.rpc.security import Security
from tests.support import pipelines
from tests.support.service_cluster import ROOT, Cluster, expected_outputs, wait_for

pytestmark = pytest.mark.timeout(300)
DISORDER = 2 * pipelines.SECOND
TOKEN = "client-" + secrets.token_urlsafe(24)
OPERATOR = "operator-" + secrets.token_urlsafe(24)
SECRET = "cluster-" + secrets.token_urlsafe(24)
DENIED, UNAUTH, OK = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK
CONTROLLER = pb.DESCRIPTOR.services_by_name["Controller"]
INGEST = pb.DESCRIPTOR.services_by_name["Ingest"]
MAX_STREAMS = 2  # the controller's --max-client-streams here


def topology() -> Topology:
    """parse (re-key) -> counts (10 s windows, the sink): built-in code only."""
    t = pipelines.topology(key_ranges=2)
    return Topology(computations=t.computations[:2], injectors=t.injectors, log_streams=())


def cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}
    full.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


class Service:
    """The cluster, its store URL and the named credentials issued for the tests."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.c = cluster
        self.tmp = tmp
        self.tokens: dict[str, str] = {}

    def issue(self, name: str, role: str) -> str:
        done = cli("credentials", "create", name, "--role", role, "--json", "--store", self.c.store_url,
                   env={}, cwd=self.tmp)
        assert done.returncode == 0, done.stderr
        token = str(json.loads(done.stdout)["token"])
        self.tokens[name] = token
        return token

    def revoke(self, name: str) -> None:
        done = cli("credentials", "revoke", name, "--store", self.c.store_url, env={}, cwd=self.tmp)
        assert done.returncode == 0, done.stderr

    def client(self, token: str) -> ControllerClient:
        return ControllerClient(self.c.address, timeout_s=10, security=Security(client_token=token))

    def ingest_address(self) -> str:
        routes = self.c.client.inject_routes(pb.InjectRoutesRequest(injector="events"))
        return str(next(o.worker_address for o in routes.ranges if o.worker_address))

    def ranges(self, node: str) -> list[tuple[int, int]]:
        return sorted((r.range_id, r.token) for r in self.c.client.status().ranges if r.node == node)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("roles")
    c = Cluster(tmp, env={"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET,
                          "MILLWHEEL_OPERATOR_TOKEN": OPERATOR},
                security=Security(client_token=TOKEN),
                controller_args=["--max-client-streams", str(MAX_STREAMS)])
    try:
        c.start_controller()
        c.start_worker()
        c.register(topology())
        c.wait_balanced()
        s = Service(c, tmp)
        for name, role in (("viewer", "read"), ("loader", "client"), ("ops", "operator")):
            s.issue(name, role)
        for token in s.tokens.values():  # every server re-reads the credentials within seconds
            wait_for(lambda t=token: call(c.address, CONTROLLER, "ClusterStatus", pb.ClusterStatusRequest(),
                                          t)[0] == OK, 10, "the controller to know the new credentials")
            wait_for(lambda t=token: call(s.ingest_address(), INGEST, "Write", pb.WriteRequest(), t)[0] != UNAUTH,
                     10, "the worker to know the new credentials")
        yield s
    finally:
        c.stop()


def call(address: str, service: Any, name: str, request: Any, token: str | None,
         timeout: float = 10) -> tuple[grpc.StatusCode, str]:
    """One raw call (no client library, no retries) with ``token`` as bearer."""
    method = service.methods_by_name[name]
    path = f"/{service.full_name}/{method.name}"
    meta = [("authorization", f"Bearer {token}")] if token is not None else None
    with grpc.insecure_channel(address) as ch:
        make = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
                (True, False): ch.stream_unary, (True, True): ch.stream_stream}
        fn = make[(method.client_streaming, method.server_streaming)](path)
        payload = request.SerializeToString()
        try:
            resp = fn(iter([payload]) if method.client_streaming else payload, timeout=timeout, metadata=meta)
            if method.server_streaming:
                list(resp)
        except grpc.RpcError as exc:
            return exc.code(), str(exc.details())
    return OK, ""


def canary(n: int, start_s: int, prefix: str) -> list[Record]:
    return [Record(key=r.key, value=r.value, timestamp=r.timestamp + start_s * pipelines.SECOND,
                   record_id=f"{prefix}-{r.record_id}") for r in pipelines.workload(n=n)]


def test_each_role_is_allowed_and_refused_per_class(service: Service) -> None:
    s = service
    ingest = s.ingest_address()
    t = {"read": s.tokens["viewer"], "client": TOKEN, "client (named)": s.tokens["loader"],
         "operator": OPERATOR, "operator (named)": s.tokens["ops"]}
    held = {"read": "viewer (role read)", "client": "client token (role client)",
            "client (named)": "loader (role client)", "operator": "operator token (role operator)",
            "operator (named)": "ops (role operator)"}
    empty_write = pb.WriteRequest(injector="events", range_id=0, batch_id=1)
    # (address, service, method, request, role needed): one of each class; the writes are
    # harmless when allowed (an empty Inject and Write batch, a replay of no dead letters).
    probes = [
        (s.c.address, CONTROLLER, "ClusterStatus", pb.ClusterStatusRequest(), "read"),
        (s.c.address, CONTROLLER, "GetWatermark", pb.GetWatermarkRequest(), "read"),
        (s.c.address, CONTROLLER, "Subscribe", pb.SubscribeRequest(stream="counts"), "read"),
        (s.c.address, CONTROLLER, "Inject", pb.InjectRequest(injector="events"), "client"),
        (ingest, INGEST, "Write", empty_write, "client"),
        (s.c.address, CONTROLLER, "ReplayDeadLetters", pb.ReplayDeadLettersRequest(computation="counts"),
         "operator"),
    ]
    rank = {"read": 1, "client": 2, "operator": 3}
    seen = 0
    for who, token in t.items():
        for address, svc, method, request, needed in probes:
            code, details = call(address, svc, method, request, token)
            if rank[who.split()[0]] >= rank[needed]:
                assert code == OK, (who, method, code, details)
            else:
                assert code == DENIED, (who, method, code, details)
                assert f"needs role {needed}" in details and held[who] in details, details
                seen += 1
    assert seen == 3 + 2  # read: Inject, Write, Replay; the two client credentials: Replay
    # A refused operator call names where the operator token is.
    code, details = call(s.c.address, CONTROLLER, "RescaleComputation",
                         pb.RescaleComputationRequest(computation="counts", key_ranges=3), TOKEN)
    assert code == DENIED and "MILLWHEEL_OPERATOR_TOKEN" in details and "operator-token" in details


def test_refusals_change_nothing_while_a_canary_flows(service: Service) -> None:
    s = service
    records = canary(400, 0, "canary")
    want = expected_outputs(s.tmp / "expected", topology(), pipelines.sources(records, DISORDER),
                            ["counts"])["counts"]
    before = s.ranges("counts")
    s.c.inject("events", "events", records[:200], max_disorder_us=DISORDER)
    rescale = pb.RescaleComputationRequest(computation="counts", key_ranges=5)
    stop = pb.CreateSavepointRequest(stop=True)
    refusals = 0
    for token in (TOKEN, s.tokens["loader"], s.tokens["viewer"]):
        for method, request in (("RescaleComputation", rescale), ("CreateSavepoint", stop),
                                ("RestoreSavepoint", pb.RestoreSavepointRequest(chunk=b"x"))):
            code, details = call(s.c.address, CONTROLLER, method, request, token)
            assert code == DENIED and "needs role operator" in details, (method, code, details)
            refusals += 1
    code, details = call(s.c.address, CONTROLLER, "Inject",
                         pb.InjectRequest(injector="events", records=[pb.Record(
                             key="intruder", value=b"{}", timestamp=1, id="intruder-1")], watermark=2**62),
                         s.tokens["viewer"])
    assert code == DENIED and "needs role client" in details
    assert refusals == 9
    assert s.ranges("counts") == before  # the rescale never ran: same ranges, same tokens
    # the refused stop stopped nothing: the rest of the canary goes in, all of it comes out
    s.c.inject("events", "events", records[200:], max_disorder_us=DISORDER, done=True)
    wait_for(lambda: s.c.outputs("counts") == want, 60, "the canary's exact output")
    assert want and s.c.outputs("counts") == want
    # and the operator's named credential may rescale: it runs
    with s.client(s.tokens["ops"]) as ops:
        ops.rescale("counts", len(before) + 1)
    assert len(s.ranges("counts")) == len(before) + 1


def test_the_cli_sends_the_operator_token_for_operator_commands(service: Service) -> None:
    s = service
    n = len(s.ranges("counts"))
    env = {"MILLWHEEL_CONTROLLER": s.c.address, "MILLWHEEL_AUTH_TOKEN": TOKEN}
    refused = cli("rescale", "counts", "--key-ranges", str(n + 1), env=env, cwd=s.tmp)
    assert refused.returncode == 2
    assert "PERMISSION_DENIED" in refused.stderr or "permission denied" in refused.stderr, refused.stderr
    assert "needs role operator" in refused.stderr and "client token (role client)" in refused.stderr
    assert "hint: this command needs the operator token" in refused.stderr, refused.stderr
    assert len(s.ranges("counts")) == n
    # reads with the same client keep working, and the operator token makes the rescale
    assert cli("status", "--json", env=env, cwd=s.tmp).returncode == 0
    done = cli("rescale", "counts", "--key-ranges", str(n + 1), env={**env, "MILLWHEEL_OPERATOR_TOKEN": OPERATOR},
               cwd=s.tmp)
    assert done.returncode == 0, done.stderr
    assert len(s.ranges("counts")) == n + 1
    listed = cli("credentials", "list", "--json", "--store", s.c.store_url, env={}, cwd=s.tmp)
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r["role"] for r in json.loads(listed.stdout)}
    assert {"viewer": "read", "loader": "client", "ops": "operator"}.items() <= rows.items()
    assert not any(tok in listed.stdout for tok in s.tokens.values())  # tokens are never shown again


def test_a_revoked_credential_is_refused_by_controller_and_worker(service: Service) -> None:
    s = service
    token = s.issue("temporary", "client")
    ingest = s.ingest_address()
    write = pb.WriteRequest(injector="events", range_id=0, batch_id=1)
    # a new credential reaches every server within the books' refresh
    wait_for(lambda: call(ingest, INGEST, "Write", write, token)[0] == OK, 10, "the worker to know it")
    wait_for(lambda: call(s.c.address, CONTROLLER, "ClusterStatus", pb.ClusterStatusRequest(), token)[0] == OK,
             10, "the controller to know it")
    s.revoke("temporary")
    revoked_at = time.monotonic()

    def refused_everywhere() -> bool:
        return (call(s.c.address, CONTROLLER, "ClusterStatus", pb.ClusterStatusRequest(), token)[0] == UNAUTH
                and call(ingest, INGEST, "Write", write, token)[0] == UNAUTH)

    wait_for(refused_everywhere, 15, "the revocation to reach the controller and the worker")
    assert time.monotonic() - revoked_at < 10
    code, details = call(s.c.address, CONTROLLER, "Inject", pb.InjectRequest(injector="events"), token)
    assert code == UNAUTH and "wrong token" in details
    # the others are untouched
    assert call(s.c.address, CONTROLLER, "ClusterStatus", pb.ClusterStatusRequest(), s.tokens["loader"])[0] == OK


def test_admission_counts_per_credential_not_per_address(service: Service) -> None:
    """Item 10: all of these come from 127.0.0.1."""
    s = service
    follow = pb.SubscribeRequest(stream="counts", follow=True)
    channels: list[grpc.Channel] = []
    calls: list[Any] = []

    def drain(it: Any) -> None:
        try:
            for _ in it:
                pass
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    def hold(token: str) -> None:
        ch = grpc.insecure_channel(s.c.address)
        channels.append(ch)
        fn = ch.unary_stream(f"/{CONTROLLER.full_name}/Subscribe")
        it = fn(follow.SerializeToString(), metadata=[("authorization", f"Bearer {token}")])
        calls.append(it)
        threading.Thread(target=drain, args=(it,), daemon=True).start()

    try:
        for _ in range(MAX_STREAMS):
            hold(s.tokens["viewer"])

        def viewer_full() -> str | None:
            code, details = call(s.c.address, CONTROLLER, "Subscribe", follow, s.tokens["viewer"], timeout=2)
            return details if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None

        details = wait_for(viewer_full, 15, "the viewer's streams to be admitted")
        assert "credential viewer" in details and "--max-client-streams" in details
        # another credential, from the same address, still gets its streams
        for token in (s.tokens["loader"], TOKEN):
            code, details = call(s.c.address, CONTROLLER, "Subscribe", follow, token, timeout=2)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)  # admitted; followed until then
    finally:
        for it in calls:
            it.cancel()
        for ch in channels:
            ch.close()


def test_mtls_certificates_map_to_roles(tmp_path: Path) -> None:
    """``--tls-role CN=ROLE``: a client certificate without a token has its CN's role; an
    unmapped certificate gets nothing; a token still wins."""
    from tests.support.certs import CertificateAuthority

    ca = CertificateAuthority(tmp_path / "pki")
    node, viewer, ops, stranger = (ca.issue(n) for n in ("node", "viewer", "ops", "stranger"))
    env = {"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET, "MILLWHEEL_TLS_CERT": str(node.cert),
           "MILLWHEEL_TLS_KEY": str(node.key), "MILLWHEEL_TLS_CA": str(ca.pem)}
    c = Cluster(tmp_path, env=env, security=Security(client_token=TOKEN, tls_cert=str(node.cert),
                                                     tls_key=str(node.key), tls_ca=str(ca.pem)),
                controller_args=["--tls-role", "viewer=read", "--tls-role", "ops=operator"])

    def as_cert(cert: Any, method: str, request: Any, token: str | None = None) -> tuple[grpc.StatusCode, str]:
        creds = grpc.ssl_channel_credentials(ca.pem.read_bytes(), cert.key.read_bytes(), cert.cert.read_bytes())
        meta = [("authorization", f"Bearer {token}")] if token else None
        m = CONTROLLER.methods_by_name[method]
        with grpc.secure_channel(c.address, creds) as ch:
            fn = (ch.stream_unary if m.client_streaming else ch.unary_unary)(f"/{CONTROLLER.full_name}/{method}")
            payload = request.SerializeToString()
            try:
                fn(iter([payload]) if m.client_streaming else payload, timeout=10, metadata=meta)
            except grpc.RpcError as exc:
                return exc.code(), str(exc.details())
        return OK, ""

    try:
        c.start_controller()
        status, rescale = pb.ClusterStatusRequest(), pb.RescaleComputationRequest(computation="none", key_ranges=2)
        assert as_cert(viewer, "ClusterStatus", status)[0] == OK
        code, details = as_cert(viewer, "Inject", pb.InjectRequest(injector="events"))
        assert code == DENIED and "needs role client" in details and "certificate CN=viewer (role read)" in details
        code, details = as_cert(ops, "RescaleComputation", rescale)
        assert code == grpc.StatusCode.NOT_FOUND, (code, details)  # past the role check: no such computation
        code, details = as_cert(stranger, "ClusterStatus", status)
        assert code == UNAUTH and "--tls-role" in details
        assert as_cert(stranger, "ClusterStatus", status, TOKEN)[0] == OK  # a token wins
        code, details = as_cert(viewer, "RescaleComputation", rescale, TOKEN)
        assert code == DENIED and "client token (role client)" in details
    finally:
        c.stop()
