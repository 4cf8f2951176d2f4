"""What is specific to the Redis store: URLs and auth, single-slot scripts, script
reloading, retries that never apply a checkpoint twice, and lost-write detection
(the last two on one redis-server and on a real Redis Cluster)."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from typing import Any, Iterator

import pytest
import redis
from redis.crc import key_slot

from millwheel.errors import InvalidSpecError, StoreError
from millwheel.record import Record, Timer
from millwheel.state import open_store
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.redis_connection import LostWritesError
from millwheel.state.redis_store import RedisStore
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.redis_server import RedisServer, free_port


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture(params=["redis", "redis-cluster"])
def target(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    """(store URL, a plain redis-py client of the same data): one redis-server, or the
    session's 3-master cluster under a prefix of this test's own."""
    if request.param == "redis":
        with RedisServer() as srv:
            yield srv.url, redis.Redis(port=srv.port)
    else:
        nodes: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        prefix = "s" + hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:12]
        raw = redis.RedisCluster(host="127.0.0.1", port=nodes.nodes[0].port)
        yield f"{nodes.url}?prefix={prefix}", raw
        raw.close()


def key(url: str, name: str) -> str:
    """A store key name under the URL's prefix (``mw`` by default)."""
    prefix = url.partition("?prefix=")[2] or "mw"
    return f"{prefix}:{name}"


def full_cp(token: int, n: int = 0) -> Checkpoint:
    return Checkpoint(
        "counts", 0, token, 100 + n, state_writes={f"k{n}": b"v", "shared": str(n).encode()},
        timer_sets=[Timer(f"k{n}", "end", 10)],
        productions=[Production("totals", "counts", Record(f"k{n}", b"out", 5, f"p{n}"))],
        consumed_ids=[f"in-{n}"],
    )


# -- URL, options, auth ------------------------------------------------------------

def test_url_options_are_applied_and_unknown_ones_refused(server: RedisServer) -> None:
    url = f"{server.url}?max_connections=3&socket_timeout=4&connect_timeout=1&prefix=app1&retry_deadline=2"
    store = RedisStore.from_url(url)
    pool = store._r.connection_pool
    assert pool.max_connections == 3
    assert pool.connection_kwargs["socket_timeout"] == 4.0
    store.acquire("c", 0)
    assert redis.Redis(port=server.port).keys("mw:*") == []
    assert redis.Redis(port=server.port).get("app1:r:{c:0}:token") == b"1"
    with pytest.raises(InvalidSpecError, match="unknown options.*max_conections"):
        open_store(f"{server.url}?max_conections=3")
    with pytest.raises(InvalidSpecError, match="socket_timeout"):
        open_store(f"{server.url}?socket_timeout=soon")
    with pytest.raises(InvalidSpecError, match="braces"):
        open_store(f"{server.url}?prefix=a{{b}}")


def test_password_from_url_or_environment_and_acl_user(monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisServer(requirepass="s3cret") as srv:
        assert open_store(srv.url).acquire("c", 0) == 1
        bare = f"redis://127.0.0.1:{srv.port}/0"
        monkeypatch.setenv("MILLWHEEL_REDIS_PASSWORD", "s3cret")
        assert open_store(bare).acquire("c", 0) == 2
        monkeypatch.delenv("MILLWHEEL_REDIS_PASSWORD")
        started = time.monotonic()
        with pytest.raises(StoreError) as info:
            open_store(f"redis://:wrong@127.0.0.1:{srv.port}/0").current_token("c", 0)
        assert time.monotonic() - started < 5, "a wrong password must not be retried"
        assert "wrong" not in str(info.value) and "***" in str(info.value)
        admin = redis.Redis(port=srv.port, password="s3cret")
        admin.acl_setuser("millwheel", enabled=True, passwords=["+pw1"], keys=["mw:*"], commands=["+@all"])
        assert open_store(f"redis://millwheel:pw1@127.0.0.1:{srv.port}/0").acquire("c", 0) == 3
        monkeypatch.setenv("MILLWHEEL_REDIS_USERNAME", "millwheel")
        monkeypatch.setenv("MILLWHEEL_REDIS_PASSWORD", "pw1")
        assert open_store(bare).acquire("c", 0) == 4


# -- Cluster readiness ------------------------------------------------------------------

@pytest.mark.parametrize("computation", ["counts", "a:b", "x{y}z", "}{", "injector:events", "ключ"])
def test_every_key_a_script_touches_is_in_one_slot(computation: str) -> None:
    store = RedisStore(redis.Redis(), prefix="mw")
    for range_id in (0, 7, 1023):
        keys = list(vars(store._range(computation, range_id)).values())
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys
    assert len({key_slot(k.encode()) for k in store._log(computation)}) == 1
    slots = {key_slot(store._range("counts", r).state.encode()) for r in range(64)}
    assert len(slots) > 32, "ranges of one computation should spread over the cluster"


# -- scripts, retries, idempotence --------------------------------------------------

def test_scripts_are_reloaded_after_script_flush(target: tuple[str, Any]) -> None:
    url, raw = target
    store = RedisStore.from_url(url)
    t = store.acquire("counts", 0)
    store.checkpoint(full_cp(t, 1))
    raw.script_flush()  # on a cluster: on every master
    store.checkpoint(full_cp(t, 2))
    assert store.read_state("counts", ["k1", "k2"]) == {"k1": b"v", "k2": b"v"}


class ReplyDroppingProxy:
    """TCP proxy to Redis. When armed, the next client packet containing ``marker`` is
    delivered to Redis, and then the connection is cut before the reply comes back:
    exactly a reply lost after the server applied the command."""

    def __init__(self, upstream_port: int, marker: bytes) -> None:
        self.upstream_port = upstream_port
        self.marker = marker
        self.armed = False
        self.cuts = 0
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            hold = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, hold), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, hold), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, hold: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                if self.armed and self.marker in data:
                    self.armed = False
                    hold.set()  # swallow the reply
                    upstream.sendall(data)
                    time.sleep(0.3)  # Redis applies the command meanwhile
                    self.cuts += 1
                    break
                upstream.sendall(data)
        except OSError:
            pass
        for sock in (client, upstream):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _down(self, upstream: socket.socket, client: socket.socket, hold: threading.Event) -> None:
        try:
            while data := upstream.recv(65536):
                if not hold.is_set():
                    client.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()


