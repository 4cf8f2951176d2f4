"""A redis-stream connector naming the service's own Redis store is refused at
registration (issue 34, item 5): a real controller over a real redis-server. A sink
writing ``mw:ranges:{C}`` there would make C's ranges key a stream before C exists, and
C would never run. Spelled as localhost or as 127.0.0.1, with or without a /db, as a
sink or as an injector's source, through RegisterTopology and RegisterInjector: each
is INVALID_ARGUMENT naming the connector, and the registry is unchanged. The same
connector naming a second redis-server is accepted."""

from __future__ import annotations

import time
from typing import Any, Iterator

import grpc
import pytest
import redis

from millwheel.errors import MillWheelError
from millwheel.spec import spec_parts
from millwheel.topology import InjectorSpec
from services.client import ControllerClient
from services.controller.service import serve
from services.generated import millwheel_pb2 as pb
from services.rpc.convert import injector_request_to_proto
from services.rpc.security import Security
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def service() -> Iterator[tuple[Any, ControllerClient, RedisServer, RedisServer]]:
    with RedisServer() as store, RedisServer() as other:
        server, port, _m, controller = serve(store.url, port=0, metrics_port=None)
        client = ControllerClient(f"127.0.0.1:{port}", timeout_s=30, security=Security())
        try:
            deadline = time.monotonic() + 30
            while not controller.plane.leading():
                assert time.monotonic() < deadline, "the controller never led"
                time.sleep(0.05)
            yield controller, client, store, other
        finally:
            client.close()
            controller.close()
            server.stop(0)


def sink(url: str, target: str = "mw:ranges:{late}") -> dict[str, Any]:
    return {"name": "out", "stream": "ev", "type": "redis-stream", "url": url, "redis_stream": target}


def source(url: str, name: str = "pulled") -> InjectorSpec:
    item = {"name": name, "stream": "ev", "source": {"type": "redis-stream", "url": url, "stream": "events"}}
    return spec_parts({"injectors": [item]})[1][0]


def refused(what: str, call: Any, *args: Any, **kwargs: Any) -> None:
    with pytest.raises(MillWheelError) as err:
        call(*args, **kwargs)
    assert getattr(err.value, "status", None) == grpc.StatusCode.INVALID_ARGUMENT, err.value
    text = str(err.value)
    assert what in text and "names the Redis server that holds this service's own store" in text, text


def test_connectors_naming_the_services_own_redis_are_refused(
        service: tuple[Any, ControllerClient, RedisServer, RedisServer]) -> None:
    controller, client, store, other = service
    client.register_topology([], [("ev", "ev")])
    registry = controller.plane.registry
    before = (registry.version, registry.topology)
    own = [f"redis://localhost:{store.port}", f"redis://127.0.0.1:{store.port}/0",
           f"redis://localhost:{store.port}/3"]  # another database of the same server too
    for url in own:
        sinks = spec_parts({"injectors": [{"name": "ev", "stream": "ev"}], "sinks": [sink(url)]})[3]
        refused("sink 'out'", client.register_topology, [], [("ev", "ev")], sinks=sinks)
        refused("injector 'pulled' source", client.register_topology, [], [source(url)])
        req = pb.RegisterInjectorRequest(spec=injector_request_to_proto(source(url, "single")))
        refused("injector 'single' source", client._unary, "RegisterInjector", req, 30)
    registry = controller.plane.registry
    assert (registry.version, registry.topology) == before  # nothing registered
    raw = redis.Redis(port=store.port)
    assert not raw.exists("mw:ranges:{late}")  # nor written
    assert "out" not in str(client.status())

    # Another Redis server: accepted, the sink writes there (so nothing collides with the store).
    sinks = spec_parts({"injectors": [{"name": "ev", "stream": "ev"}],
                        "sinks": [sink(f"redis://localhost:{other.port}", "out")]})[3]
    client.register_topology([], [("ev", "ev"), source(f"redis://127.0.0.1:{other.port}")], sinks=sinks)
    req = pb.RegisterInjectorRequest(spec=injector_request_to_proto(source(f"redis://localhost:{other.port}/1",
                                                                            "single")))
    client._unary("RegisterInjector", req, 30)
    topo = controller.plane.registry.topology
    assert [s.name for s in topo.sinks] == ["out"]
    assert sorted(i.name for i in topo.injectors) == ["ev", "pulled", "single"]


def test_every_node_of_the_stores_cluster_is_the_store() -> None:
    """On Redis Cluster a connector naming any node (not only the URL's) is refused."""
    from millwheel.connectors.own_store import refuse_own_store
    from millwheel.errors import InvalidSpecError
    from millwheel.state.url import open_store
    from tests.support.redis_cluster import RedisClusterNodes

    with RedisClusterNodes(masters=3, replicas=0) as nodes, RedisServer() as other:
        store = open_store(nodes.url)
        try:
            store.get_meta("x")  # the client finds the cluster
            ports = {port for _h, port in store.servers()}  # type: ignore[attr-defined]
            assert len(ports) == 3
            for port in ports:
                with pytest.raises(InvalidSpecError, match="own store"):
                    refuse_own_store([("sink 'x'", "redis-stream", {"url": f"redis://localhost:{port}"})], store)
            refuse_own_store([("sink 'x'", "redis-stream", {"url": f"redis://localhost:{other.port}"})], store)
        finally:
            store.close()
