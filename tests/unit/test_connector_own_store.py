"""A Redis connector naming the service's own store's server is refused (issue 34, item 5):
the comparison of addresses (millwheel/connectors/own_store.py), the registry's refusal
with nothing stored, and the worker's second line."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from millwheel.connectors.own_store import check_not_own_store, host_key, refuse_own_store, server_of
from millwheel.connectors.spec import sinks_from_list
from millwheel.errors import InvalidSpecError
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import InjectorSpec
from services.controller.registry import Registry


@pytest.mark.parametrize("url,server", [
    ("redis://localhost", ("loopback", 6379)),
    ("redis://127.0.0.1:6379/0", ("loopback", 6379)),
    ("redis://127.0.1.1:6380/3", ("loopback", 6380)),
    ("rediss://u:pw@[::1]:7000", ("loopback", 7000)),
    ("redis://0.0.0.0", ("loopback", 6379)),
    ("redis://", ("loopback", 6379)),
    ("redis://Redis.Example.:6379", ("redis.example", 6379)),
    ("redis://10.0.0.7", ("10.0.0.7", 6379)),
    ("redis://[::ffff:10.0.0.7]", ("10.0.0.7", 6379)),
    ("postgresql://h/x", None),
    ("redis://h:notaport", None),
])
def test_servers_are_compared_by_normalised_host_and_port(url: str, server: Any) -> None:
    assert server_of(url) == server


def test_loopback_names() -> None:
    assert host_key("LOCALHOST") == host_key("127.0.0.1") == host_key("::1") == "loopback"
    assert host_key("redis") == "redis"


STORE = [("loopback", 6379)]


@pytest.mark.parametrize("url", ["redis://localhost", "redis://127.0.0.1:6379/5", "redis://:pw@localhost:6379/0",
                                 "rediss://[::1]/1"])
def test_the_stores_server_is_refused_whatever_the_db(url: str) -> None:
    with pytest.raises(InvalidSpecError, match="sink 'x': redis-stream URL .* names the Redis server that holds "
                                               "this service's own store"):
        check_not_own_store("sink 'x'", "redis-stream", {"url": url}, STORE)


def test_a_shown_url_has_no_password() -> None:
    with pytest.raises(InvalidSpecError) as err:
        check_not_own_store("sink 'x'", "redis-stream", {"url": "redis://:s3cret@localhost"}, STORE)
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize("url", ["redis://localhost:6380", "redis://10.0.0.7:6379"])
def test_another_server_is_accepted(url: str) -> None:
    check_not_own_store("sink 'x'", "redis-stream", {"url": url}, STORE)


def test_other_kinds_and_stores_without_redis_are_not_judged() -> None:
    check_not_own_store("sink 'x'", "postgres", {"url": "postgresql://localhost:6379/x"}, STORE)
    check_not_own_store("sink 'x'", "redis-stream", {"url": "redis://localhost"}, [])


def test_the_stores_servers_are_normalised_too() -> None:
    with pytest.raises(InvalidSpecError):
        check_not_own_store("sink 'x'", "redis-stream", {"url": "redis://localhost:7001"}, [("127.0.0.1", 7001)])


def test_a_name_resolving_to_the_stores_address_is_the_same_server(monkeypatch: pytest.MonkeyPatch) -> None:
    hosts = {"redis.svc": "10.0.0.7", "store.svc": "10.0.0.7", "other.svc": "10.0.0.8", "me": "127.0.1.1"}

    def getaddrinfo(host: str, *_: Any) -> list[Any]:
        if host not in hosts:
            raise socket.gaierror(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (hosts[host], 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for url, store in [("redis://redis.svc", [("store.svc", 6379)]), ("redis://redis.svc", [("10.0.0.7", 6379)]),
                       ("redis://me", [("localhost", 6379)])]:
        with pytest.raises(InvalidSpecError):
            check_not_own_store("sink 'x'", "redis-stream", {"url": url}, store)
    for url, store in [("redis://other.svc", [("store.svc", 6379)]), ("redis://unknown.svc", [("store.svc", 6379)]),
                       ("redis://redis.svc:6380", [("store.svc", 6379)])]:
        check_not_own_store("sink 'x'", "redis-stream", {"url": url}, store)


class _RedisLike:
    """A store whose data is on these servers (as RedisConnection.servers answers)."""

    def __init__(self, inner: SQLiteStore, servers: list[tuple[str, int]]) -> None:
        self._inner, self._servers = inner, servers

    def servers(self) -> list[tuple[str, int]]:
        return self._servers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_the_registry_refuses_and_stores_nothing(tmp_path: Any) -> None:
    inner = SQLiteStore(str(tmp_path / "s.db"))
    try:
        store = _RedisLike(inner, [("localhost", 6379), ("10.1.1.1", 7000)])
        reg = Registry(store)  # type: ignore[arg-type]
        version = reg.version
        for url in ("redis://127.0.0.1", "redis://10.1.1.1:7000/2"):  # the URL's node, a cluster node
            sinks = sinks_from_list([{"stream": "out", "type": "redis-stream", "url": url,
                                      "redis_stream": "mw:ranges:{c}"}])
            with pytest.raises(InvalidSpecError, match="sink 'out.redis-stream'"):
                reg.register_topology((), (InjectorSpec("out", "out"),), (), sinks)
        assert reg.version == version and reg.topology.sinks == () and reg.topology.injectors == ()
        assert Registry(store).topology == reg.topology  # type: ignore[arg-type]
        ok = sinks_from_list([{"stream": "out", "type": "redis-stream", "url": "redis://localhost:6390",
                               "redis_stream": "out"}])
        reg.register_topology((), (InjectorSpec("out", "out"),), (), ok)
        assert [s.name for s in reg.topology.sinks] == ["out.redis-stream"]
    finally:
        inner.close()


def test_refuse_own_store_reads_the_stores_servers_only_for_redis_connectors() -> None:
    class Store:
        def servers(self) -> list[tuple[str, int]]:
            raise AssertionError("not asked: no Redis connector")

    refuse_own_store([("sink 'p'", "postgres", {"url": "postgresql://localhost/x"})], Store())


def test_the_worker_refuses_to_build_one_a_registry_holds_already(tmp_path: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The second line: a registry written before the check still names the store's server."""
    import threading

    from millwheel.nodes import sink_node
    from millwheel.topology import Topology
    from services.metrics import PrometheusSensors
    from services.worker.connectors import Connectors
    from services.worker.failing import RangeFailures
    from services.worker.shared import Shared

    inner = SQLiteStore(str(tmp_path / "s.db"))
    stopped = threading.Event()
    store = _RedisLike(inner, [("127.0.0.1", 6399)])
    c = Connectors(Shared(), store, PrometheusSensors("worker"), stopped,  # type: ignore[arg-type]
                   batch_size=100, max_injector_outbox=1000, fenced=lambda _o, _e: None,
                   report_fenced=lambda _e: None, failures=RangeFailures())
    try:
        bad = sinks_from_list([{"stream": "out", "type": "redis-stream", "url": "redis://localhost:6399",
                                "redis_stream": "mw:ranges:{c}", "name": "bad"}])
        c.shared.topology = Topology(sinks=bad)
        c.keep({(sink_node("bad"), 0): 3}, set())
        assert not c.sinks and "bad" in c.down()
        assert any("names the Redis server that holds this service's own store" in r.getMessage()
                   for r in caplog.records)
    finally:
        stopped.set()
        for t in c.threads:
            t.join(10)
        inner.close()
