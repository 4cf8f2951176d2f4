"""Every hostile request of issue 9 replayed against a real ``millwheel up``.

For each attack the test asserts what an operator would check: the status code, a
message that names the field or the limit (and is short), the registry exactly as it
was (ListComputations before and after), health SERVING, and that a normal inject +
subscribe round is still exact afterwards (every record once, nothing else). The code
injection attacks also assert that the command they carry never ran: its proof file
was never written.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.rpc.security import Security
from services.rpc.server import channel
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, wait_for

pytestmark = [pytest.mark.timeout(300)]

INT64_MAX = 2**63 - 1
DONE = 2**62
Code = grpc.StatusCode


class Service:
    """``millwheel up`` (a controller and two workers, built-in operators only) with a
    pipeline ``events -> echo (filter True) -> echoed`` to prove it still works. The
    attacker holds the deployment's client token: these are hostile requests from an
    authenticated client (tests/integration/test_service_auth.py covers the others)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(tmp / "up.log", "ab")  # noqa: SIM115
        self.token = secrets.token_hex(16)
        self.operator = secrets.token_hex(16)  # role operator (issue 34): the client token's calls stop short of it
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), MILLWHEEL_AUTH_TOKEN=self.token,
                        MILLWHEEL_CLUSTER_SECRET=secrets.token_hex(16), MILLWHEEL_OPERATOR_TOKEN=self.operator)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--workers", "2", "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--store", f"sqlite:///{tmp}/security.db"],
            cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        client = Security(client_token=self.token)
        self.client = ControllerClient(self.address, timeout_s=10, security=client)
        self.channel = channel(self.address, client, self.token)
        self.operator_channel = channel(self.address, Security(client_token=self.operator), self.operator)
        self.rounds = 0
        self.echoed_seq = 0

    def start(self) -> None:
        wait_for(lambda: _answers(self.client) and len([w for w in self.client.status().workers
                                                        if w.alive]) == 2, 60, "millwheel up")
        self.client.register_topology(
            [pb.ComputationSpec(name="echo", inputs=[pb.InputStream(stream="events")],
                                outputs=["echoed"], code=pb.Code(name="filter",
                                                                 params_json='{"expr": "True"}'),
                                options=pb.Options(key_ranges=2))],
            [("events", "events")])

    def stop(self) -> None:
        self.client.close()
        self.channel.close()
        self.operator_channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it drains the workers, then the controller
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    # -- what a user would check -------------------------------------------------------
    def registry(self) -> tuple[Any, ...]:
        listed = self.client.computations()
        return (sorted(c.spec.SerializeToString(deterministic=True) for c in listed.computations),
                sorted((i.name, i.stream) for i in listed.injectors),
                sorted((r.node, r.range_id) for r in self.client.status().ranges))

    def health(self) -> int:
        resp = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(resp.status)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def roundtrip(self) -> None:
        """Inject 30 records and read every one back from ``echoed`` exactly once."""
        self.rounds += 1
        n = self.rounds
        sent = [pb.Record(key=f"k{i % 7}", value=json.dumps({"round": n, "i": i}).encode(),
                          timestamp=n * 1_000_000 + i, id=f"round{n}-{i}") for i in range(30)]
        self.client.inject([pb.InjectRequest(injector="events", records=sent)])
        got: list[bytes] = []

        def arrived() -> bool:
            for seq, rec in self.client.subscribe("echoed", after_seq=self.echoed_seq):
                self.echoed_seq = seq
                got.append(rec.value)
            return len(got) >= len(sent)

        wait_for(arrived, 30, f"round {n} to come out of 'echoed'")
        time.sleep(0.3)
        arrived()  # a duplicate would show up here
        assert sorted(got) == sorted(r.value for r in sent)

    def refused(self, call: Callable[[Any], Any], code: grpc.StatusCode, *fragments: str) -> str:
        """Run ``call(channel)``; it must fail with ``code`` and a message holding every
        fragment, and leave everything as it was."""
        before = self.registry()
        try:
            call(self.channel)
        except grpc.RpcError as exc:
            status, details = exc.code(), exc.details() or ""
        else:
            raise AssertionError(f"the call succeeded; expected {code.name}")
        assert status == code, details
        for fragment in fragments:
            assert fragment in details, (fragment, details)
        assert len(details) < 2000, f"a {len(details)}-character message"
        assert self.registry() == before
        assert self.health() == health_pb2.HealthCheckResponse.SERVING
        self.roundtrip()
        return details


