"""A reflection client on the current protocol version, ``grpc.reflection.v1`` (what
grpcurl and grpc-js reflection clients ask first; they got UNIMPLEMENTED before).

The client is a separate process importing only grpcio and protobuf. It carries the v1
reflection messages as any v1 client's stubs do (v1alpha's reflection.proto under the
package ``grpc.reflection.v1``), lists the services over v1, fetches the controller's
descriptors over v1 and calls GetWatermark with message classes built from them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from millwheel.record import MAX_TIMESTAMP
from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, Cluster

pytestmark = pytest.mark.timeout(120)

V1_CLIENT = r'''
import json, sys
import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

# The v1 reflection messages, as a v1 client's stubs define them.
fdp = descriptor_pb2.FileDescriptorProto()
v1alpha.DESCRIPTOR.CopyToProto(fdp)
fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
for msg in fdp.message_type:
    for field in msg.field:
        if field.type_name:
            field.type_name = field.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
for svc in fdp.service:
    for m in svc.method:
        m.input_type = m.input_type.replace("v1alpha", "v1")
        m.output_type = m.output_type.replace("v1alpha", "v1")
client_pool = descriptor_pool.DescriptorPool()
client_pool.Add(fdp)
Req = message_factory.GetMessageClass(client_pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
Resp = message_factory.GetMessageClass(client_pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))

channel = grpc.insecure_channel(sys.argv[1])
info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                             request_serializer=Req.SerializeToString, response_deserializer=Resp.FromString)

def ask(**fields):
    return next(iter(info(iter([Req(**fields)]), timeout=10)))

services = sorted(s.name for s in ask(list_services="").list_services_response.service)
resp = ask(file_containing_symbol="millwheel.v1.Controller")
pool = descriptor_pool.DescriptorPool()
comments = {}
for raw in resp.file_descriptor_response.file_descriptor_proto:
    fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
    pool.Add(fdp)
    if fdp.package == "millwheel.v1":  # what a client shows beside each element
        for loc in fdp.source_code_info.location:
            text = (loc.leading_comments + loc.trailing_comments).strip()
            if text:
                comments[".".join(map(str, loc.path))] = text
# path 6.0 = the first service; 4.i.2.j = field j of message i
record = next(i for i, m in enumerate(fdp.message_type) if m.name == "InputStream")
extractor = next(j for j, f in enumerate(fdp.message_type[record].field) if f.name == "key_extractor")
controller = next(i for i, s in enumerate(fdp.service) if s.name == "Controller")
inject = next(j for j, m in enumerate(fdp.service[controller].method) if m.name == "Inject")
method = pool.FindServiceByName("millwheel.v1.Controller").FindMethodByName("GetWatermark")
req_cls = message_factory.GetMessageClass(method.input_type)
resp_cls = message_factory.GetMessageClass(method.output_type)
call = channel.unary_unary("/millwheel.v1.Controller/GetWatermark",
                           request_serializer=req_cls.SerializeToString, response_deserializer=resp_cls.FromString)
wm = call(req_cls(computation="totals"), timeout=10)
assert not any(m.startswith(("services", "millwheel")) for m in sys.modules), "must not import our code"
print(json.dumps({"services": services, "watermarks": [[w.node, w.low_watermark] for w in wm.watermarks],
                  "extractor_doc": comments.get(f"4.{record}.2.{extractor}", ""),
                  "inject_doc": comments.get(f"6.{controller}.2.{inject}", ""),
                  "documented": len(comments)}))
'''


def test_a_v1_reflection_client_discovers_and_calls(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.register(pipelines.topology(key_ranges=2))
        cluster.inject("events", "events", pipelines.workload(n=50), done=True)
        cluster.wait_watermark("totals")
        proc = subprocess.run([sys.executable, "-I", "-c", V1_CLIENT, cluster.address],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
    finally:
        cluster.stop()
    assert "grpc.reflection.v1.ServerReflection" in out["services"]
    assert "grpc.reflection.v1alpha.ServerReflection" in out["services"]
    assert "millwheel.v1.Controller" in out["services"]
    assert out["watermarks"] == [["totals", MAX_TIMESTAMP]]
    assert "json:FIELD" in out["extractor_doc"]  # the field's comment travels with its descriptor
    assert "retry-after-ms" in out["inject_doc"]  # and an RPC's: Inject's backpressure trailers
    assert out["documented"] > 50
