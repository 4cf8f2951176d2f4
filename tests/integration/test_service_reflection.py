"""A stock gRPC client that is not ours: a separate Python process that imports only
grpcio, grpcio-reflection and protobuf (none of our stubs). It discovers the services
by server reflection, builds the message classes from the reflected descriptors and
calls health checking and GetWatermark on the controller, and health on a worker."""

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

STOCK_CLIENT = r'''
import json, sys
import grpc
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

def call(channel, pool, service_name, method, **fields):
    m = pool.FindServiceByName(service_name).FindMethodByName(method)
    req_cls = message_factory.GetMessageClass(m.input_type)
    resp_cls = message_factory.GetMessageClass(m.output_type)
    fn = channel.unary_unary(f"/{service_name}/{method}", request_serializer=req_cls.SerializeToString,
                             response_deserializer=resp_cls.FromString)
    return fn(req_cls(**fields), timeout=10)

out = {}
for name, address in (("controller", sys.argv[1]), ("worker", sys.argv[2])):
    channel = grpc.insecure_channel(address)
    db = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(db)
    services = sorted(db.get_services())
    health = call(channel, pool, "grpc.health.v1.Health", "Check", service="")
    entry = {"services": services, "health": int(health.status)}
    if name == "controller":
        wm = call(channel, pool, "millwheel.v1.Controller", "GetWatermark", computation="totals")
        entry["watermarks"] = [[w.node, w.low_watermark] for w in wm.watermarks]
        desc = pool.FindServiceByName("millwheel.v1.Controller")
        entry["methods"] = sorted(m.name for m in desc.methods)
    out[name] = entry
assert not any(m.startswith("services") or m.startswith("millwheel") for m in sys.modules), \
    "the stock client must not import our code"
print(json.dumps(out))
'''


def test_stock_client_discovers_and_calls_by_reflection(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    try:
        cluster.start_controller()
        worker = cluster.start_worker()
        cluster.register(pipelines.topology(key_ranges=2))
        cluster.inject("events", "events", pipelines.workload(n=100), done=True)
        cluster.wait_watermark("totals")
        worker_address = next(w.address for w in cluster.client.status().workers
                              if w.worker_id.endswith(f"/{worker.pid}"))
        proc = subprocess.run(
            [sys.executable, "-I", "-c", STOCK_CLIENT, cluster.address, worker_address],
            capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
    finally:
        cluster.stop()
    reflection = ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"]
    assert out["controller"]["services"] == sorted(
        ["grpc.health.v1.Health", *reflection, "millwheel.v1.Cluster", "millwheel.v1.Controller"])
    assert out["worker"]["services"] == sorted(["grpc.health.v1.Health", *reflection, "millwheel.v1.Worker"])
    assert out["controller"]["health"] == out["worker"]["health"] == 1  # SERVING
    assert out["controller"]["watermarks"] == [["totals", MAX_TIMESTAMP]]
    assert {"RegisterComputation", "GetWatermark", "GetState", "Inject", "Subscribe",
            "ClusterStatus"} <= set(out["controller"]["methods"])