def _answers(client: ControllerClient) -> bool:
    try:
        client.status()
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = Service(tmp_path_factory.mktemp("security"))
    try:
        s.start()
        s.roundtrip()
        yield s
    finally:
        s.stop()


def unary(method: str, request: Any) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        fn = ch.unary_unary(f"/millwheel.v1.Controller/{method}",
                            request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=lambda b: b)
        return fn(request, timeout=30)
    return call


def register(spec: pb.ComputationSpec) -> Callable[[grpc.Channel], Any]:
    return unary("RegisterComputation", pb.RegisterComputationRequest(spec=spec))


def inject(*messages: pb.InjectRequest) -> Callable[[grpc.Channel], Any]:
    def call(ch: grpc.Channel) -> Any:
        fn = ch.stream_unary("/millwheel.v1.Controller/Inject",
                             request_serializer=lambda m: m.SerializeToString(),
                             response_deserializer=lambda b: b)
        return fn(iter(messages), timeout=30)
    return call


def spec(name: str = "attack", code: str = "filter", params: Any = None, key: str = "key",
         **options: Any) -> pb.ComputationSpec:
    return pb.ComputationSpec(
        name=name, inputs=[pb.InputStream(stream="events", key_extractor=key)], outputs=[f"{name}_out"],
        code=pb.Code(name=code, params_json=json.dumps({"expr": "True"} if params is None else params)),
        options=pb.Options(**options))


def record(i: int = 0, **fields: Any) -> pb.Record:
    return pb.Record(**{"key": "k", "value": b"{}", "timestamp": 1_000 + i, "id": f"attack-{i}", **fields})


# -- nothing user-supplied is executed by validation ---------------------------------------------
def test_code_named_in_a_spec_is_never_run(service: Service, tmp_path: Path) -> None:
    proof = tmp_path / "proof"
    command = f"touch {proof}"
    for code, params in [("os:system", {"command": command}), ("subprocess:getoutput", {"cmd": command}),
                         ("unittest.mock:MagicMock", {})]:
        details = service.refused(register(spec(code=code, params=params)), Code.PERMISSION_DENIED,
                                  f"computation 'attack'.code.name {code!r}", "allow-list",
                                  "built-in operators only")
        assert "--allow-code" in details
    # The same code as a key extractor, as a filter's function, and inside a topology.
    service.refused(register(spec(key="import:os:system")), Code.PERMISSION_DENIED,
                    "inputs[0].key 'os:system'", "allow-list")
    service.refused(register(spec(params={"function": "os:system"})), Code.PERMISSION_DENIED,
                    "code.params.function 'os:system'", "allow-list")
    topo = pb.RegisterTopologyRequest(computations=[spec(code="os:system", params={"command": command})])
    service.refused(unary("RegisterTopology", topo), Code.PERMISSION_DENIED, "'os:system'")
    time.sleep(1.0)  # nothing runs later either (workers never saw it)
    assert not proof.exists()


def test_malformed_parameters_name_the_field(service: Service) -> None:
    service.refused(register(spec(code="window_aggregate", params={"size_us": "abc"})),
                    Code.INVALID_ARGUMENT, "computation 'attack'.code.params.size_us: expected an integer",
                    "'abc'")
    service.refused(register(spec(code="window_aggregate", params={})), Code.INVALID_ARGUMENT,
                    "computation 'attack'.code.params.size_us: required")
    service.refused(register(spec(code="window_aggregate", params={"size_us": 10**12, "period_us": 1})),
                    Code.INVALID_ARGUMENT, "period_us", "windows per record, over the limit of 1000")


def test_expressions_are_bounded(service: Service) -> None:
    huge = "1" + "+1" * 300_000  # RecursionError -> INTERNAL before
    service.refused(register(spec(params={"expr": huge})), Code.INVALID_ARGUMENT,
                    "params_json", "over the limit of 65536 bytes")
    service.refused(register(spec(params={"expr": "1" + "+1" * 3000})), Code.INVALID_ARGUMENT,
                    "code.params.expr: expression of 6001 characters, over the limit of 4096")
    service.refused(register(spec(params={"expr": "(" * 100 + "1" + ")" * 100 + " + -" * 80 + "1"})),
                    Code.INVALID_ARGUMENT, "code.params.expr: expression nested deeper than the limit of 64")


