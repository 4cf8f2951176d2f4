"""An Unregister whose answer was lost in a failover is not reported as NOT_FOUND.

Two controllers on real gRPC over loopback, both minimal servicers over one shared
registry: the first removes the computation and then fails the call with UNAVAILABLE
(the answer lost as when a controller dies between committing and replying); the
client moves to the second, which finds nothing to remove. A real controller cannot be
made to lose exactly that reply on demand, so the two servers stand in for it.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any, Iterator

import grpc
import pytest

from millwheel.errors import NotFoundError
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from services.rpc.security import Security


class _Controller(pb_grpc.ControllerServicer):
    def __init__(self, registry: set[str], lose_answer: bool) -> None:
        self.registry, self.lose_answer, self.calls = registry, lose_answer, 0

    def UnregisterComputation(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if request.name not in self.registry:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no computation named {request.name!r}")
        self.registry.discard(request.name)
        if self.lose_answer:
            context.abort(grpc.StatusCode.UNAVAILABLE, "controller going away")
        return pb.UnregisterComputationResponse()


@pytest.fixture
def two() -> Iterator[tuple[set[str], list[_Controller], str]]:
    registry = {"counts"}
    servicers = [_Controller(registry, lose_answer=True), _Controller(registry, lose_answer=False)]
    servers, addresses = [], []
    for s in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_ControllerServicer_to_server(s, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield registry, servicers, ",".join(addresses)
    for server in servers:
        server.stop(0)


def test_not_found_after_a_lost_answer_is_success(two: tuple[set[str], list[_Controller], str]) -> None:
    registry, servicers, addresses = two
    with ControllerClient(addresses, timeout_s=5, failover_s=5, security=Security()) as client:
        client.unregister("counts")  # no NotFoundError: the first attempt did it
    assert registry == set()
    assert [s.calls for s in servicers] == [1, 1]


def test_not_found_without_a_failover_is_still_an_error(two: tuple[set[str], list[_Controller], str]) -> None:
    _registry, servicers, addresses = two
    with ControllerClient(addresses, timeout_s=5, failover_s=5, security=Security()) as client:
        with pytest.raises(NotFoundError, match="no computation named 'nope'"):
            client.unregister("nope")
    assert servicers[0].calls == 1 and servicers[1].calls == 0