def test_checkpoint_whose_reply_is_lost_is_retried_and_applied_once(server: RedisServer) -> None:
    proxy = ReplyDroppingProxy(server.port, b"EVALSHA")
    try:
        store = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0")
        raw = redis.Redis(port=server.port)
        t = store.acquire("counts", 0)
        store.checkpoint(full_cp(t, 1))
        raw.config_resetstat()
        proxy.armed = True
        store.checkpoint(full_cp(t, 2))
        assert proxy.cuts == 1
        calls = raw.info("commandstats")["cmdstat_evalsha"]["calls"]
        assert calls == 2, "the checkpoint was not sent twice"
        assert raw.get("mw:r:{counts:0}:oseq") == b"2"  # one outbox append per production
        assert [p.record.record_id for p in store.read_outbox("counts", 0)] == ["p1", "p2"]
        store.checkpoint(full_cp(t, 3))  # the range's lineage is intact
        assert store.read_state("counts", ["shared"]) == {"shared": b"3"}
    finally:
        proxy.close()


def test_lost_writes_are_detected_instead_of_built_upon(target: tuple[str, Any]) -> None:
    url, raw = target
    store = RedisStore.from_url(url)
    last = key(url, "r:{counts:0}:last")
    t = store.acquire("counts", 0)
    store.checkpoint(full_cp(t, 1))
    snapshot = raw.get(last)
    store.checkpoint(full_cp(t, 2))
    raw.set(last, snapshot or b"")  # Redis "forgot" checkpoint 2
    with pytest.raises(LostWritesError, match="lost acknowledged writes"):
        store.checkpoint(full_cp(t, 3))
    assert store.read_state("counts", ["k3"]) == {}
    fresh = RedisStore.from_url(url)  # a restarted worker recovers from what Redis holds
    t2 = fresh.acquire("counts", 0)
    fresh.checkpoint(full_cp(t2, 3))
    assert fresh.read_state("counts", ["k3"]) == {"k3": b"v"}


def test_unreachable_redis_gives_up_after_the_retry_deadline(server: RedisServer) -> None:
    store = RedisStore.from_url(f"{server.url}?retry_deadline=0.4")
    t = store.acquire("counts", 0)
    server.kill()
    started = time.monotonic()
    with pytest.raises(StoreError, match="Redis unreachable for 0.4s"):
        store.checkpoint(full_cp(t, 1))
    assert time.monotonic() - started < 3


def test_rediss_url_speaks_tls_with_the_given_ca() -> None:
    with RedisServer(tls=True, requirepass="pw") as srv:
        store = open_store(srv.url)
        try:
            t = store.acquire("counts", 0)
            store.checkpoint(full_cp(t, 1))
            assert store.read_state("counts", ["k1"]) == {"k1": b"v"}
        finally:
            store.close()
        plain = open_store(f"redis://:pw@127.0.0.1:{srv.port}/0?retry_deadline=0.3")
        with pytest.raises(StoreError):
            plain.current_token("counts", 0)
