"""The Redis write group (millwheel/state/redis_group.py): a local runner step's writes
applied by one script, whole or not at all, on a real redis-server.

What a user relies on: a write refused in the middle of a step (another runner took a
range) or a key holding foreign data leaves nothing of the step in Redis, in
particular not the producer's checkpoint whose outbox entry the group dropped; a step
whose reply was lost is retried and applied once; lost Redis writes are detected; on
Redis Cluster nothing is grouped.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import redis

from millwheel.errors import CorruptDataError, FencedError, StoreError
from millwheel.record import Record, Timer
from millwheel.runtime.grouped import GroupedStore
from millwheel.state.protocol import Checkpoint, Production
from millwheel.state.redis_connection import LostWritesError
from millwheel.state.redis_store import RedisStore
from tests.integration.test_redis_store import ReplyDroppingProxy
from tests.support.redis_cluster import RedisClusterNodes
from tests.support.redis_server import RedisServer


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def produce(token: int, n: int) -> Checkpoint:
    """``up`` range 0 consumes input ``in-n`` and produces ``x-n`` for ``down``."""
    return Checkpoint(
        "up", 0, token, 100 + n, state_writes={"k": str(n).encode()},
        productions=[Production("down", "s", Record("k", b"out", 5, f"x-{n}"))],
        consumed_ids=[f"in-{n}"], counters={"skipped": 1}, errors=[f"e{n}".encode()],
    )


def consume(token: int, n: int) -> Checkpoint:
    """``down`` range 0 consumes ``x-n``: state, a timer, the consumed ID."""
    return Checkpoint("down", 0, token, 200 + n, state_writes={"k": str(n).encode()},
                      timer_sets=[Timer("k", "end", 10 + n)], consumed_ids=[f"x-{n}"])


def step(store: RedisStore, t_up: int, t_down: int, n: int) -> GroupedStore:
    """One runner step's writes, held by the runner's GroupedStore: the producer's
    checkpoint, the consumer's, then the producer's ack of the entry (so the group
    drops the entry: written and acked within it), the sink log and watermarks."""
    grouped = GroupedStore(store)
    with grouped.deferring():
        grouped.checkpoint(produce(t_up, n))
        grouped.checkpoint(consume(t_down, n))
        grouped.ack("up", 0, t_up, [("down", f"x-{n}")])
        grouped.append_log("results", [Record("k", str(n).encode(), 7, f"w-{n}")])
        grouped.submit(lambda: store.report_watermark("down", 0, t_down, 1000 + n))
    return grouped


def visible(store: RedisStore) -> object:
    return (
        store.read_state("up", ["k"], 0), store.read_state("down", ["k"], 0),
        store.contains_ids("up", 0, ["in-1", "in-2"]), store.contains_ids("down", 0, ["x-1", "x-2"]),
        store.read_outbox("up", 0), store.read_timers("down", 0),
        store.read_log("results", 0, 100), store.read_watermarks("down"),
        store.read_errors("up", 0),
    )


def test_a_step_is_applied_by_one_script_with_the_entries_it_acked_never_written(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url)
    raw = redis.Redis(port=server.port)
    t_up, t_down = store.acquire("up", 0), store.acquire("down", 0)
    raw.config_resetstat()
    grouped = step(store, t_up, t_down, 1)
    assert grouped.cancelled == 0  # held: nothing applied yet, not even the producer
    assert store.read_state("up", ["k"], 0) == {}
    grouped.flush()
    assert grouped.cancelled == 1
    assert raw.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
    assert raw.hlen("mw:r:{up:0}:outbox") == 0 and raw.get("mw:r:{up:0}:oseq") is None
    assert store.read_state("up", ["k"], 0) == {"k": b"1"}
    assert store.read_state("down", ["k"], 0) == {"k": b"1"}
    assert store.contains_ids("up", 0, ["in-1"]) == {"in-1"}
    assert store.contains_ids("down", 0, ["x-1"]) == {"x-1"}
    assert store.read_timers("down", 0) == [Timer("k", "end", 11)]
    assert [r.record_id for _s, r in store.read_log("results", 0, 10)] == ["w-1"]
    assert store.read_watermarks("down") == {0: 1001}
    assert store.read_errors("up", 0).counters == {"skipped": 1}


def test_a_refused_write_in_the_middle_of_a_step_leaves_nothing_of_the_step(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url)
    t_up, t_down = store.acquire("up", 0), store.acquire("down", 0)
    step(store, t_up, t_down, 1).flush()
    before = visible(store)
    RedisStore.from_url(server.url).acquire("down", 0)  # another runner takes the consumer range
    grouped = step(store, t_up, t_down, 2)
    with pytest.raises(FencedError) as refused:
        grouped.flush()
    assert (refused.value.computation, refused.value.range_id) == ("down", 0)
    # Not even the producer's checkpoint before it: applied alone, it would have
    # consumed in-2 with its entry for down dropped (x-2 lost for good).
    assert visible(store) == before
    assert store.contains_ids("up", 0, ["in-2"]) == set()


def test_foreign_data_in_any_key_of_a_step_refuses_the_whole_step(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url)
    raw = redis.Redis(port=server.port)
    t_up, t_down = store.acquire("up", 0), store.acquire("down", 0)
    raw.rpush("mw:r:{down:0}:skeys", "foreign")  # a zset's key holding a list
    with pytest.raises(CorruptDataError, match=r"mw:r:\{down:0\}:skeys"):
        step(store, t_up, t_down, 1).flush()
    assert store.read_state("up", ["k"], 0) == {}
    assert store.contains_ids("up", 0, ["in-1"]) == set()
    assert raw.get("mw:r:{up:0}:last") is None


def test_a_step_whose_reply_is_lost_is_retried_and_applied_once(server: RedisServer) -> None:
    proxy = ReplyDroppingProxy(server.port, b"EVALSHA")
    try:
        store = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0")
        raw = redis.Redis(port=server.port)
        t_up, t_down = store.acquire("up", 0), store.acquire("down", 0)
        step(store, t_up, t_down, 1).flush()
        raw.config_resetstat()
        proxy.armed = True
        step(store, t_up, t_down, 2).flush()
        assert proxy.cuts == 1
        assert raw.info("commandstats")["cmdstat_evalsha"]["calls"] == 2, "the step was not sent twice"
        errors = store.read_errors("up", 0)
        assert errors.counters == {"skipped": 2} and errors.recent == [b"e2", b"e1"]  # once each
        assert [r.record_id for _s, r in store.read_log("results", 0, 10)] == ["w-1", "w-2"]
        step(store, t_up, t_down, 3).flush()  # the ranges' lineage is intact
        assert store.read_state("down", ["k"], 0) == {"k": b"3"}
    finally:
        proxy.close()


def test_lost_writes_are_detected_by_a_step(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url)
    raw = redis.Redis(port=server.port)
    t_up, t_down = store.acquire("up", 0), store.acquire("down", 0)
    step(store, t_up, t_down, 1).flush()
    snapshot = raw.get("mw:r:{down:0}:last")
    step(store, t_up, t_down, 2).flush()
    raw.set("mw:r:{down:0}:last", snapshot or b"")  # Redis "forgot" step 2 of down
    before = visible(store)
    with pytest.raises(LostWritesError, match="lost acknowledged writes of 'down' range 0"):
        step(store, t_up, t_down, 3).flush()
    assert visible(store) == before


def test_only_the_grouped_writes_are_allowed_inside_a_group(server: RedisServer) -> None:
    store = RedisStore.from_url(server.url)
    t = store.acquire("up", 0)
    group = store.write_group
    assert group is not None
    with pytest.raises(StoreError, match="not allowed inside a write group"):
        with group():
            store.checkpoint(produce(t, 1))
            store.bump_attempts("up", 0, t, "in-1", b"{}")  # would overtake the held checkpoint
    assert store.read_state("up", ["k"], 0) == {}  # the group was dropped with the error
    assert store.read_errors("up", 0).attempts == {}


def test_redis_cluster_offers_no_write_group(redis_cluster: RedisClusterNodes, server: RedisServer) -> None:
    """One script cannot reach keys in several slots: on a cluster every write stays a
    script of its own (the runner then writes at once), on one node it is grouped."""
    assert RedisStore.from_url(f"{redis_cluster.url}?prefix=g").write_group is None
    assert RedisStore.from_url(server.url).write_group is not None
