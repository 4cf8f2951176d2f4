"""The plaintext probe port (``--health-port``) takes no credential: whoever reaches it
must not be able to stop the probes. Before, two ``Watch`` streams held its two threads
and every ``Check`` after them waited forever (a Kubernetes liveness probe would then
restart a healthy controller)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.redis_server import free_port
from tests.support.service_cluster import Cluster

pytestmark = [pytest.mark.timeout(120)]


def test_watch_streams_on_the_health_port_cannot_stop_the_probes(tmp_path: Path) -> None:
    port = free_port()
    c = Cluster(tmp_path, controller_args=["--health-port", str(port)])
    c.start_controller()
    watchers = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for _ in range(20):
                watchers.append(stub.Watch(health_pb2.HealthCheckRequest()))
            # Every Watch is refused at once: saying where Watch is served, or (calls past
            # the port's concurrency cap, when the flood outruns the refusals on a loaded
            # machine) by grpcio's cap itself; none stays open...
            codes = []
            for call in watchers:
                with pytest.raises(grpc.RpcError) as info:
                    next(call)
                codes.append(info.value.code())
                if info.value.code() == grpc.StatusCode.UNIMPLEMENTED:
                    assert "answers Check only" in (info.value.details() or "")
                else:
                    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            assert grpc.StatusCode.UNIMPLEMENTED in codes
            # ...a Watch sent alone is refused with the message...
            with pytest.raises(grpc.RpcError) as info:
                next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "answers Check only" in (info.value.details() or "")
            # ...and the probe's Check answers, here and on a fresh connection.
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status \
                == health_pb2.HealthCheckResponse.SERVING
        assert c.client.status().answered_by  # the controller itself is untouched
    finally:
        for call in watchers:
            call.cancel()
        c.stop()
