"""Bad input over the wire gets the right gRPC status, says what is wrong and where,
and changes nothing: the registry, the injector and the outputs are as before."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from millwheel.errors import AlreadyExistsError, InvalidSpecError, NotFoundError
from services.generated import millwheel_pb2 as pb
from services.rpc.server import channel
from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, Cluster

pytestmark = pytest.mark.timeout(120)
LIMIT = 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("errors"), controller_args=["--max-value-bytes", str(LIMIT)],
                allow_code=PIPELINE_CODE)
    c.start_controller()
    c.start_worker()
    c.register(pipelines.topology(key_ranges=2))
    records = pipelines.workload(n=50)
    c.inject("events", "events", records, done=False)
    c.wait_watermark("totals", records[-1].timestamp - 10 * pipelines.SECOND)  # settled
    c.wait_watermark("injector:events", records[-1].timestamp)
    try:
        yield c
    finally:
        c.stop()


def snapshot(c: Cluster) -> tuple[object, ...]:
    comps = c.client.computations()
    return (
        [(x.spec.name, x.spec.code.name, x.spec.options.key_ranges) for x in comps.computations],
        [(i.name, i.stream) for i in comps.injectors],
        [(w.node, w.low_watermark) for w in c.client.watermarks() if w.node == "injector:events"],
        len(c.client.status().ranges),
    )


def call_raw(c: Cluster, method: str, payload: bytes, streaming: bool = False) -> grpc.RpcError:
    ch = channel(c.address)
    try:
        if streaming:
            fn = ch.stream_unary(f"/millwheel.v1.Controller/{method}")
            fn(iter([payload]), timeout=10)
        else:
            ch.unary_unary(f"/millwheel.v1.Controller/{method}")(payload, timeout=10)
    except grpc.RpcError as exc:
        return exc
    finally:
        ch.close()
    raise AssertionError(f"{method} accepted a malformed message")


def status_of(fn) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    raise AssertionError("the call succeeded")


def test_malformed_protobuf_is_invalid_argument(cluster: Cluster) -> None:
    before = snapshot(cluster)
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, absurd length
    for method, streaming in [("RegisterComputation", False), ("GetWatermark", False),
                              ("Inject", True)]:
        err = call_raw(cluster, method, garbage, streaming)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.details())
        assert "malformed millwheel.v1." in err.details()
    assert snapshot(cluster) == before


def test_bad_records_are_refused_and_inject_nothing(cluster: Cluster) -> None:
    stub = cluster.client.stub
    before = snapshot(cluster)
    counts_before = cluster.outputs("counts")

    def inject(*records: pb.Record, injector: str = "events", stream: str = "") -> None:
        msg = pb.InjectRequest(injector=injector, stream=stream, records=list(records), watermark=10**18)
        stub.Inject(iter([msg]), timeout=10)

    good = pb.Record(key="a", value=b'{"user": "u1"}', timestamp=5, id="good-1")
    code, msg = status_of(lambda: inject(good, pb.Record(key="", value=b"{}", timestamp=6, id="x")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "record 1: key must not be empty" in msg
    code, msg = status_of(lambda: inject(good, pb.Record(key="k", value=b"x" * (LIMIT + 1), timestamp=6)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"limit of {LIMIT} bytes" in msg
    code, msg = status_of(lambda: inject(good, injector="nobody", stream="nowhere"))
    assert code == grpc.StatusCode.NOT_FOUND and "'nowhere'" in msg
    code, msg = status_of(lambda: inject(good, injector="nobody"))
    assert code == grpc.StatusCode.NOT_FOUND and "no injector named 'nobody'" in msg
    code, msg = status_of(lambda: inject(good, stream="parsed"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "writes stream 'events'" in msg
    # Nothing of those messages got in: the good record beside each bad one included,
    # and the watermark they carried was not applied.
    assert snapshot(cluster) == before
    assert cluster.outputs("counts") == counts_before


def test_bad_queries_name_what_is_missing(cluster: Cluster) -> None:
    c = cluster.client
    with pytest.raises(NotFoundError, match="no computation named 'nope'"):
        c.state("nope", "k")
    with pytest.raises(InvalidSpecError, match="key must not be empty"):
        c.state("counts", "")
    with pytest.raises(NotFoundError, match=r"'parsed' .* is consumed by another computation.*log_streams: \[parsed\]"):
        list(c.subscribe("parsed"))
    with pytest.raises(NotFoundError, match="no stream named 'nowhere'"):
        list(c.subscribe("nowhere"))
    with pytest.raises(NotFoundError, match="no computation or injector named 'nope'"):
        c.watermarks("nope")
    with pytest.raises(NotFoundError):
        list(c.keys("nope"))
    st = c.state("counts", "never-seen")
    assert not st.exists and not st.timers


def test_bad_specs_are_refused_and_register_nothing(cluster: Cluster) -> None:
    from services.rpc.convert import spec_dict_to_proto

    c = cluster.client
    before = snapshot(cluster)
    good = {"name": "extra", "inputs": [{"stream": "counts"}], "outputs": ["extra"],
            "code": {"name": "filter", "params": {"expr": "True"}}}
    cases = {
        "unknown built-in operator 'nosuch'": {**good, "code": {"name": "nosuch"}},
        "input stream 'ghost' is produced by no computation or injector":
            {**good, "inputs": [{"stream": "ghost"}]},
        r"params: unknown parameters \['nope'\] for 'filter'":
            {**good, "code": {"name": "filter", "params": {"nope": 1}}},
        "code.name 'no/such:Thing': expected 'pkg.module:attribute'": {**good, "code": {"name": "no/such:Thing"}},
    }
    for fragment, spec in cases.items():
        with pytest.raises(InvalidSpecError, match=fragment):
            c.register_computation(spec_dict_to_proto(spec))
    # Specs that a client-side check would reject still reach the server from a raw client.
    raw = pb.ComputationSpec(name="extra", inputs=[pb.InputStream(stream="counts")], outputs=["extra"],
                             code=pb.Code(name="filter", params_json='{"expr": "True"}'),
                             options=pb.Options(key_ranges=0))
    with pytest.raises(InvalidSpecError, match=r"key_ranges: must be 1\.\.4096"):
        c.register_computation(raw)
    raw.options.ClearField("key_ranges")
    raw.inputs[0].key_extractor = "weird"
    with pytest.raises(InvalidSpecError, match="key extractor 'weird' not understood"):
        c.register_computation(raw)
    raw.inputs[0].key_extractor = ""
    raw.code.params_json = "{not json"
    with pytest.raises(InvalidSpecError, match="params_json: not valid JSON"):
        c.register_computation(raw)
    cyclic = pb.ComputationSpec(name="parse2", inputs=[pb.InputStream(stream="totals")], outputs=["events"],
                                code=pb.Code(name="filter", params_json='{"expr": "True"}'))
    with pytest.raises(InvalidSpecError, match="cycle"):
        c.register_computation(cyclic)
    with pytest.raises(InvalidSpecError, match="'spec' is required"):
        c.call(lambda: c.stub.RegisterComputation(pb.RegisterComputationRequest(), timeout=10))
    existing = c.computations().computations[0].spec
    with pytest.raises(AlreadyExistsError, match="'parse' is already registered"):
        c.register_computation(existing)
    with pytest.raises(AlreadyExistsError, match="already registered for stream 'events'"):
        c.register_injector("events", "parsed")
    with pytest.raises(NotFoundError):
        c.unregister("nope")
    from services.rpc.status import PreconditionError

    with pytest.raises(PreconditionError, match="cannot unregister 'counts'"):
        c.unregister("counts")
    assert snapshot(cluster) == before


def test_cli_reports_errors_with_exit_code(cluster: Cluster, tmp_path: Path) -> None:
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ninputs: [nowhere]\noutputs: [y]\ncode: {name: filter, params: {expr: 'True'}}\n")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "register", str(bad),
                           "--controller", cluster.address], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "input stream 'nowhere' is produced by no computation or injector" in proc.stderr
    assert "[INVALID_ARGUMENT]" in proc.stderr
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"key": "", "value": "v", "timestamp": 1}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "inject", str(lines), "--injector",
                           "events", "--controller", cluster.address],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and f"{lines}:1: key must be a non-empty string" in proc.stderr



def test_unregister_removes_a_computation_and_its_ranges(cluster: Cluster) -> None:
    from services.rpc.convert import spec_dict_to_proto

    c = cluster.client
    before = snapshot(cluster)
    spec = {"name": "echo", "inputs": [{"stream": "totals"}], "outputs": ["echoed"],
            "code": {"name": "filter", "params": {"expr": "True"}}, "options": {"key_ranges": 2}}
    info = c.register_computation(spec_dict_to_proto(spec)).computation
    assert info.spec.name == "echo" and len(info.ranges) == 2
    assert "echo" in [x.spec.name for x in c.computations().computations]
    c.unregister("echo")
    assert "echo" not in [x.spec.name for x in c.computations().computations]
    assert not [r for r in c.status().ranges if r.node == "echo"]
    assert snapshot(cluster) == before