# -- bounds on everything a request can size --------------------------------------------------
def test_names_are_bounded(service: Service) -> None:
    long_name = "n" * 1_000_000
    service.refused(register(spec(name=long_name)), Code.INVALID_ARGUMENT,
                    "name of 1000000 characters, over the limit of 200")
    service.refused(register(spec(name="a b/c")), Code.INVALID_ARGUMENT,
                    "'a b/c': names may hold only letters, digits and _ . - :")
    service.refused(unary("RegisterInjector", pb.RegisterInjectorRequest(
        spec=pb.InjectorSpec(name=long_name, stream="events"))), Code.INVALID_ARGUMENT, "over the limit of 200")
    service.refused(inject(pb.InjectRequest(injector=long_name, stream="events", records=[record()])),
                    Code.INVALID_ARGUMENT, "inject message 0: injector", "over the limit of 200")
    assert "nnnnnnnnnn" not in service.metrics()
    # Queries of a name that cannot exist answer NOT_FOUND without echoing it whole.
    for method, request in [("GetWatermark", pb.GetWatermarkRequest(computation=long_name)),
                            ("GetState", pb.GetStateRequest(computation=long_name, key="k")),
                            ("DescribeComputation", pb.DescribeComputationRequest(name=long_name))]:
        service.refused(unary(method, request), Code.NOT_FOUND, "'" + "n" * 200 + "'")
    # Dead-letter replay is the operator's (issue 34): the client token is refused before
    # the name is looked at; the operator gets the same NOT_FOUND without the name whole.
    replay = unary("ReplayDeadLetters", pb.ReplayDeadLettersRequest(computation=long_name))
    service.refused(replay, Code.PERMISSION_DENIED, "needs role operator", "client token (role client)")
    service.refused(lambda _client: replay(service.operator_channel), Code.NOT_FOUND, "'" + "n" * 200 + "'")

    def subscribe(ch: grpc.Channel) -> Any:
        fn = ch.unary_stream("/millwheel.v1.Controller/Subscribe",
                             request_serializer=lambda m: m.SerializeToString(),
                             response_deserializer=lambda b: b)
        return list(fn(pb.SubscribeRequest(stream=long_name), timeout=30))
    service.refused(subscribe, Code.NOT_FOUND, "no stream named '" + "n" * 200 + "'")


def test_key_ranges_are_bounded_and_refused_at_once(service: Service) -> None:
    t0 = time.monotonic()
    service.refused(register(spec(key_ranges=1_000_000_000)), Code.INVALID_ARGUMENT,
                    "options.key_ranges: must be 1..4096", "1000000000")
    assert time.monotonic() - t0 < 30  # the round trip included; the refusal itself is immediate


def test_params_and_log_streams_are_bounded(service: Service) -> None:
    service.refused(register(spec(params={"expr": "True", "output": "x" * 70_000})),
                    Code.INVALID_ARGUMENT, "params_json", "over the limit of 65536 bytes")
    many = pb.RegisterTopologyRequest(computations=[spec()], log_streams=["attack_out"] * 100_000)
    service.refused(unary("RegisterTopology", many), Code.INVALID_ARGUMENT,
                    "log_streams: 100000 streams, over the limit of 1024")


def test_keys_ids_and_message_sizes_are_bounded(service: Service) -> None:
    service.refused(inject(pb.InjectRequest(injector="events", records=[record(), record(1, key="k" * 5_000_000)])),
                    Code.INVALID_ARGUMENT, "inject message 0 record 1: key of 5000000 bytes, over the limit of 4096")
    service.refused(inject(pb.InjectRequest(injector="events", records=[record(id="i" * 1_000_000)])),
                    Code.INVALID_ARGUMENT, "record 0: id of 1000000 bytes, over the limit of 256 bytes")
    many = [pb.Record(key="k", timestamp=1, id=str(i)) for i in range(100_001)]
    service.refused(inject(pb.InjectRequest(injector="events", records=many)), Code.RESOURCE_EXHAUSTED,
                    "100001 records, over the limit of 100000 records per message (--max-inject-records)")


def injector_watermark(service: Service) -> int:
    return next(w.low_watermark for w in service.client.watermarks("injector:events"))


