"""Code parameters nested deeper than the limit are refused by name (issue 21, item 8).

``params_json`` of ``[[[[...]]]]`` 30,000 deep fits the 64 KiB limit, and the
controller answered INTERNAL (a RecursionError from the JSON parser) instead of
INVALID_ARGUMENT; 900 deep parsed, to fail later wherever params are walked
recursively. Against a real controller: both are INVALID_ARGUMENT naming the field and
the limit, the registry is unchanged, and a spec at the limit registers.
"""

from __future__ import annotations

import grpc
import pytest

from millwheel.limits import MAX_PARAMS_DEPTH
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from tests.support.service_cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def spec(name: str, depth: int) -> pb.ComputationSpec:
    """A map whose params hold a value ``depth`` levels deep, counting the params mapping."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return pb.ComputationSpec(name=name, inputs=[pb.InputStream(stream="events")], outputs=["out"],
                              code=pb.Code(name="tests.support.pipelines:Doubler",
                                           params_json='{"fixed_flag": null, "nested": ' + inner + "}"))


@pytest.mark.parametrize("depth", [30_000, 900, MAX_PARAMS_DEPTH + 1])
def test_params_nested_too_deep_are_invalid_argument(cluster: Cluster, depth: int) -> None:
    cluster.client.register_injector("events", "events")
    stub = cluster.client.link.stub(pb_grpc.ControllerStub, cluster.address)
    before = stub.ListComputations(pb.ListComputationsRequest(), timeout=10)
    for call, request in (
            (stub.RegisterComputation, pb.RegisterComputationRequest(spec=spec("deep", depth))),
            (stub.RegisterTopology, pb.RegisterTopologyRequest(computations=[spec("deep", depth)]))):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()  # INTERNAL before
        details = err.value.details()
        assert "computation 'deep'.code.params" in details and f"limit of {MAX_PARAMS_DEPTH}" in details
    assert stub.ListComputations(pb.ListComputationsRequest(), timeout=10) == before  # nothing registered
    assert "RecursionError" not in cluster.log("controller")

    stub.RegisterComputation(pb.RegisterComputationRequest(spec=spec("at_limit", MAX_PARAMS_DEPTH)), timeout=10)
    assert [c.spec.name for c in stub.ListComputations(pb.ListComputationsRequest(), timeout=10).computations] \
        == ["at_limit"]