def test_watermarks_cannot_close_or_jump_the_injector(service: Service) -> None:
    before = injector_watermark(service)
    for wm in (INT64_MAX, DONE):
        service.refused(inject(pb.InjectRequest(injector="events", records=[record()], watermark=wm)),
                        Code.INVALID_ARGUMENT, f"watermark {wm} is out of range", "done=true")
    year_9999 = 253_402_300_799_000_000
    service.refused(inject(pb.InjectRequest(injector="events", records=[record(timestamp=year_9999)])),
                    Code.INVALID_ARGUMENT, "inject message 0 record 0", f"timestamp {year_9999}",
                    "9999-12-31", "--max-future-us=86400000000")
    service.refused(inject(pb.InjectRequest(injector="events", watermark=year_9999)),
                    Code.INVALID_ARGUMENT, f"watermark {year_9999}", "--max-future-us")
    assert injector_watermark(service) == before


def test_far_future_record_through_the_cli_is_refused(service: Service, tmp_path: Path) -> None:
    before = injector_watermark(service)
    lines = [{"key": "a", "value": "on time", "timestamp": 5_000}, {"key": "b", "timestamp": 253_402_300_799_000_000}]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = subprocess.run([sys.executable, "-m", "services.cli", "inject", str(path), "--injector", "events",
                           "--controller", service.address], cwd=ROOT, env=service.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "record 1 (key 'b'" in done.stderr and "--max-future-us" in done.stderr, done.stderr
    assert injector_watermark(service) == before  # the watermark did not move to year 9999
    service.roundtrip()


# -- registration is atomic -----------------------------------------------------------------------
def test_a_topology_registers_all_or_nothing(service: Service, tmp_path: Path) -> None:
    good = spec(name="half1")
    bad = spec(name="half2", code="window_aggregate", params={"size_us": "abc"})
    service.refused(unary("RegisterTopology", pb.RegisterTopologyRequest(
        computations=[good, bad], injectors=[pb.InjectorSpec(name="extra", stream="extra")])),
        Code.INVALID_ARGUMENT, "computation 'half2'.code.params.size_us")
    clash = spec(name="echo", params={"expr": "False"})  # differs from the registered 'echo'
    service.refused(unary("RegisterTopology", pb.RegisterTopologyRequest(computations=[good, clash])),
                    Code.ALREADY_EXISTS, "computation 'echo' is already registered")
    # The CLI sends a spec file in one call: the same all or nothing.
    before = service.registry()
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps({"injectors": [{"name": "more", "stream": "more"}], "computations": [
        {"name": "half1", "inputs": ["events"], "outputs": ["h1"], "code": {"name": "filter",
                                                                             "params": {"expr": "True"}}},
        {"name": "half2", "inputs": ["events"], "outputs": ["h2"],
         "code": {"name": "window_aggregate", "params": {"size_us": "abc"}}}]}))
    done = subprocess.run([sys.executable, "-m", "services.cli", "register", str(path), "--controller",
                           service.address], cwd=ROOT, env=service.env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "computation 'half2'.code.params.size_us" in done.stderr, done.stderr
    assert service.registry() == before


def test_metric_series_exist_only_for_registered_names(service: Service) -> None:
    service.client.register_topology([spec(name="temporary")], [])
    wait_for(lambda: 'node="temporary"' in service.metrics(), 20, "the new computation's series")
    service.client.unregister("temporary")
    wait_for(lambda: 'node="temporary"' not in service.metrics(), 20, "its series to go")
    assert 'node="echo"' in service.metrics()
    service.roundtrip()


def test_workers_import_only_allowed_code(tmp_path: Path) -> None:
    """The controller allows a module (so the registration is taken) but a worker does
    not: that worker never imports it. A worker that allows it does (the proof file
    shows the test can tell)."""
    from tests.support.service_cluster import Cluster

    proof = tmp_path / "proof"
    cluster = Cluster(tmp_path, allow_code="tests.support.proof_code", worker_args=["--allow-code", ""])
    env = {"MILLWHEEL_PROOF_FILE": str(proof)}
    try:
        cluster.start_controller()
        cluster.start_worker(env=env)  # its later --allow-code '' wins: built-ins only
        cluster.client.register_topology(
            [spec(name="user", code="tests.support.proof_code:Passthrough", params={})], [("events", "events")])
        wait_for(lambda: "not in this deployment's code allow-list" in cluster.log("worker0"), 20,
                 "the worker to refuse the code")
        assert not proof.exists()
        assert "(--allow-code: none: built-in operators only)" in cluster.log("worker0")
        cluster.start_worker("--allow-code", "tests.support.proof_code", env=env)
        cluster.workers[0].kill()  # its ranges move to the worker that allows the code
        wait_for(proof.exists, 30, "the allowing worker to import the code")
    finally:
        cluster.stop()
